"""The core promise: every engine's greedy output equals Hugging Face's, token for token.

The stress cases push each mechanism (tiny blocks, preemption, chunked prefill,
shared prefixes, more prompts than batch slots); options a stage does not have
yet are ignored by it, and the output must still match. Where a stage has the
mechanism, the test also asserts that the mechanism actually ran."""

import pytest
from common import (
    ENGINES,
    TINY_MODELS,
    check_chunked_prefill,
    check_preemption,
    check_shared_prefix,
    generate_and_compare,
    level,
    load_engine,
    random_prompts,
)

MAX_TOKENS = 24


@pytest.mark.parametrize("model", list(TINY_MODELS))
@pytest.mark.parametrize("engine", ENGINES)
def test_greedy_matches_hf(engine, model, model_dir, hf_greedy):
    st, path = load_engine(engine), model_dir(model)
    prompts = random_prompts([1, 9, 30, 17, 4], seed=level(engine))
    with st.LLM(path, device="cpu", max_model_len=256) as llm:
        generate_and_compare(st, llm, path, prompts, hf_greedy)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("engine", ENGINES)
def test_block_sizes(engine, block_size, model_dir, hf_greedy):
    st, path = load_engine(engine), model_dir("qwen3")
    prompts = random_prompts([5, 16, 33], seed=10 + block_size)
    with st.LLM(path, device="cpu", max_model_len=128, kvcache_block_size=block_size) as llm:
        generate_and_compare(st, llm, path, prompts, hf_greedy)


@pytest.mark.parametrize("engine", ENGINES)
def test_preemption(engine, model_dir, hf_greedy):
    check_preemption(engine, model_dir("llama"), hf_greedy, seed=20)


@pytest.mark.parametrize("engine", ENGINES)
def test_chunked_prefill(engine, model_dir, hf_greedy):
    check_chunked_prefill(engine, model_dir("qwen3"), hf_greedy, seed=30)


@pytest.mark.parametrize("engine", ENGINES)
def test_shared_prefix(engine, model_dir, hf_greedy):
    check_shared_prefix(engine, model_dir("llama3-rope"), hf_greedy, seed=40)


@pytest.mark.parametrize("engine", ENGINES)
def test_more_prompts_than_slots(engine, model_dir, hf_greedy):
    st, path = load_engine(engine), model_dir("qwen3-untied-mha")
    prompts = random_prompts([3, 8, 5, 13, 2, 7, 9], seed=50)
    with st.LLM(path, device="cpu", max_model_len=64, max_num_seqs=3) as llm:
        generate_and_compare(st, llm, path, prompts, hf_greedy)
        assert max(step["num_seqs"] for step in llm.stats) <= 3


@pytest.mark.parametrize("engine", [e for e in ENGINES if level(e) >= 3])
def test_triton_backend_matches_hf(engine, model_dir, hf_greedy):
    """Our Triton kernels inside the engine (under TRITON_INTERPRET=1 on CPU), with
    preemption and an odd block size so every kernel path runs."""
    st, path = load_engine(engine), model_dir("llama")
    prompts = random_prompts([10, 7, 13], seed=60)
    options = dict(
        device="cpu",
        max_model_len=48,
        kvcache_block_size=3,
        num_kvcache_blocks=16,
        attention_backend="triton",
    )
    with st.LLM(path, **options) as llm:
        generate_and_compare(st, llm, path, prompts, hf_greedy, max_tokens=12)
