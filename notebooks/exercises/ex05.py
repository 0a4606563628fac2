"""Checks for 05_chunked_prefill.ipynb: one step of the token-budget scheduler, and the chunks a
long prompt is cut into."""

from types import SimpleNamespace

import torch

from . import stage
from .report import expect_equal

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


def stage_chunks(prompt_len: int, num_decoding: int, budget: int) -> list[int]:
    """Run the stage's engine: num_decoding sequences decode; then a prompt of prompt_len tokens
    arrives. The tokens the prompt feeds in each step until it is in the cache."""
    st = stage.load(STAGE)
    Sequence = stage.module(STAGE, "engine.sequence").Sequence
    g = torch.Generator().manual_seed(9)
    options = dict(device="cpu", max_num_batched_tokens=budget, kvcache_block_size=8, max_model_len=512, max_num_seqs=8)
    with st.LLM(stage.tiny_model(), **options) as llm:
        engine = llm.engine
        for _ in range(num_decoding):
            engine.add(Sequence([5, 6], st.SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)))
        engine.step()  # their prefill: from now on they decode
        doc = Sequence(torch.randint(3, 500, (prompt_len,), generator=g).tolist(), st.SamplingParams(max_tokens=1))
        engine.add(doc)
        chunks = []
        while doc.num_cached_tokens < prompt_len:
            before = doc.num_cached_tokens
            engine.step()
            chunks.append(doc.num_cached_tokens - before)
    return chunks


CHUNK_CASES = [(256, 3, 64), (200, 3, 64), (100, 1, 32), (40, 2, 64), (130, 5, 16)]


def check_document_chunks(document_chunks) -> str:
    """document_chunks(prompt_len, num_decoding, budget) -> the prompt tokens fed in each step.
    Compared with a run of the stage's engine."""
    for prompt_len, num_decoding, budget in CHUNK_CASES:
        expected = stage_chunks(prompt_len, num_decoding, budget)
        got = document_chunks(prompt_len, num_decoding, budget)
        expect_equal(got, expected, "the chunks differ from the stage's engine run (the decoding sequences "
                     "take one token each of every step's budget first)",
                     prompt_len=prompt_len, num_decoding=num_decoding, budget=budget)
    return f"the same chunks as the stage's engine in {len(CHUNK_CASES)} runs"
