"""Checks for 03_paged.ipynb: the slot mapping (write side) and the gather through a block
table (read side) of the paged KV cache."""

import torch

from . import capture, stage
from .report import expect_close, expect_equal, fail

STAGE = "03_paged"


def check_slot_mapping(slot_mapping) -> str:
    """slot_mapping(block_table, start, end, block_size) -> the cache slot of each position
    start..end-1 of a sequence. Compared with the slot mapping the stage's ModelRunner.run builds."""
    st = stage.load(STAGE)
    runner_module = stage.module(STAGE, "engine.model_runner")
    Sequence = stage.module(STAGE, "engine.sequence").Sequence
    g = torch.Generator().manual_seed(4)
    cases = [  # (block size, is_prefill, [(length, cached tokens, block table)])
        (4, True, [(10, 0, [5, 2, 7]), (6, 0, [0, 3]), (3, 0, [6])]),
        (4, False, [(10, 9, [5, 2, 7]), (13, 12, [1, 4, 6, 0]), (8, 7, [3, 2])]),
        (3, True, [(7, 0, [8, 1, 4]), (9, 0, [2, 9, 0])]),
        (3, False, [(7, 6, [8, 1, 4]), (10, 9, [2, 9, 0, 5])]),
    ]
    checked = 0
    for block_size, is_prefill, spec in cases:
        with st.LLM(stage.tiny_model(), device="cpu", kvcache_block_size=block_size, num_kvcache_blocks=16,
                    max_model_len=16) as llm:
            runner = llm.engine.model_runner
            seqs = []
            for length, cached, table in spec:
                seq = Sequence(torch.randint(3, 500, (length,), generator=g).tolist(), st.SamplingParams())
                seq.num_cached_tokens, seq.block_table = cached, list(table)
                seqs.append(seq)
            with capture.step_inputs(runner, runner_module) as calls:
                runner.run(seqs, is_prefill=is_prefill)
            (call,) = calls
            expected = capture.split(call["context"].slot_mapping, call["context"].cu_seqlens_q)
        for seq, slots in zip(seqs, expected):
            got = slot_mapping(list(seq.block_table), seq.num_cached_tokens, len(seq), block_size)
            expect_equal(got, slots, f"the slots differ from the stage's ({'prefill' if is_prefill else 'decode'})",
                         block_table=seq.block_table, start=seq.num_cached_tokens, end=len(seq), block_size=block_size)
            checked += 1
    return f"the same slots as the stage's runner for {checked} sequences (block sizes 4 and 3, prefill and decode)"


def check_gather_kv(gather_kv) -> str:
    """gather_kv(cache, block_table, context_len) -> (context_len, kv_heads, head_dim): the
    sequence's first context_len tokens, read through its block table (padded with -1).
    Compared with the stage's torch backend, and with the K/V the stage stored."""
    backend = stage.module(STAGE, "layers.attention_torch")
    g = torch.Generator().manual_seed(5)
    num_blocks, kv_heads, head_dim = 10, 2, 4
    checked = 0
    for block_size, table, context_len in ((4, [7, 2, 9, -1], 10), (4, [3, 0, 5, 8], 16), (3, [1, 6, -1, -1], 4),
                                           (3, [4, 9, 0, 2], 12), (5, [8, -1, -1, -1], 1)):
        cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim)
        keys = torch.randn(context_len, kv_heads, head_dim, generator=g)  # the sequence's K, in token order
        positions = torch.arange(context_len)
        slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
        backend.store_kvcache(keys, keys, cache, cache.clone(), slots)  # the stage writes them to their slots
        block_table = torch.tensor(table, dtype=torch.int32)
        expected = backend.gather_kv(cache, block_table, context_len)
        assert torch.equal(expected, keys)  # the stage reads back what it wrote
        got = gather_kv(cache.clone(), block_table.clone(), context_len)
        expect_close(got, expected, "the gathered K/V differ from the stage's gather_kv (token p is at offset "
                     "p % block_size of block block_table[p // block_size])", atol=0.0,
                     block_size=block_size, block_table=table, context_len=context_len)
        checked += 1
    return f"the same K/V as the stage's gather_kv for {checked} block tables (block sizes 3, 4 and 5, tables padded with -1)"


def block_state(engine, index: dict) -> dict:
    """What a step leaves in the block manager: each running request's block table, and the free list."""
    scheduler = engine.scheduler
    return {"tables": {index[s.seq_id]: list(s.block_table) for s in scheduler.running},
            "free": list(scheduler.block_manager.free_block_ids)}


POOL_CASES = [  # (prompt lengths, new tokens, block size, blocks in the pool)
    ([10, 23, 8, 17, 12, 9], [14, 12, 20, 16, 18, 10], 4, 24),  # preempts
    ([7, 16, 5, 12], [9, 17, 12, 8], 8, 64),  # room for everything
    ([9, 14, 6, 11], [12, 8, 15, 10], 3, 22),  # preempts
]


def check_block_manager(BlockManager) -> str:
    """STRETCH. BlockManager(num_blocks, block_size): the stage's free-list block manager, written
    again (num_blocks, block_size, free_block_ids, num_free_blocks, can_allocate, allocate,
    deallocate, can_append, may_append). Installed in the stage's own engine, on pools small
    enough to force preemption; the completions, every step's record, the block tables and the
    free list after every step must be the same as with the stage's."""
    g = torch.Generator().manual_seed(13)
    steps, preempted = 0, 0
    for prompt_lens, max_tokens, block_size, num_blocks in POOL_CASES:
        prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in prompt_lens]

        def install(llm):
            bm = BlockManager(num_blocks, block_size)
            llm.engine.block_manager = llm.engine.scheduler.block_manager = bm

        options = dict(kvcache_block_size=block_size, num_kvcache_blocks=num_blocks, max_model_len=64)
        steps += stage.compare_runs(STAGE, options, prompts, max_tokens, install, "BlockManager", trace=block_state,
                                    inputs=dict(prompt_lens=prompt_lens, max_tokens=max_tokens, block_size=block_size,
                                                num_blocks=num_blocks))
    return (f"in the stage's engine, the same tokens, block tables and free list as its own BlockManager over {steps} "
            f"steps of {len(POOL_CASES)} workloads, preemptions included")
