"""Loading real checkpoints with the final engine: hub ids from the local Hugging Face cache
(offline), sharded safetensors, bfloat16 weights, Qwen2, and a tokenizer smaller than the
model's vocabulary."""

import json
import logging
import shutil

import pytest
from common import random_prompts
from safetensors.torch import load_file, save_file

from nanovllm_final import LLM, SamplingParams
from tools.tiny_model import make_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


def greedy_ids(path, prompts, **options) -> list[list[int]]:
    with LLM(path, device="cpu", max_model_len=64, **options) as llm:
        return [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def fake_hub_cache(home, repo_id: str, src) -> None:
    """Lay out <HF_HOME>/hub as huggingface_hub does: refs/main names a snapshot folder."""
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(src, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_hub_id_from_the_local_cache(model_dir, tmp_path, monkeypatch, hf_greedy):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fake_hub_cache(tmp_path / "hf", "tiny-org/tiny-qwen3", model_dir("qwen3"))
    prompt = random_prompts([6], seed=1)[0]
    with LLM("tiny-org/tiny-qwen3", device="cpu", max_model_len=64) as llm:
        assert llm.model_name == "tiny-org/tiny-qwen3"
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out["token_ids"] == hf_greedy(model_dir("qwen3"), tuple(prompt), 10)
    with pytest.raises(FileNotFoundError, match="huggingface-cli download tiny-org/not-cached"):
        LLM("tiny-org/not-cached", device="cpu")


def test_sharded_checkpoint(model_dir, tmp_path, hf_greedy):
    src, path = model_dir("llama"), tmp_path / "sharded"
    shutil.copytree(src, path)
    weights = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, path / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    prompts = random_prompts([9], seed=2)
    assert greedy_ids(path, prompts) == [hf_greedy(src, tuple(p), 10) for p in prompts]
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        LLM(path, device="cpu")


@pytest.mark.parametrize(
    "arch, options", [("qwen2", dict(tie_word_embeddings=False)), ("llama", dict(dtype="bfloat16"))]
)
def test_more_checkpoints_match_hf(arch, options, tmp_path, hf_greedy):
    """Qwen2 (q/k/v bias, no q/k norm) and a bfloat16 checkpoint run in float32."""
    path = make_model(tmp_path / arch, arch=arch, seed=4, **options)
    prompts = random_prompts([4, 13], seed=3)
    assert greedy_ids(path, prompts) == [hf_greedy(path, tuple(p), 10) for p in prompts]


def test_sliding_window_is_refused(model_dir, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(model_dir("qwen3"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(
        json.dumps(config | {"use_sliding_window": True, "sliding_window": 16})
    )
    with pytest.raises(ValueError, match="sliding"):
        LLM(path, device="cpu")


def test_vocab_past_the_tokenizer_warns_once(tmp_path, caplog, monkeypatch):
    from nanovllm_final.log import log_once

    log_once.cache_clear()  # as in a fresh process
    path = make_model(
        tmp_path / "wide", arch="qwen3", vocab_size=4096
    )  # the tokenizer has 500 tokens
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger="nanovllm_final"):
        for _ in range(2):  # a second engine in the same process does not warn again
            with LLM(path, device="cpu", max_model_len=64) as llm:
                outs = llm.generate(random_prompts([4] * 2, seed=5), params, use_tqdm=False)
            assert (
                sum(t >= 500 for o in outs for t in o["token_ids"]) > 1
            )  # most ids are past the tokenizer
    warnings = [r for r in caplog.records if "tokenizer has only 500 tokens" in r.getMessage()]
    assert len(warnings) == 1
