"""Speculative decoding (nanovllm_final/engine/speculator.py, rejection_sampler.py,
proposers.py): greedy tokens equal to decoding without speculation on every architecture and
under preemption, chunked prefill, prefix hits, abort and n > 1; the rejection sampler's
output distribution equal to the target's (a chi-square test that fails on a planted wrong
rule); no block leaked; the speculative_config checks."""

import json
import math
import os
import random

import numpy as np
import pytest
import torch
from common import random_prompts
from filelock import FileLock

from nanovllm_final import LLM, SamplingParams
from nanovllm_final.config import EngineConfig
from nanovllm_final.engine import rejection_sampler
from nanovllm_final.engine.proposers import ReplayProposer, ngram_lookup
from nanovllm_final.engine.rejection_sampler import verify_rows
from tools.tiny_model import build_if_missing

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
ARCHS = {
    "qwen3": dict(arch="qwen3"),
    "llama": dict(arch="llama", tie_word_embeddings=False, seed=2),
    "qwen3_moe": dict(arch="qwen3_moe"),
    "qwen2": dict(arch="qwen2", tie_word_embeddings=False, seed=4),
}


@pytest.fixture(scope="session")
def spec_model(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "spec_models"
    root.mkdir(parents=True, exist_ok=True)

    def build(name: str, **extra):
        with FileLock(root / f"{name}.lock"):
            return build_if_missing(root / name, shape="tiny", **(ARCHS.get(name) or extra))

    return build


def run(
    path, prompts, params, spec, replay: list | None = None, **options
) -> tuple[list, dict, bool]:
    """Outputs, metrics, and whether every block is free again after the run. `replay`: the
    outputs of a run without speculation, proposed again by a ReplayProposer with 60 % of its
    tokens right (random tiny models repeat themselves too little for n-gram lookup alone)."""
    with LLM(path, device="cpu", speculative_config=spec, **options) as llm:
        if replay is not None:
            runs = [o["prompt_token_ids"] + c["token_ids"] for o in replay for c in o["outputs"]]
            llm.engine.speculator.proposer = ReplayProposer(
                runs, 0.6, llm.engine.model_config.vocab_size
            )
        outs = llm.generate(prompts, params, use_tqdm=False)
        engine = llm.engine
        return outs, llm.metrics(), engine.num_free_blocks == engine.num_blocks


def token_ids(outs) -> list[list[list[int]]]:
    return [[c["token_ids"] for c in o["outputs"]] for o in outs]


def same_greedy(path, prompts, params, **options) -> list[dict]:
    """Speculation changes no token, with n-gram proposals and with replayed ones; the replayed
    ones are partly accepted, partly rejected; no block is left held. Returns the metrics."""
    plain, _, _ = run(path, prompts, params, None, **options)
    found = []
    for replay in (None, plain):
        spec, metrics, all_free = run(path, prompts, params, NGRAM, replay, **options)
        assert token_ids(spec) == token_ids(plain)
        assert [o["finish_reason"] for o in spec] == [o["finish_reason"] for o in plain]
        assert all_free and metrics["spec_decode_num_draft_tokens"] > 0
        found.append(metrics)
    assert (
        0 < found[1]["spec_decode_num_accepted_tokens"] < found[1]["spec_decode_num_draft_tokens"]
    )
    assert found[1]["spec_decode_mean_acceptance_length"] > 1
    return found


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_equal_every_arch(spec_model, arch):
    prompts = random_prompts([9, 14, 6], seed=1)
    same_greedy(
        spec_model(arch),
        prompts,
        SamplingParams(temperature=0.0, max_tokens=40),
        max_model_len=64,
        kvcache_block_size=4,
    )


def test_greedy_preemption_chunking(spec_model):
    """A cache of 13 blocks of 4 tokens for six growing sequences, a budget of 12 tokens a step."""
    prompts = random_prompts([10, 17, 8, 14, 9, 11], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=28)
    options = dict(
        max_model_len=48, kvcache_block_size=4, num_kvcache_blocks=13, max_num_batched_tokens=12
    )
    plain, _, _ = run(spec_model("qwen3"), prompts, params, None, **options)
    with LLM(spec_model("qwen3"), device="cpu", speculative_config=NGRAM, **options) as llm:
        runs = [o["prompt_token_ids"] + o["token_ids"] for o in plain]
        llm.engine.speculator.proposer = ReplayProposer(
            runs, 0.7, llm.engine.model_config.vocab_size
        )
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert (
            sum(s["preemptions"] for s in llm.stats) > 0
            and sum(s["chunked_prefills"] for s in llm.stats) > 0
        )
        assert llm.engine.num_free_blocks == llm.engine.num_blocks
        assert llm.metrics()["spec_decode_num_accepted_tokens"] > 0
    assert token_ids(outs) == token_ids(plain)


def test_greedy_prefix_hits_n_stops_penalties(spec_model):
    """Prompts sharing a prefix (cache hits), n = 2, stop strings and stop ids, min_tokens,
    a repetition penalty (each verify row penalised as if the proposals before it were kept)
    and logprobs of accepted tokens."""
    path = spec_model("llama")
    shared = random_prompts([24], seed=3)[0]
    prompts = [shared + tail for tail in random_prompts([3, 5, 4], seed=4)]
    options = dict(
        max_model_len=96, kvcache_block_size=4, max_num_batched_tokens=16
    )  # later prompts hit cached blocks
    plain, _, _ = run(
        path, prompts, SamplingParams(temperature=0.0, max_tokens=30), None, **options
    )
    stop = plain[0]["token_ids"][12]
    stop_text = plain[1]["text"][8:11]  # a stop string, checked after every emitted token of a run
    assert len(stop_text) == 3
    for params in (
        SamplingParams(temperature=0.0, max_tokens=30, stop=[stop_text]),
        SamplingParams(temperature=0.0, max_tokens=30, n=2, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop], min_tokens=5),
        SamplingParams(
            temperature=0.0, max_tokens=25, repetition_penalty=1.3, frequency_penalty=0.2
        ),
    ):
        plain, _, _ = run(path, prompts, params, None, **options)
        spec, metrics, all_free = run(path, prompts, params, NGRAM, plain, **options)
        assert (
            metrics["prefix_hit_tokens"] > 0
            and metrics["spec_decode_num_accepted_tokens"] > 0
            and all_free
        )
        assert token_ids(spec) == token_ids(plain)
        completions = [[c for o in outs for c in o["outputs"]] for outs in (plain, spec)]
        assert [c["finish_reason"] for c in completions[1]] == [
            c["finish_reason"] for c in completions[0]
        ]
        if params.logprobs:
            for a, b in zip(*completions):
                assert [e["logprob"] for e in b["logprobs"]] == pytest.approx(
                    [e["logprob"] for e in a["logprobs"]], abs=1e-4
                )


def test_abort_frees_blocks(spec_model):
    with LLM(
        spec_model("qwen3"),
        device="cpu",
        speculative_config=NGRAM,
        max_model_len=64,
        kvcache_block_size=4,
        overlap_scheduling=False,  # n-gram looks at every step: this model's rare matches are found
    ) as llm:
        engine = llm.engine
        ids = [
            engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=40))
            for p in random_prompts([9, 12], seed=5)
        ]
        for _ in range(4):
            engine.step()
        engine.abort_request(ids[0])
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.num_free_blocks == engine.num_blocks
        assert llm.metrics()["spec_decode_num_draft_tokens"] > 0


def test_sampling_runs_reproducibly(spec_model):
    """Seeded sampling with masks: the same tokens twice, every block free, proposals tested."""
    path = spec_model("qwen3")
    params = SamplingParams(
        temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=7, max_tokens=30, n=2
    )
    prompts = random_prompts([9, 14], seed=6)
    first, metrics, all_free = run(
        path, prompts, params, NGRAM, max_model_len=64, kvcache_block_size=4
    )
    again, _, _ = run(path, prompts, params, NGRAM, max_model_len=64, kvcache_block_size=4)
    assert all_free and metrics["spec_decode_num_draft_tokens"] > 0
    assert token_ids(first) == token_ids(again)
    # a greedy request verified in the same steps as sampled ones: still the plain greedy tokens
    greedy = SamplingParams(temperature=0.0, max_tokens=30)
    alone, _, _ = run(path, prompts[:1], greedy, None, max_model_len=64, kvcache_block_size=4)
    mixed, _, _ = run(
        path, prompts, [greedy, params], NGRAM, alone, max_model_len=64, kvcache_block_size=4
    )
    assert mixed[0]["token_ids"] == alone[0]["token_ids"]


# ---------------------------------------------------------------- the rejection sampler


def chi_square_rejects(counts: torch.Tensor, p: torch.Tensor) -> bool:
    """Pearson's test of counts against p at alpha = 5e-4 (the critical value by Wilson-Hilferty)."""
    expected = p * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    df, z = len(p) - 1, 3.29
    return stat > df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def emitted(p: torch.Tensor, q: torch.Tensor | None, draws: int, seed: int) -> torch.Tensor:
    """Counts of the first token a verify row emits, over `draws` rows (p, q: (vocab,))."""
    g = torch.Generator().manual_seed(seed)
    vocab = len(p)
    if q is None:  # an n-gram proposal: always the same token, a point mass
        drafts = torch.full((draws,), 2)
    else:
        drafts = torch.multinomial(q, draws, replacement=True, generator=g)
    uniforms = torch.rand(draws, generator=g)
    noise = torch.empty(draws, vocab).exponential_(generator=g)
    qs = None if q is None else q.expand(draws, vocab)
    accepted, drawn = verify_rows(p.expand(draws, vocab).contiguous(), drafts, uniforms, noise, qs)
    tokens = torch.where(accepted, drafts, drawn)
    return torch.bincount(tokens, minlength=vocab).float()


P = torch.tensor([0.30, 0.05, 0.25, 0.02, 0.18, 0.10, 0.06, 0.04])
Q = torch.tensor([0.05, 0.30, 0.10, 0.20, 0.05, 0.05, 0.05, 0.20])


@pytest.mark.parametrize("q", [Q, None], ids=["draft", "point-mass"])
def test_rejection_sampling_keeps_the_target_distribution(q):
    assert not chi_square_rejects(emitted(P, q, 40000, seed=0), P)


@pytest.mark.parametrize("q", [Q, None], ids=["draft", "point-mass"])
def test_chi_square_catches_a_wrong_acceptance_rule(monkeypatch, q):
    """Accepting whenever p(d) >= q(d)... or always: the emitted tokens follow another distribution."""
    monkeypatch.setattr(
        rejection_sampler,
        "acceptance_probability",
        lambda p_d, q_d: (p_d >= q_d).float() + (q is None),
    )
    assert chi_square_rejects(emitted(P, q, 40000, seed=0), P)


def test_chi_square_catches_a_wrong_residual(monkeypatch):
    """Resampling from p instead of (p - q)+ after a rejection."""
    monkeypatch.setattr(rejection_sampler, "residual", lambda p, q: p)
    assert chi_square_rejects(emitted(P, Q, 40000, seed=0), P)


def test_masks_shape_the_target():
    """top_k=3 and temperature 0.5: the accepted-or-resampled tokens follow the masked softmax."""
    from nanovllm_final.engine.sampling import build_sampling_batch
    from nanovllm_final.engine.sequence import Sequence

    logits = torch.log(P).unsqueeze(0).expand(20000, -1).contiguous()
    params = SamplingParams(temperature=0.5, top_k=3, max_tokens=4).resolve({})
    batch = build_sampling_batch([Sequence([1], params) for _ in range(20000)], [])
    target = torch.zeros(8)
    target[[0, 2, 4]] = P[[0, 2, 4]] ** 2
    target /= target.sum()
    drafts = torch.full((20000,), 4)
    accepted, drawn = rejection_sampler.verify(
        torch.Generator().manual_seed(1), logits, batch, drafts
    )
    counts = torch.bincount(torch.where(accepted, drafts, drawn), minlength=8).float()
    assert counts[[1, 3, 5, 6, 7]].sum() == 0
    assert not chi_square_rejects(counts[[0, 2, 4]], target[[0, 2, 4]])


def test_ngram_lookup():
    ids = torch.tensor([5, 1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2]).numpy()
    assert ngram_lookup(ids, 3, 1, 3) == [3, 7, 8]  # "1 2" last occurred before "3 7 8"
    assert ngram_lookup(ids, 1, 3, 3) == []  # "3 1 2" does not recur
    assert ngram_lookup(ids[:2], 2, 1, 2) == []


def reference_ngram_lookup(ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, a suffix length and an earlier start at a time."""
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        starts = [i for i in range(len(ids) - n) if ids[i : i + n] == ids[len(ids) - n :]]
        if starts:
            return ids[starts[-1] + n : starts[-1] + n + k]
    return []


def test_ngram_lookup_matches_its_definition():
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(rng.choice([2, 5, 50])) for _ in range(rng.randint(1, 60))]
        k, low = rng.randint(1, 6), rng.randint(1, 3)
        high = rng.randint(low, 5)
        expected = reference_ngram_lookup(ids, k, low, high)
        assert ngram_lookup(np.asarray(ids, np.int64), k, low, high) == expected, (
            ids,
            k,
            low,
            high,
        )


# ---------------------------------------------------------------- checks


@pytest.mark.parametrize(
    "value, field",
    [
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            "speculative_config.num_speculative_tokens",
        ),
        ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 3,
                "prompt_lookup_max": 2,
            },
            "speculative_config.prompt_lookup_max",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "speculative_config"),
        (
            {"method": "draft_model", "num_speculative_tokens": 2, "model": "/nonexistent"},
            "speculative_config.model",
        ),
        ("{not json", "speculative_config"),
        (
            {"method": "ngram", "num_speculative_tokens": 31},
            "speculative_config.num_speculative_tokens",
        ),
    ],
)
def test_bad_config(value, field):
    with pytest.raises(ValueError) as err:
        EngineConfig.from_options("m", device="cpu", max_model_len=32, speculative_config=value)
    assert err.value.param == field


def test_json_text_and_flag():
    text = json.dumps(NGRAM)
    assert (
        EngineConfig.from_options(
            "m", device="cpu", speculative_config=text
        ).speculative_config.num_speculative_tokens
        == 3
    )
    from nanovllm_final.__main__ import build_parser

    for command in (["generate", "--model", "m", "--prompt", "x"], ["serve", "m"]):
        args = build_parser().parse_args(command + ["--speculative-config", text])
        assert args.engine_speculative_config == text


def test_draft_with_another_vocabulary(spec_model):
    target, draft = spec_model("qwen3"), spec_model("draft-wide", arch="qwen3", vocab_size=640)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    with pytest.raises(ValueError) as err:
        LLM(target, device="cpu", max_model_len=32, speculative_config=spec)
    assert err.value.param == "speculative_config.model" and "vocab" in str(err.value)


# ---------------------------------------------------------------- a draft model


def test_draft_model(spec_model):
    """The target as its own draft: every proposal is accepted, which holds only if the draft's
    paged cache is kept in step (prefix hits, chunks, preemption, rollback); another draft of
    the same vocabulary changes no greedy token either."""
    path = spec_model("qwen3")
    prompts = random_prompts([10, 17, 8, 14, 9, 11], seed=8)
    prompts.append(prompts[1][:16] + [7])  # its first 4 blocks are a prefix hit
    params = SamplingParams(temperature=0.0, max_tokens=28)
    options = dict(
        max_model_len=48, kvcache_block_size=4, num_kvcache_blocks=13, max_num_batched_tokens=12
    )
    plain, _, _ = run(path, prompts, params, None, **options)
    for draft, rate in ((path, 1.0), (spec_model("draft-qwen3", arch="qwen3", seed=9), None)):
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
        with LLM(path, device="cpu", speculative_config=spec, **options) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            metrics = llm.metrics()
            assert sum(s["preemptions"] for s in llm.stats) > 0 and metrics["prefix_hit_tokens"] > 0
            assert llm.engine.num_free_blocks == llm.engine.num_blocks
        assert token_ids(outs) == token_ids(plain)
        assert metrics["spec_decode_num_draft_tokens"] > 0
        if rate is not None:
            assert metrics["spec_decode_acceptance_rate"] == rate


def test_a_draft_catches_up_after_rests(spec_model):
    """Rests (speculator.py) skip the draft's steps: the look after one feeds the draft the tokens
    it missed, so the target as its own draft still has every proposal accepted."""
    path = spec_model("qwen3")
    prompts = random_prompts([10, 17, 8], seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    plain, _, _ = run(path, prompts, params, None, max_model_len=64, kvcache_block_size=4)
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    with LLM(
        path, device="cpu", speculative_config=spec, max_model_len=64, kvcache_block_size=4
    ) as llm:
        speculator, accept = llm.engine.speculator, llm.engine.speculator.accept

        def accept_then_rest(*args):
            shrank = accept(*args)
            speculator.resting = 3  # as after a dry look: three steps without the draft
            return shrank

        speculator.accept = accept_then_rest
        outs = llm.generate(prompts, params, use_tqdm=False)
        metrics = llm.metrics()
        assert llm.engine.num_free_blocks == llm.engine.num_blocks
    assert token_ids(outs) == token_ids(plain)
    assert metrics["spec_decode_num_drafts"] > 3
    assert metrics["spec_decode_acceptance_rate"] == 1.0


def test_tensor_parallel(spec_model):
    """TP=2 (gloo): proposals and verification on rank 0, the verify step on both ranks; a draft
    model runs whole on rank 0 (the target as its own draft: every proposal accepted)."""
    path = spec_model("qwen3")
    prompts = random_prompts([9, 14], seed=10)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    plain, _, _ = run(path, prompts, params, None, max_model_len=48, kvcache_block_size=4)
    draft = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 2}
    for spec_config, replay in ((NGRAM, plain), (draft, None)):
        spec, metrics, all_free = run(
            path,
            prompts,
            params,
            spec_config,
            replay,
            max_model_len=48,
            kvcache_block_size=4,
            tensor_parallel_size=2,
        )
        assert (
            token_ids(spec) == token_ids(plain)
            and all_free
            and metrics["spec_decode_num_accepted_tokens"] > 0
        )
    assert metrics["spec_decode_acceptance_rate"] == 1.0


def test_metrics_exposition(spec_model):
    """llm.metrics() and the server's /metrics text carry the counters (vLLM's names)."""
    from prometheus_client.parser import text_string_to_metric_families

    from nanovllm_final.server.metrics import ServerMetrics, engine_gauges

    with LLM(
        spec_model("qwen3_moe"),
        device="cpu",
        speculative_config=NGRAM,
        max_model_len=64,
        kvcache_block_size=4,
        overlap_scheduling=False,  # n-gram looks at every step: this model's rare matches are found
    ) as llm:
        llm.generate(
            random_prompts([9], seed=11),
            SamplingParams(temperature=0.0, max_tokens=30),
            use_tqdm=False,
        )
        summary, gauges = llm.metrics(), engine_gauges(llm)
    text = ServerMetrics().render(gauges, {"in_flight": 0, "max_pending": 1, "healthy": True})
    samples = {
        s.name + str(s.labels.get("position", "")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert (
        samples["nanovllm_spec_decode_num_draft_tokens_total"]
        == summary["spec_decode_num_draft_tokens"]
        > 0
    )
    assert (
        samples["nanovllm_spec_decode_num_accepted_tokens_total"]
        == summary["spec_decode_num_accepted_tokens"]
        > 0
    )
    assert samples["nanovllm_spec_decode_num_drafts_total"] == summary["spec_decode_num_drafts"]
    assert (
        samples["nanovllm_spec_decode_num_accepted_tokens_per_pos_total0"]
        == summary["spec_decode_num_accepted_tokens_per_pos"][0]
    )
    assert (
        summary["spec_decode_mean_acceptance_length"]
        == 1 + summary["spec_decode_num_accepted_tokens"] / summary["spec_decode_num_drafts"]
    )


def test_warmup_step_verifies(spec_model, monkeypatch):
    """The warm-up step (CUDA's memory measurement) verifies k proposals of every sequence."""
    from nanovllm_final.engine import model_runner

    rows = []

    def spy(sampler, logits, batch):
        rows.append(len(logits))
        return verify_step(sampler, logits, batch)

    verify_step = model_runner.verify_step
    monkeypatch.setattr(model_runner, "verify_step", spy)
    with LLM(
        spec_model("qwen3"),
        device="cpu",
        speculative_config=NGRAM,
        max_model_len=32,
        max_num_seqs=4,
        max_num_batched_tokens=64,
    ) as llm:
        llm.engine.model_runner.warmup(
            llm.engine.model_config
        )  # rebinds the cache to a scratch one: not used again
    assert rows == [4 * (1 + NGRAM["num_speculative_tokens"])]


def test_draft_with_another_tokenizer(spec_model, tmp_path):
    import shutil

    from common import ROOT

    target = spec_model("qwen3")
    draft = tmp_path / "draft"
    shutil.copytree(target, draft)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
    ):  # the same vocab_size, another tokenizer
        shutil.copy(ROOT / "models" / "course-llama" / name, draft / name)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    with pytest.raises(ValueError) as err:
        LLM(target, device="cpu", max_model_len=32, speculative_config=spec)
    assert err.value.param == "speculative_config.model" and "tokenizer" in str(err.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_cuda_graphs_replay_verify_steps(spec_model, method):
    """On CUDA with the Triton backend: verify steps replay their own ladder's graphs (prompt steps
    the token-count ladder's), and the greedy tokens are those of plain decoding."""
    path = spec_model("qwen3")
    prompts = random_prompts([9, 14, 6, 11], seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    options = dict(
        device="cuda", dtype="float32", attention_backend="triton", max_model_len=96, max_num_seqs=8
    )
    with LLM(path, **options) as llm:
        plain = llm.generate(prompts, params, use_tqdm=False)
    spec = (
        NGRAM
        if method == "ngram"
        else {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    )
    with LLM(path, speculative_config=spec, **options) as llm:
        if method == "ngram":
            runs = [o["prompt_token_ids"] + o["token_ids"] for o in plain]
            llm.engine.speculator.proposer = ReplayProposer(
                runs, 0.7, llm.engine.model_config.vocab_size
            )
        graphs = llm.engine.model_runner.cuda_graphs
        replays = dict(graphs.num_replays)
        outs = llm.generate(prompts, params, use_tqdm=False)
        not_decode = sum(
            s["is_prefill"] for s in llm.stats
        )  # prompt steps and verify steps (1 + k tokens each)
        new = {kind: graphs.num_replays[kind] - replays[kind] for kind in replays}
        assert new["verify"] + new["prompt"] == not_decode  # all replayed
        assert new["verify"] > len(prompts)
        assert llm.metrics()["spec_decode_num_drafts"] > len(prompts) and not_decode > len(prompts)
        assert llm.engine.num_free_blocks == llm.engine.num_blocks
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in plain]


def test_structured_outputs_are_refused_while_speculating(model_dir):
    """Verify rows draw without a grammar's bitmask: a request with a format is refused, naming the field."""
    with LLM(
        model_dir("qwen3"),
        device="cpu",
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
    ) as llm:
        params = SamplingParams(
            max_tokens=4, temperature=0, structured_outputs={"choice": ["yes", "no"]}
        )
        with pytest.raises(ValueError, match="structured_outputs"):
            llm.generate([[1, 2, 3]], params, use_tqdm=False)


def test_spec_decode_benchmark_runs(spec_model, tmp_path, monkeypatch):
    """benchmarks/spec_decode.py on a tiny model and its own draft, the repeat workload: each row
    timed in turns with plain decoding, the same greedy tokens, a record with its command."""
    from benchmarks import spec_decode

    path, out = str(spec_model("qwen3")), tmp_path / "spec.json"
    argv = [
        "spec_decode",
        "--model",
        path,
        "--draft",
        path,
        "--device",
        "cpu",
        "--workload",
        "repeat",
        "--batches",
        "2",
        "--ks",
        "2",
        "--accept",
        "1.0",
        "--repeat",
        "2",
        "--max-tokens",
        "6",
        "--out",
        str(out),
    ]
    monkeypatch.setattr("sys.argv", argv)
    spec_decode.main()
    record = json.loads(out.read_text())
    record = record[0] if isinstance(record, list) else record
    assert record["workload"] == "repeat" and "--workload repeat" in record["command"]
    assert {r["method"] for r in record["rows"]} == {"ngram", "none", "replay", "draft_model"}
    assert all(r["same_tokens"] and r["plain_tok_s"] > 0 for r in record["rows"])
    assert next(r for r in record["rows"] if r["method"] == "draft_model")["acceptance_rate"] == 1.0
