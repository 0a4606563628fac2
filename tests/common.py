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
    "qwen3-untied-mha": dict(arch="qwen3", tie_word_embeddings=False, num_key_value_heads=4, attention_bias=True, seed=1),
    "llama": dict(arch="llama", tie_word_embeddings=False, seed=2),  # untied, GQA
    "llama3-rope": dict(arch="llama", rope_scaling="llama3", derive_head_dim=True, config_layout="hf5", seed=3),
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
        assert out["token_ids"] == hf_greedy(path, tuple(prompt), max_tokens), f"prompt {i} ({len(prompt)} tokens)"
