"""Checks for 02_kvcache.ipynb: what a cached step feeds the model, and the KV write/read."""

import torch

from . import capture, stage
from .report import expect_close, expect_equal, fail

STAGE = "02_kvcache"


def check_step_inputs(step_inputs) -> str:
    """step_inputs(token_ids, num_cached_tokens, cache_row, max_model_len) -> (input_ids, positions,
    slots): what one step feeds for one sequence. Compared with the stage's ModelRunner.run."""
    st = stage.load(STAGE)
    runner_module = stage.module(STAGE, "engine.model_runner")
    Sequence = stage.module(STAGE, "engine.sequence").Sequence
    max_model_len = 32
    g = torch.Generator().manual_seed(2)
    steps = {  # (length, tokens already cached, cache row) per sequence
        "a prefill": [(5, 0, 0), (3, 0, 2), (7, 0, 1)],
        "a decode step": [(9, 8, 1), (4, 3, 3), (12, 11, 0)],
    }
    with st.LLM(stage.tiny_model(), device="cpu", max_num_seqs=4, max_model_len=max_model_len) as llm:
        runner = llm.engine.model_runner
        for kind, spec in steps.items():
            seqs = []
            for length, cached, row in spec:
                seq = Sequence(torch.randint(3, 500, (length,), generator=g).tolist(), st.SamplingParams())
                seq.num_cached_tokens, seq.cache_row = cached, row
                seqs.append(seq)
            with capture.step_inputs(runner, runner_module) as calls:
                runner.run(seqs)
            (call,) = calls
            cu = call["context"].cu_seqlens_q
            expected = zip(capture.split(call["input_ids"], cu), capture.split(call["positions"], cu),
                           capture.split(call["context"].slot_mapping, cu))
            for seq, (ids, positions, slots) in zip(seqs, expected):
                inputs = dict(token_ids=seq.token_ids, num_cached_tokens=seq.num_cached_tokens,
                              cache_row=seq.cache_row, max_model_len=max_model_len)
                got = step_inputs(list(seq.token_ids), seq.num_cached_tokens, seq.cache_row, max_model_len)
                if not isinstance(got, (tuple, list)) or len(got) != 3:
                    fail("return three lists: (input_ids, positions, slots)", got=got)
                expect_equal(got[0], ids, f"in {kind}, the token ids fed differ from the stage's", **inputs)
                expect_equal(got[1], positions, f"in {kind}, the positions differ from the stage's", **inputs)
                expect_equal(got[2], slots, f"in {kind}, the cache slots differ from the stage's "
                             "(slot = row * max_model_len + position)", **inputs)
    return "the same token ids, positions and cache slots as the stage's runner, at prefill and at decode"


def check_attend_cached(attend_cached) -> str:
    """attend_cached(q, k, v, k_row, v_row, start) -> (n, heads, head_dim): write the new tokens'
    K/V into the sequence's cache row at positions start.., then attend causally over the row's
    first start + n slots. Compared with the stage's Attention layer, over a prefill and two
    decode steps, output and cache contents both."""
    Attention = stage.module(STAGE, "layers.attention").Attention
    context = stage.module(STAGE, "layers.context")
    heads, kv_heads, head_dim, rows, max_len, row = 4, 2, 8, 3, 16, 1
    layer = Attention(heads, kv_heads, head_dim, head_dim**-0.5)
    layer.k_cache = torch.zeros(rows, max_len, kv_heads, head_dim)  # (rows, max_len, kv_heads, head_dim)
    layer.v_cache = torch.zeros(rows, max_len, kv_heads, head_dim)
    k_row, v_row = torch.zeros(max_len, kv_heads, head_dim), torch.zeros(max_len, kv_heads, head_dim)
    g = torch.Generator().manual_seed(3)
    start = 0
    for kind, n in (("the prefill (5 prompt tokens)", 5), ("decode step 1", 1), ("decode step 2", 1)):
        q = torch.randn(n, heads, head_dim, generator=g)
        k, v = torch.randn(n, kv_heads, head_dim, generator=g), torch.randn(n, kv_heads, head_dim, generator=g)
        positions = torch.arange(start, start + n)
        context.set_context(context.Context(cu_seqlens_q=[0, n], slot_mapping=row * max_len + positions,
                                            context_lens=[start + n], cache_rows=[row]))
        try:
            expected = layer(q, k, v)  # (n, heads, head_dim)
        finally:
            context.set_context(None)
        got = attend_cached(q.clone(), k.clone(), v.clone(), k_row, v_row, start)
        shapes = dict(q=tuple(q.shape), k_and_v=tuple(k.shape), cache_row=tuple(k_row.shape), start=start)
        for name, mine, theirs in (("K", k_row, layer.k_cache[row]), ("V", v_row, layer.v_cache[row])):
            if not torch.equal(mine, theirs):
                wrong = sorted({i for i in range(max_len) if not torch.equal(mine[i], theirs[i])})
                fail(f"after {kind}, the {name} cache row holds the wrong values at positions {wrong}: "
                     f"write the new tokens' {name} at positions start .. start + n - 1, in place", **shapes)
        expect_close(got, expected, f"after {kind}, the attention output differs from the stage's "
                     "(causal: query at position p sees keys 0..p; GQA: query head h reads KV head h // (heads // kv_heads))",
                     atol=1e-5, **shapes)
        start += n
    return "the cache row and the attention output match the stage's layer after a prefill and two decode steps"


STATIC_CASES = [  # (prompt lengths, new tokens, max_num_seqs, max_model_len)
    ([12, 40, 8, 24, 30, 6, 18], [20, 30, 35, 10, 25, 15, 28], 4, 96),
    ([5, 9, 7], [6, 3, 9], 2, 64),
    ([20, 10, 30, 14, 8], [50, 12, 40, 60, 4], 3, 64),  # some reach max_model_len before max_tokens
]


def check_static_scheduler(StaticBatchScheduler) -> str:
    """STRETCH. StaticBatchScheduler(max_num_seqs, max_model_len, eos_token_ids): the stage's
    scheduler, written again (add, is_finished, schedule, postprocess, and the `waiting` and
    `running` queues the engine's stats read). Installed in the stage's own engine in place of its
    Scheduler; the completions and every step's record (sequences, tokens, KV slots reserved and
    used) must be the same as with the stage's."""
    g = torch.Generator().manual_seed(12)
    steps = 0
    for prompt_lens, max_tokens, max_num_seqs, max_model_len in STATIC_CASES:
        prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in prompt_lens]

        def install(llm):
            eos = sorted(llm.engine.scheduler.eos_token_ids)
            llm.engine.scheduler = StaticBatchScheduler(max_num_seqs, max_model_len, eos)

        steps += stage.compare_runs(STAGE, dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len), prompts,
                                    max_tokens, install, "Scheduler",
                                    inputs=dict(prompt_lens=prompt_lens, max_tokens=max_tokens,
                                                max_num_seqs=max_num_seqs, max_model_len=max_model_len))
    return (f"in the stage's engine, the same tokens and the same {steps} steps (sequences, tokens, KV slots) as its "
            f"own scheduler, in {len(STATIC_CASES)} workloads")
