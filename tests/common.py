"""Helpers shared by the test modules: the engines under test and the tiny models."""

import importlib
import pathlib

import torch

import stages

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENGINES = stages.names() + (["final"] if (ROOT / "nanovllm_final" / "__init__.py").exists() else [])


def load_engine(name: str):
    return importlib.import_module("nanovllm_final") if name == "final" else stages.load(name)


def engine_module(name: str, submodule: str):
    """An engine's own module, e.g. engine_module("03_paged", "engine.block_manager")."""
    return importlib.import_module(f"{load_engine(name).__name__}.{submodule}")


def level(name: str) -> int:
    """Ladder position: 1 for 01_naive ... 7 for 07_tensor_parallel, 8 for the final engine."""
    return 8 if name == "final" else int(name[:2])


# name -> factory arguments; each covers a different corner of the two architectures
TINY_MODELS = {
    "qwen3": dict(arch="qwen3"),  # tied head, GQA, explicit head_dim
    "qwen3-untied-mha": dict(
        arch="qwen3", tie_word_embeddings=False, num_key_value_heads=4, attention_bias=True, seed=1
    ),
    "llama": dict(arch="llama", tie_word_embeddings=False, seed=2),  # untied, GQA
    "llama3-rope": dict(
        arch="llama", rope_scaling="llama3", derive_head_dim=True, config_layout="hf5", seed=3
    ),
}


def stage_view(outs: list[dict]) -> list[dict]:
    """The stage API's part of generate's results; the final engine's dicts add more keys
    (finish_reason, metrics with timings, ...), so compare runs through this view."""
    return [{"text": o["text"], "token_ids": o["token_ids"]} for o in outs]


def random_prompts(lengths: list[int], seed: int, vocab: int = 300) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def generate_and_compare(st, llm, path, prompts, hf_greedy, max_tokens: int = 24) -> None:
    """Greedy completions of `llm` must equal Hugging Face's, prompt by prompt."""
    params = st.SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == len(prompts)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out["token_ids"] == hf_greedy(path, tuple(prompt), max_tokens), (
            f"prompt {i} ({len(prompt)} tokens)"
        )


def total(llm, key: str) -> int:
    """A per-step stat summed over the engine's steps."""
    return sum(step.get(key, 0) for step in llm.stats)


# The mechanism scenarios every model family is run through: each asserts the tokens equal
# Hugging Face's and that the mechanism actually ran (from the stage that has it on).


def check_preemption(engine: str, path, hf_greedy, seed: int) -> None:
    """A KV budget of 12 blocks of 4 tokens cannot hold six growing sequences at once."""
    st = load_engine(engine)
    prompts = random_prompts([10, 12, 8, 14, 9, 11], seed=seed)
    with st.LLM(
        path, device="cpu", max_model_len=48, kvcache_block_size=4, num_kvcache_blocks=12
    ) as llm:
        generate_and_compare(st, llm, path, prompts, hf_greedy, max_tokens=30)
        if level(engine) >= 3:
            assert total(llm, "preemptions") > 0


def check_chunked_prefill(engine: str, path, hf_greedy, seed: int) -> None:
    """A budget of 16 tokens a step splits the 40-token prompts."""
    st = load_engine(engine)
    prompts = random_prompts([40, 3, 37, 21], seed=seed)
    with st.LLM(
        path, device="cpu", max_model_len=128, max_num_batched_tokens=16, kvcache_block_size=4
    ) as llm:
        generate_and_compare(st, llm, path, prompts, hf_greedy)
        if level(engine) >= 5:
            assert total(llm, "chunked_prefills") > 0
            assert max(step["num_tokens"] for step in llm.stats) <= 16


def check_shared_prefix(engine: str, path, hf_greedy, seed: int) -> None:
    """Prompts sharing a 24-token prefix; from 04 on, the prefix's blocks are reused."""
    st = load_engine(engine)
    prefix = random_prompts([24], seed=seed)[0]
    prompts = [prefix + tail for tail in random_prompts([3, 7, 1, 12], seed=seed + 1)]
    with st.LLM(path, device="cpu", max_model_len=128, kvcache_block_size=4, max_num_seqs=2) as llm:
        generate_and_compare(st, llm, path, prompts, hf_greedy)
        if level(engine) >= 4:
            assert total(llm, "prefix_hit_blocks") >= 6
