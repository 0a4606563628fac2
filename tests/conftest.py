"""Shared fixtures: the engines under test, tiny models, and Hugging Face references."""

import os

import torch

# Triton kernels run in the interpreter on CPU; this must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import functools
import pathlib

import pytest

from common import TINY_MODELS
from tools.tiny_model import make_model

@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """model_dir(name) -> path of a tiny checkpoint, built once per session."""
    root = tmp_path_factory.mktemp("models")

    @functools.cache
    def build(name: str) -> pathlib.Path:
        kwargs = dict(TINY_MODELS[name])
        return make_model(root / name, shape="tiny", **kwargs)

    return build


@pytest.fixture(scope="session")
def hf_greedy():
    """hf_greedy(model_dir, prompt_ids, max_new_tokens) -> Hugging Face's greedy completion
    (stopping at the checkpoint's EOS ids, which transformers reads from generation_config.json)."""
    from transformers import AutoModelForCausalLM

    models = {}

    @functools.cache
    def run(path: pathlib.Path, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
        if path not in models:
            models[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = models[path].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, len(prompt) :].tolist()

    return run
