"""KV-cache sizing's warm-up step (03_paged onwards): it must be as large as any step the
scheduler may send, in tokens and in sampled rows, so that the memory it measures covers
every step's activations, logits and sampler buffers."""

import pytest
from common import ENGINES, engine_module, level

PAGED = [e for e in ENGINES if level(e) >= 3]


@pytest.mark.parametrize("engine", PAGED)
@pytest.mark.parametrize(
    "budget,max_len,max_seqs",
    [
        (16384, 4096, 256),  # the defaults: one max-length prompt, the rest shared by 255 sequences
        (16384, 4096, 1),  # one sequence: at most max_model_len tokens
        (1000, 4096, 64),  # budget below max_model_len: a lone long prompt may be the largest step
        (8192, 512, 8),  # max_num_seqs * max_model_len caps the tokens
        (300, 200, 512),  # more sequences allowed than tokens: one token each
    ],
)
def test_warmup_step_is_the_largest(engine, budget, max_len, max_seqs):
    lengths = engine_module(engine, "engine.model_runner").warmup_lengths(budget, max_len, max_seqs)
    tokens = min(max(budget, max_len), max_seqs * max_len)
    assert sum(lengths) == tokens  # the most tokens a step may hold
    assert len(lengths) == min(max_seqs, tokens)  # the most rows a step may sample
    assert all(1 <= n <= max_len for n in lengths)  # every prompt is a valid one
    assert lengths[0] == min(max_len, tokens - (len(lengths) - 1))  # the longest prompt first


@pytest.mark.parametrize("engine", PAGED)
def test_warmup_step_runs_and_leaves_the_engine_intact(engine, model_dir, hf_greedy):
    """The warm-up step only runs on CUDA (KV sizing); here it runs on CPU, through the same
    step and sampler code, and generation afterwards still equals Hugging Face's."""
    from common import load_engine, random_prompts

    st, path = load_engine(engine), model_dir("qwen3")
    with st.LLM(
        path,
        device="cpu",
        max_model_len=64,
        max_num_batched_tokens=100,
        max_num_seqs=8,
        kvcache_block_size=4,
    ) as llm:
        runner = llm.engine.model_runner
        scratch_bytes = runner.warmup(llm.model_config)
        assert scratch_bytes > 0
        runner.bind_kv_cache(runner.kv_cache)  # warm-up bound its throwaway cache
        prompt = random_prompts([7], seed=11)[0]
        out = llm.generate(
            [prompt], st.SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False
        )[0]
        assert out["token_ids"] == hf_greedy(path, tuple(prompt), 6)
