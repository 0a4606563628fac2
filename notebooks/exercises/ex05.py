"""Checks for 05_chunked_prefill.ipynb: one step of the token-budget scheduler, and the chunks a
long prompt is cut into."""

from types import SimpleNamespace

import torch

from . import stage
from .report import expect_equal, fail

STAGE = "05_chunked_prefill"

PLAN_CASES = [  # (running: tokens each still has to feed, waiting: prompt lengths, budget, max_num_seqs)
    ([1, 1, 1], [256], 64, 4),
    ([1, 1, 1, 45], [], 64, 4),
    ([1, 1, 1, 200], [30], 64, 8),
    ([1] * 6, [10, 20, 5], 16, 8),
    ([1, 1], [3, 3, 3], 64, 3),
    ([1] * 5, [], 3, 8),
    ([], [100, 8], 32, 4),
    ([], [10, 12, 9], 64, 4),
    ([40, 1], [7], 32, 4),
]


def stage_plan(running: list[int], waiting: list[int], budget: int, max_num_seqs: int) -> list[int]:
    """What the stage's Scheduler.schedule() gives each sequence, in the order it schedules them."""
    st = stage.load(STAGE)
    Sequence = stage.module(STAGE, "engine.sequence").Sequence
    SequenceStatus = stage.module(STAGE, "engine.sequence").SequenceStatus
    BlockManager = stage.module(STAGE, "engine.block_manager").BlockManager
    Scheduler = stage.module(STAGE, "engine.scheduler").Scheduler
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=4096)
    scheduler = Scheduler(config, [], BlockManager(num_blocks=1024, block_size=16))  # blocks are plentiful here
    g = torch.Generator().manual_seed(8)
    for left in running:
        cached = 20  # a decode (left == 1) or a prompt whose first 20 tokens are in the cache
        seq = Sequence(torch.randint(3, 500, (cached + left,), generator=g).tolist(), st.SamplingParams())
        scheduler.block_manager.allocate(seq)
        seq.num_cached_tokens, seq.status = cached, SequenceStatus.RUNNING
        scheduler.running.append(seq)
    for length in waiting:
        scheduler.add(Sequence(torch.randint(3, 500, (length,), generator=g).tolist(), st.SamplingParams()))
    return [seq.num_scheduled_tokens for seq in scheduler.schedule()]


def check_plan_step(plan_step) -> str:
    """plan_step(running, waiting, budget, max_num_seqs) -> the tokens each scheduled sequence feeds
    this step, running ones first. Compared with the stage's Scheduler.schedule()."""
    for running, waiting, budget, max_num_seqs in PLAN_CASES:
        expected = stage_plan(running, waiting, budget, max_num_seqs)
        got = plan_step(list(running), list(waiting), budget, max_num_seqs)
        expect_equal(got, expected, "the step differs from the stage's scheduler (running sequences first, in "
                     "order, each min(tokens left, budget left); then waiting prompts while the budget lasts and "
                     "fewer than max_num_seqs run)",
                     running=running, waiting=waiting, budget=budget, max_num_seqs=max_num_seqs)
    return f"the same step as the stage's scheduler in {len(PLAN_CASES)} situations"


def stage_chunks(prompt_len: int, num_decoding: int, budget: int, max_steps: int = 24) -> list[int] | None:
    """Run the stage's engine: num_decoding sequences decode; then a prompt of prompt_len tokens
    arrives. The tokens the prompt feeds in each step until it is in the cache; None if it has
    fed nothing after max_steps steps (the decoding sequences take the whole budget)."""
    st = stage.load(STAGE)
    Sequence = stage.module(STAGE, "engine.sequence").Sequence
    g = torch.Generator().manual_seed(9)
    options = dict(device="cpu", max_num_batched_tokens=budget, kvcache_block_size=8, max_model_len=512, max_num_seqs=8)
    with st.LLM(stage.tiny_model(), **options) as llm:
        engine = llm.engine
        for _ in range(num_decoding):
            engine.add(Sequence([5, 6], st.SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)))
        for _ in range(-(-2 * num_decoding // budget)):
            engine.step()  # their prefill: from now on they decode
        doc = Sequence(torch.randint(3, 500, (prompt_len,), generator=g).tolist(), st.SamplingParams(max_tokens=1))
        engine.add(doc)
        chunks = []
        while doc.num_cached_tokens < prompt_len:
            before = doc.num_cached_tokens
            engine.step()
            chunks.append(doc.num_cached_tokens - before)
            if len(chunks) == max_steps and not any(chunks):
                return None
    return chunks


CHUNK_CASES = [(256, 3, 64), (200, 3, 64), (100, 1, 32), (40, 2, 64), (130, 5, 16), (50, 4, 4), (30, 5, 3)]


def call_with_time_limit(fn, *args, seconds: float = 2.0):
    """fn(*args), stopped with ExerciseFailed if it runs longer than `seconds` (an endless loop)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        return fn(*args)

    def stop(signum, frame):
        raise TimeoutError

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn(*args)
    except TimeoutError:
        fail(f"no answer after {seconds:.0f} s: an endless loop? (a chunk of 0 tokens never finishes the prompt)",
             call=f"{getattr(fn, '__name__', 'it')}{args}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def check_document_chunks(document_chunks) -> str:
    """document_chunks(prompt_len, num_decoding, budget) -> the prompt tokens fed in each step;
    a ValueError when the decoding sequences leave the prompt no room (it would never start).
    Compared with a run of the stage's engine."""
    for prompt_len, num_decoding, budget in CHUNK_CASES:
        expected = stage_chunks(prompt_len, num_decoding, budget)
        inputs = dict(prompt_len=prompt_len, num_decoding=num_decoding, budget=budget)
        if expected is None:
            try:
                got = call_with_time_limit(document_chunks, prompt_len, num_decoding, budget)
            except ValueError:
                continue
            fail("the decoding sequences take the whole budget, so the stage's engine never starts the prompt while "
                 "they decode: raise ValueError", **inputs, got=got)
        got = call_with_time_limit(document_chunks, prompt_len, num_decoding, budget)
        expect_equal(got, expected, "the chunks differ from the stage's engine run (the decoding sequences "
                     "take one token each of every step's budget first)", **inputs)
    return (f"the same chunks as the stage's engine in {len(CHUNK_CASES)} runs, including budgets the decoding "
            "sequences fill on their own")


def queue_state(engine, index: dict) -> dict:
    """The queues after a step, in order, with the tokens each running request has in the cache."""
    scheduler = engine.scheduler
    return {"running": [(index[s.seq_id], s.num_cached_tokens) for s in scheduler.running],
            "waiting": [index[s.seq_id] for s in scheduler.waiting]}


SCHEDULE_CASES = [  # (prompt lengths, new tokens, budget, max_num_seqs, blocks of 8 in the pool)
    ([8, 10, 6, 12, 256, 200], [30, 30, 10, 24, 4, 4], 64, 4, 128),  # the notebook's workload, shorter chats
    ([40, 9, 70, 12, 33, 18], [20, 24, 10, 28, 16, 12], 32, 4, 22),  # a pool small enough to preempt
    ([5, 6, 7, 8, 9, 10, 11], [12, 10, 8, 6, 9, 11, 7], 3, 8, 64),  # a budget smaller than the batch
]


def check_schedule(schedule) -> str:
    """STRETCH. schedule(self) -> list[Sequence]: the stage's Scheduler.schedule, written as one
    function and bound to the stage's own Scheduler in its own engine (self.running,
    self.waiting, self.block_manager, self.preempt, self.max_num_batched_tokens,
    self.max_num_seqs, self.num_preemptions; set each scheduled sequence's num_scheduled_tokens).
    The completions, every step's record and the queues after every step must be the same as
    with the stage's."""
    import types

    g = torch.Generator().manual_seed(14)
    steps = 0
    for prompt_lens, max_tokens, budget, max_num_seqs, num_blocks in SCHEDULE_CASES:
        prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in prompt_lens]

        def install(llm):
            llm.engine.scheduler.schedule = types.MethodType(schedule, llm.engine.scheduler)

        options = dict(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, kvcache_block_size=8,
                       num_kvcache_blocks=num_blocks, max_model_len=512 if num_blocks >= 64 else 128)
        steps += stage.compare_runs(STAGE, options, prompts, max_tokens, install, "Scheduler.schedule",
                                    trace=queue_state, inputs=dict(prompt_lens=prompt_lens, max_tokens=max_tokens,
                                                                   budget=budget, max_num_seqs=max_num_seqs,
                                                                   num_blocks=num_blocks))
    return (f"bound to the stage's scheduler, the same tokens, steps and queues as its own schedule over {steps} steps "
            f"of {len(SCHEDULE_CASES)} workloads (chunks, preemption, a budget smaller than the batch)")
