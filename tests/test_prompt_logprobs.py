"""SamplingParams.prompt_logprobs on the final engine: every position's logprob and top k equal
Hugging Face's log_softmax (float32, CPU) for Qwen3, Llama and Qwen3-MoE, under chunked prefill,
with overlap scheduling, after a prefix-cache hit on the same prompt (the cache is not read for a
prompt being scored), under preemption; and a prompt of max_model_len - 1 tokens scored without
the memory of its prompt x vocabulary logits (torch's CPU allocations measured by the profiler)."""

import functools

import pytest
import torch
from common import random_prompts

from nanovllm_final import LLM, SamplingParams
from nanovllm_final.engine import prompt_logprobs as scoring
from nanovllm_final.validate import Problem
from tools.tiny_model import build_if_missing

TOL = 1e-4
K = 3


@pytest.fixture(scope="module")
def checkpoint(model_dir, tmp_path_factory):
    """checkpoint(name) -> a tiny model: a TINY_MODELS key, or "moe" (Qwen3-MoE)."""
    moe_root = tmp_path_factory.mktemp("scoring_moe")

    def get(name: str):
        return (
            build_if_missing(moe_root / name, shape="tiny", arch="qwen3_moe")
            if name == "moe"
            else model_dir(name)
        )

    return get


@functools.cache
def hf_logprobs(path, prompt: tuple[int, ...]) -> torch.Tensor:
    """(tokens, vocab) Hugging Face's log_softmax at every prompt position, float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def assert_matches_hf(path, prompt: list[int], entries: list, k: int = K) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    ref = hf_logprobs(path, tuple(prompt))
    for p, entry in enumerate(entries[1:]):
        assert entry["token_id"] == prompt[p + 1]
        assert abs(entry["logprob"] - ref[p, prompt[p + 1]].item()) < TOL, f"position {p}"
        top = ref[p].topk(k)
        values = list(entry["top_logprobs"].values())
        assert (
            len(values) == k and max(abs(a - b) for a, b in zip(values, top.values.tolist())) < TOL
        ), f"position {p}"
        for token_id, value in entry["top_logprobs"].items():
            assert abs(value - ref[p, token_id].item()) < TOL


@pytest.mark.parametrize("name", ["qwen3", "llama", "moe"])
def test_prompt_logprobs_equal_hf(checkpoint, name):
    """A budget of 16 tokens splits the prompts (a chunk's last position predicts the next chunk's
    first token); the same prompt is scored after a plain run cached its blocks, and again."""
    path = checkpoint(name)
    long, short, one = random_prompts([41, 9, 1], seed=11)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K)
    with LLM(
        path, device="cpu", max_model_len=96, max_num_batched_tokens=16, kvcache_block_size=4
    ) as llm:
        plain = llm.generate([long], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
        assert plain["prompt_logprobs"] is None
        first = llm.generate([long, short, one], params, use_tqdm=False)
        for prompt, out in zip([long, short, one], first):
            assert_matches_hf(path, prompt, out["prompt_logprobs"])
        assert first[0]["metrics"]["cached_prompt_tokens"] == 0  # the cached blocks were not read
        assert first[0]["token_ids"] == plain["token_ids"]
        again = llm.generate([long], params, use_tqdm=False)[0]
        for a, b in zip(
            again["prompt_logprobs"][1:], first[0]["prompt_logprobs"][1:]
        ):  # alone now: MoE rounds apart
            assert a["token_id"] == b["token_id"] and abs(a["logprob"] - b["logprob"]) < TOL
        assert_matches_hf(path, long, again["prompt_logprobs"])
        hit = llm.generate([long], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
        assert (
            hit["metrics"]["cached_prompt_tokens"] > 0
        )  # a scored prompt's blocks are shared afterwards


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_preemption_and_n(checkpoint, overlap):
    """Six prompts in 12 blocks of 4 tokens preempt each other; a preempted prompt is recomputed,
    not scored twice; n=2 completions share one prompt_logprobs."""
    path = checkpoint("qwen3")
    prompts = random_prompts([10, 12, 8, 14, 9, 11], seed=12)
    params = SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=1, n=2)
    with LLM(
        path,
        device="cpu",
        max_model_len=48,
        kvcache_block_size=4,
        num_kvcache_blocks=14,
        overlap_scheduling=overlap,
    ) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.metrics()["preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        assert_matches_hf(path, prompt, out["prompt_logprobs"], k=1)


def test_tensor_parallel(checkpoint):
    """TP=2 (gloo): every rank computes its vocabulary slice of each chunk's logits, rank 0 scores."""
    path = checkpoint("qwen3")
    prompts = random_prompts([30, 7], seed=14)
    with LLM(
        path,
        device="cpu",
        max_model_len=64,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        tensor_parallel_size=2,
    ) as llm:
        outs = llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K), use_tqdm=False
        )
    for prompt, out in zip(prompts, outs):
        assert_matches_hf(path, prompt, out["prompt_logprobs"])


def test_bad_prompt_logprobs(checkpoint):
    with pytest.raises(Problem, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with LLM(checkpoint("qwen3"), device="cpu", max_model_len=32) as llm:
        with pytest.raises(Problem, match="prompt_logprobs"):
            llm.generate([[5, 6]], SamplingParams(prompt_logprobs=10**6), use_tqdm=False)


def peak_bytes(fn) -> tuple[int, object]:
    """Run fn(); the peak of torch's CPU allocations made during it, in bytes (the profiler's
    memory events, in order), and fn's result."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        result = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    now = peak = 0
    for e in events:  # an allocation (bytes > 0) or a free (< 0)
        now += e.nbytes()
        peak = max(peak, now)
    return peak, result


def test_long_prompt_scored_in_chunks(checkpoint, monkeypatch):
    """Scoring a prompt of max_model_len - 1 tokens in one step allocates a small part of its
    prompt x vocabulary logits; the same measurement of computing them at once sees them all."""
    path = checkpoint("qwen3")
    max_len, seqs = 512, 8
    prompt = random_prompts([max_len - 1], seed=13)[0]
    peaks = []

    def measured(model, hidden, plan, chunk_rows):
        peak, result = peak_bytes(lambda: original(model, hidden, plan, chunk_rows))
        peaks.append(peak)
        return result

    original = scoring.score_rows
    monkeypatch.setattr("nanovllm_final.engine.model_runner.score_rows", measured)
    with LLM(
        path, device="cpu", max_model_len=max_len, max_num_batched_tokens=max_len, max_num_seqs=seqs
    ) as llm:
        out = llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False
        )[0]
        model = llm.engine.model_runner.model
        vocab = model.lm_head.weight.shape[0]
        full = (max_len - 1) * vocab * 4  # float32 logits of every scored position
        hidden = torch.zeros(max_len - 1, model.lm_head.weight.shape[1])
        all_at_once, _ = peak_bytes(lambda: torch.log_softmax(model.compute_logits(hidden), -1))
    assert len(peaks) == 1 and len(out["prompt_logprobs"]) == max_len - 1
    assert all_at_once >= full  # the measurement sees a full tensor when there is one
    assert peaks[0] < full / 8, (
        f"scoring allocated {peaks[0]} bytes at its peak; the full logits are {full}"
    )
    print(
        f"scoring {max_len - 1} positions, vocab {vocab}: peak {peaks[0]} bytes; full logits {full} bytes"
    )
