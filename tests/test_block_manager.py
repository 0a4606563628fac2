"""Unit tests of the paged stages' block manager and scheduler (stage 03 and later)."""

import pytest
from common import ENGINES, engine_module, level, load_engine, random_prompts

PAGED = [e for e in ENGINES if level(e) >= 3]
PREFIX = [e for e in ENGINES if level(e) >= 4]


def make_seq(engine, token_ids, **params):
    st = load_engine(engine)
    return engine_module(engine, "engine.sequence").Sequence(token_ids, st.SamplingParams(**params))


def manager(engine, num_blocks=8, block_size=4):
    return engine_module(engine, "engine.block_manager").BlockManager(num_blocks, block_size)


@pytest.mark.parametrize("engine", PAGED)
def test_allocate_append_free(engine):
    bm = manager(engine)
    seq = make_seq(engine, list(range(10)))  # 10 tokens -> 3 blocks of 4
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    seq.append_token(10), seq.append_token(11)  # 12 tokens: still 3 blocks
    assert bm.can_append(seq)
    bm.may_append(seq)
    assert len(seq.block_table) == 3
    seq.append_token(12)  # 13 tokens: a 4th block
    bm.may_append(seq)
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 4
    bm.deallocate(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8


@pytest.mark.parametrize("engine", PAGED)
def test_cannot_allocate_beyond_pool(engine):
    bm = manager(engine, num_blocks=2)
    assert not bm.can_allocate(make_seq(engine, list(range(9))))  # needs 3 blocks


@pytest.mark.parametrize("engine", PREFIX)
def test_prefix_hits_share_blocks_and_confirm_tokens(engine):
    bm = manager(engine, num_blocks=16)
    a = make_seq(engine, list(range(13)))
    bm.allocate(a)
    bm.hash_blocks(a, len(a))  # the step computed all of a's K/V
    b = make_seq(engine, list(range(12)) + [99])  # same first 3 blocks, different last token
    bm.allocate(b)
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    assert b.num_cached_tokens == 12
    assert all(bm.blocks[i].ref_count == 2 for i in a.block_table[:3])
    # same tokens in block 1 but a different block 0: the chained hash must miss
    c = make_seq(engine, [7, 7, 7, 7] + list(range(4, 13)))
    bm.allocate(c)
    assert c.num_cached_tokens == 0 and not set(c.block_table) & set(a.block_table)


@pytest.mark.parametrize("engine", PREFIX)
def test_last_token_is_always_computed(engine):
    bm = manager(engine, num_blocks=16)
    a = make_seq(engine, list(range(8)))  # exactly 2 full blocks
    bm.allocate(a)
    bm.hash_blocks(a, len(a))
    b = make_seq(engine, list(range(8)))
    bm.allocate(b)
    assert b.num_cached_tokens == 4  # block 2 holds the last token: recomputed


@pytest.mark.parametrize("engine", PREFIX)
def test_freed_blocks_stay_findable_until_reused(engine):
    bm = manager(engine, num_blocks=4)
    a = make_seq(engine, list(range(9)))
    bm.allocate(a)
    bm.hash_blocks(a, len(a))
    bm.deallocate(a)
    assert bm.num_free_blocks == 4
    b = make_seq(engine, list(range(9)))
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and bm.num_free_blocks == 1
    bm.deallocate(b)
    other = make_seq(engine, [50 + i for i in range(16)])  # takes every block, overwriting them
    bm.allocate(other)
    bm.deallocate(other)
    c = make_seq(engine, list(range(9)))
    bm.allocate(c)
    assert c.num_cached_tokens == 0


@pytest.mark.parametrize("engine", PREFIX)
def test_hash_collision_is_rejected(engine):
    """A map entry whose block holds other tokens (as after a collision) is not a hit."""
    bm = manager(engine, num_blocks=8)
    a = make_seq(engine, list(range(9)))
    bm.allocate(a)
    bm.hash_blocks(a, len(a))
    bm.blocks[a.block_table[0]].token_ids = [9, 9, 9, 9]  # pretend the hash matched other tokens
    b = make_seq(engine, list(range(9)))
    bm.allocate(b)
    assert b.num_cached_tokens == 0


@pytest.mark.parametrize("engine", PREFIX)
def test_chained_hash(engine):
    block_hash = engine_module(engine, "engine.block_manager").block_hash
    h0 = block_hash([1, 2, 3, 4], -1)
    assert block_hash([1, 2, 3, 4], -1) == h0
    assert block_hash([5, 6, 7, 8], h0) != block_hash([5, 6, 7, 8], -1)
    assert block_hash([1, 2, 3, 5], -1) != h0


@pytest.mark.parametrize("engine", PAGED)
def test_no_block_leaks_and_no_lost_requests(engine, model_dir):
    """After a run with preemptions and prefix hits, every block is free again and
    every request finished exactly once."""
    st = load_engine(engine)
    prefix = random_prompts([12], seed=1)[0]
    prompts = [prefix + p for p in random_prompts([3, 9, 1, 14, 6, 2, 11, 5], seed=2)]
    with st.LLM(
        model_dir("qwen3"),
        device="cpu",
        max_model_len=48,
        kvcache_block_size=4,
        num_kvcache_blocks=14,
        max_num_seqs=4,
    ) as llm:
        outs = llm.generate(
            prompts,
            st.SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True),
            use_tqdm=False,
        )
        bm = llm.engine.block_manager
        assert [len(o["token_ids"]) for o in outs] == [20] * len(prompts)
        assert bm.num_free_blocks == bm.num_blocks
        assert sum(s["preemptions"] for s in llm.stats) > 0
        if level(engine) >= 4:
            assert all(b.ref_count == 0 for b in bm.blocks)


@pytest.mark.parametrize("engine", PAGED)
def test_scheduler_prefers_prefill_and_caps_batch(engine, model_dir):
    st = load_engine(engine)
    with st.LLM(model_dir("qwen3"), device="cpu", max_model_len=64, max_num_seqs=2) as llm:
        llm.generate(
            random_prompts([5, 6, 7], seed=3),
            st.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
            use_tqdm=False,
        )
        first = llm.stats[0]
        assert first["is_prefill"] and first["num_seqs"] == 2 and first["waiting"] == 1
        assert all(s["num_seqs"] <= 2 for s in llm.stats)
        # the third request joins as soon as one finishes (continuous batching)
        joined = next(i for i, s in enumerate(llm.stats) if s["waiting"] == 0)
        assert joined < len(llm.stats) - 1


@pytest.mark.parametrize("engine", PAGED)
def test_kv_budget_too_small_is_a_startup_error(engine, model_dir):
    st = load_engine(engine)
    with pytest.raises(ValueError, match="one sequence of max_model_len=64 needs 16"):
        st.LLM(
            model_dir("qwen3"),
            device="cpu",
            max_model_len=64,
            kvcache_block_size=4,
            num_kvcache_blocks=10,
        )
    with pytest.raises(ValueError, match="KV cache"):
        st.LLM(model_dir("qwen3"), device="cpu", max_model_len=64, cpu_kvcache_bytes=1000)


def test_contiguous_cache_too_big_is_a_startup_error(model_dir):
    st = load_engine("02_kvcache")
    with pytest.raises(ValueError, match="lower max_num_seqs or max_model_len"):
        st.LLM(
            model_dir("qwen3"),
            device="cpu",
            max_model_len=512,
            max_num_seqs=64,
            cpu_kvcache_bytes=1 << 20,
        )


@pytest.mark.parametrize("engine", [e for e in ENGINES if level(e) >= 6])
def test_cudagraph_ladder(engine):
    runner = engine_module(
        engine, "engine.cuda_graphs" if engine == "final" else "engine.model_runner"
    )
    assert runner.graph_batch_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert runner.graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert runner.graph_batch_sizes(1000)[-1] == 512
    sizes = runner.graph_batch_sizes(48)
    assert [runner.graph_for(n, sizes) for n in (1, 3, 8, 17, 40, 48)] == [1, 4, 8, 32, 48, 48]
