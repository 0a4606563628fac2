"""The final engine's sampling: masks against a reference built from Hugging Face logits,
seeded requests independent of the batch and of preemption, penalties, logprobs,
min_tokens, generation_config.json defaults, and every bad SamplingParams value."""

import json
import shutil

import pytest
import torch
from common import random_prompts

from nanovllm_final import LLM, SamplingParams
from nanovllm_final.kernels import sampling
from nanovllm_final.layers.sampler import (
    Sampler,
    _group_size,
    apply_penalties,
    mask_probs,
    seeded_exponential,
    top_candidates,
)


@pytest.fixture(scope="module")
def hf_logits(model_dir):
    """Next-token logits (vocab,) of the tiny Qwen3 model after a prompt, from Hugging Face."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir("qwen3"), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([random_prompts([12], seed=3)[0]])).logits[0, -1]


def reference_keep(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The tokens the masks keep, computed one token at a time (the definitions, spelled out)."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i].item())
    kept_k = order[:top_k] if top_k > 0 else order
    mass = sum(probs[i].item() for i in kept_k)
    keep, before = set(), 0.0
    for i in kept_k:
        if top_p >= 1 or before < top_p * mass:
            keep.add(i)
        before += probs[i].item()
    best = probs.max().item()
    return torch.tensor([i in keep and probs[i].item() >= min_p * best for i in range(len(probs))])


@pytest.mark.parametrize(
    "top_k, top_p, min_p, temperature",
    [(5, 1.0, 0.0, 1.0), (0, 0.8, 0.0, 1.0), (0, 1.0, 0.1, 0.7), (20, 0.9, 0.02, 1.3)],
)
def test_masks_match_reference(hf_logits, top_k, top_p, min_p, temperature):
    """30,000 draws in one batch: every sampled token is in the reference set, and the
    frequencies match the renormalised probabilities (within 0.015; std error < 0.003)."""
    rows = 30_000
    probs = torch.softmax(hf_logits / temperature, dim=-1)
    keep = reference_keep(probs, top_k, top_p, min_p)
    assert 1 < keep.sum() < len(probs)  # the case really masks, and leaves a choice
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    full = lambda v, dtype: torch.full((rows,), v, dtype=dtype)
    masks = dict(
        top_k=full(top_k, torch.int64),
        top_p=full(top_p, torch.float32),
        min_p=full(min_p, torch.float32),
    )
    expected = torch.where(keep, probs, 0) / probs[keep].sum()
    # the whole vocabulary; with a top_k, also the candidates-only path the engine takes then
    for max_k in [None] + ([top_k] if top_k else []):
        draws = sampler(
            hf_logits.expand(rows, -1), full(temperature, torch.float32), **masks, max_k=max_k
        )
        assert keep[draws].all()
        freq = torch.bincount(draws, minlength=len(probs)).float() / rows
        assert (freq - expected).abs().max() < 0.015


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_temperature_only_draws_follow_the_softmax(hf_logits, temperature):
    """No masks: the sampler takes argmax(logits / T - log E) without a softmax; the draws'
    frequencies must still be softmax(logits / T)."""
    rows = 30_000
    probs = torch.softmax(hf_logits / temperature, dim=-1)
    draws = Sampler(seed=0, device=torch.device("cpu"))(
        hf_logits.expand(rows, -1), torch.full((rows,), temperature)
    )
    freq = torch.bincount(draws, minlength=len(probs)).float() / rows
    assert (freq - probs).abs().max() < 0.015


def test_top_k_1_and_tiny_top_p_are_greedy(hf_logits):
    rows = 2000
    logits = hf_logits.expand(rows, -1) + torch.randn(
        rows, len(hf_logits), generator=torch.Generator().manual_seed(0)
    )
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    ones = torch.ones(rows)
    greedy = logits.argmax(-1)
    assert torch.equal(sampler(logits, ones, top_k=torch.ones(rows, dtype=torch.int64)), greedy)
    assert torch.equal(sampler(logits, ones, top_p=torch.full((rows,), 1e-6)), greedy)
    assert torch.equal(sampler(logits, ones * 0), greedy)


def test_seeded_noise_is_a_function_of_seed_position_token():
    seeds, positions = torch.tensor([7, 7, 8, 2**40 + 7]), torch.tensor([0, 1, 0, 0])
    noise = seeded_exponential(seeds, positions, torch.arange(100))
    assert torch.equal(
        noise[1:2], seeded_exponential(seeds[1:2], positions[1:2], torch.arange(100))
    )  # alone = in a batch
    assert torch.equal(
        noise[:, [5, 17]], seeded_exponential(seeds, positions, torch.tensor([[5, 17]] * 4))
    )  # per-row candidates
    assert (
        not torch.equal(noise[0], noise[1])
        and not torch.equal(noise[0], noise[2])
        and not torch.equal(noise[0], noise[3])
    )
    # Exp(1) over many seeds: mean 1, and Gumbel-max with it draws from the softmax
    many = seeded_exponential(
        torch.arange(40_000), torch.zeros(40_000, dtype=torch.int64), torch.arange(8)
    )
    assert abs(many.mean().item() - 1) < 0.01 and many.min() > 0
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    freq = torch.bincount((torch.softmax(logits, -1) / many).argmax(-1), minlength=8).float() / len(
        many
    )
    assert (freq - torch.softmax(logits, -1)).abs().max() < 0.01


def test_seeded_noise_is_never_zero():
    # this (seed, position) hashes token 1692 to the largest 24-bit value, whose u rounds to 1.0 in float32
    from nanovllm_final.engine.sampling import completion_seed

    noise = seeded_exponential(
        torch.tensor([completion_seed(0, 670)]), torch.tensor([0]), torch.arange(2048)
    )
    assert (
        noise.min() > 0
    )  # E = 0 makes p / E NaN (or inf) for that token, and argmax draws it even where p = 0
    probs = torch.zeros(1, 2048)
    probs[0, :4] = 0.25
    assert int((probs / noise).argmax()) < 4  # a masked token is never drawn


def test_penalties_follow_vllm():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    counts = torch.tensor([[2.0, 0.0, 1.0, 0.0]])  # generated: token 0 twice, token 2 once
    prompt = torch.tensor([[False, True, False, False]])
    out = apply_penalties(
        logits, counts, prompt, torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25])
    )
    expected = torch.tensor([[2.0 / 2 - 0.25 * 2 - 0.5, -1.0 * 2, 0.5 / 2 - 0.25 - 0.5, 3.0]])
    torch.testing.assert_close(out, expected)


# ---------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def llm(model_dir):
    """A small pool (16 blocks of 4 tokens, one max_model_len sequence) so that batches preempt."""
    with LLM(
        model_dir("qwen3"),
        device="cpu",
        max_model_len=64,
        kvcache_block_size=4,
        num_kvcache_blocks=16,
    ) as llm:
        yield llm


def test_seeded_requests_ignore_batch_order_and_preemption(llm):
    prompts = random_prompts([9, 12, 7, 10], seed=5)
    seeded = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=14, ignore_eos=True)
        for i in range(4)
    ]
    alone = [
        llm.generate([p], s, use_tqdm=False)[0]["token_ids"]
        for p, s in zip(prompts[:2], seeded[:2])
    ]
    llm.stats.clear()
    unseeded = SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True)
    mixed = llm.generate(prompts[::-1] + prompts[:1], seeded[::-1] + [unseeded], use_tqdm=False)
    assert sum(s["preemptions"] for s in llm.stats) > 0  # the pool is too small for the batch
    assert [
        mixed[3]["token_ids"],
        mixed[2]["token_ids"],
    ] == alone  # prompts 0 and 1, with seeds 100 and 101


def test_seeded_n_completions_survive_preemption(llm):
    prompt, other = random_prompts([12, 10], seed=11)
    params = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=14, ignore_eos=True)
    alone = [c["token_ids"] for c in llm.generate([prompt], params, use_tqdm=False)[0]["outputs"]]
    llm.stats.clear()
    busy = llm.generate(
        [other, prompt], [SamplingParams(max_tokens=20, ignore_eos=True), params], use_tqdm=False
    )[1]
    assert sum(s["preemptions"] for s in llm.stats) > 0
    assert [c["token_ids"] for c in busy["outputs"]] == alone and len(
        {tuple(a) for a in alone}
    ) == 3


def test_penalties_in_the_engine(llm):
    """Greedy with strong penalties: no token of the prompt (repetition) or of the output
    (presence) comes back, while plain greedy repeats itself."""
    prompt = random_prompts([10], seed=12)[0]
    plain = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )[0]["token_ids"]
    assert len(set(plain)) < len(plain) or set(plain) & set(prompt)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=16,
        ignore_eos=True,
        repetition_penalty=1e6,
        presence_penalty=2.0,
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"]
    assert len(set(out)) == len(out) and not set(out) & set(prompt)


def test_top_k_1_generates_greedily(llm):
    prompts = random_prompts([5, 9], seed=6)
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    top1 = llm.generate(
        prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=10), use_tqdm=False
    )
    assert [o["token_ids"] for o in top1] == [o["token_ids"] for o in greedy]


def test_logprobs_equal_hf_log_softmax(llm, model_dir):
    from transformers import AutoModelForCausalLM

    prompt = random_prompts([8], seed=7)[0]
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0.8, seed=1, max_tokens=5, logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )[0]
    model = AutoModelForCausalLM.from_pretrained(model_dir("qwen3"), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out["token_ids"]])).logits[
            0, len(prompt) - 1 : -1
        ]  # (5, vocab)
    ref = torch.log_softmax(logits, dim=-1)
    assert [e["token_id"] for e in out["logprobs"]] == out["token_ids"]
    for i, entry in enumerate(out["logprobs"]):
        assert entry["logprob"] == pytest.approx(ref[i, entry["token_id"]].item(), abs=1e-4)
        top = ref[i].topk(3)
        assert list(entry["top_logprobs"]) == top.indices.tolist()
        assert list(entry["top_logprobs"].values()) == pytest.approx(top.values.tolist(), abs=1e-4)


def test_stop_token_ids_and_min_tokens(llm):
    prompt = random_prompts([6], seed=8)[0]
    greedy = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0]["token_ids"]
    stop_id = greedy[3]
    first = greedy.index(stop_id)
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0]
    assert out["token_ids"] == greedy[: first + 1] and out["finish_reason"] == "stop"
    late = llm.generate(
        [prompt],
        SamplingParams(
            temperature=0.0,
            max_tokens=12,
            ignore_eos=True,
            stop_token_ids=[stop_id],
            min_tokens=first + 2,
        ),
        use_tqdm=False,
    )[0]
    assert stop_id not in late["token_ids"][: first + 2] and len(late["token_ids"]) >= first + 2


def test_every_eos_id_counts(llm):
    eos = set(llm.model_config.eos_token_ids)
    assert len(eos) == 2  # <|im_end|> (config.json) and <|endoftext|> (generation_config.json)
    # seeded: the outcome must not depend on which tests drew from the engine's generator before
    params = [SamplingParams(temperature=1.0, max_tokens=30, seed=i) for i in range(10)]
    outs = llm.generate(random_prompts([3] * 10, seed=9), params, use_tqdm=False)
    for out in outs:
        ids = out["token_ids"]
        ended = [i for i, t in enumerate(ids) if t in eos]
        assert (out["finish_reason"] == "stop" and ended == [len(ids) - 1]) or (
            out["finish_reason"] == "length" and not ended
        )
    assert {o["finish_reason"] for o in outs} == {"stop", "length"}


def test_generation_config_defaults(model_dir, tmp_path):
    """A checkpoint whose generation_config.json says top_k 1 generates greedily by default."""
    path = tmp_path / "m"
    shutil.copytree(model_dir("qwen3"), path)
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(
        json.dumps(gen | {"temperature": 1.3, "top_k": 1, "top_p": 0.95})
    )
    prompts = random_prompts([6, 10], seed=10)
    with LLM(path, device="cpu", max_model_len=64) as llm:
        assert llm.model_config.generation_defaults == {
            "temperature": 1.3,
            "top_k": 1,
            "top_p": 0.95,
        }
        default = llm.generate(prompts, SamplingParams(max_tokens=10), use_tqdm=False)
        greedy = llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False
        )
        sampled = llm.generate(
            prompts * 3, SamplingParams(top_k=0, max_tokens=10), use_tqdm=False
        )  # top_k given: all tokens
    assert [o["token_ids"] for o in default] == [o["token_ids"] for o in greedy]
    assert [o["token_ids"] for o in sampled] != [o["token_ids"] for o in greedy] * 3


def test_resolve_takes_defaults_then_neutral_values():
    p = SamplingParams(top_p=0.5).resolve({"temperature": 0.6, "top_p": 0.95, "top_k": 20})
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (
        0.6,
        0.5,
        20,
        0.0,
        1.0,
    )
    p = SamplingParams(top_k=-1).resolve({})
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, 0)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.1), "min_p"),
        (dict(n=0), "n"),
        (dict(logprobs=-1), "logprobs"),
        (dict(min_tokens=10, max_tokens=5), "min_tokens"),
        (dict(stop=3), "stop"),
        (dict(stop=["a", 1]), "stop"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(temperature=-1), "temperature"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(seed=1.5), "seed"),
        (dict(ignore_eos="yes"), "ignore_eos"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_candidates_path_draws_what_the_full_vocabulary_draws():
    """When every row has a top_k, the sampler looks only at the max(top_k) largest logits
    (torch.topk). A seeded row's noise is a function of the token id, so it must draw the
    very token the full-vocabulary path draws, under every mask."""
    g = torch.Generator().manual_seed(0)
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    draws = set()
    for trial in range(40):
        rows, vocab = 8, 500
        logits = torch.randn(rows, vocab, generator=g) * (1 + trial % 4)  # (rows, vocab)
        top_k = torch.randint(1, 60, (rows,), generator=g)
        top_p = torch.rand(rows, generator=g).clamp(min=0.05) if trial % 2 else None
        min_p = torch.rand(rows, generator=g) * 0.2 if trial % 3 == 0 else None
        temperatures = torch.rand(rows, generator=g) + 0.3
        seeds, positions = (
            torch.randint(0, 2**40, (rows,), generator=g),
            torch.randint(0, 999, (rows,), generator=g),
        )
        masks = dict(top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds, positions=positions)
        full = sampler(logits, temperatures, **masks)
        partial = sampler(logits, temperatures, **masks, max_k=int(top_k.max()))
        assert torch.equal(full, partial), f"trial {trial}"
        kept = mask_probs(torch.softmax(logits / temperatures[:, None], -1), top_k, top_p, min_p)
        assert (kept.gather(1, partial[:, None]) > 0).all()  # drawn among the tokens the masks keep
        draws.update(partial.tolist())
    assert len(draws) > 100  # not always the argmax


@pytest.mark.parametrize("path", ["pytorch", "kernels"])
@pytest.mark.parametrize("vocab", [151936, 128256, 4096, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_candidates_are_the_top_k(vocab, dtype, path):
    """top_candidates equals torch.topk: the same values, largest first, at ids that hold them,
    no id twice; also with many ties (bf16 steps of 1/4), rows of -inf but a few, and a row
    whose largest logits share one group (the grouped pass: Qwen3's and Llama's vocabularies).
    Paths: the PyTorch code on the CPU; its two Triton kernels (kernels/sampling.py's top_candidates, what
    the function calls on CUDA) on CUDA, or in the interpreter without it."""
    if path == "kernels" and _group_size(vocab, 1) is None:
        pytest.skip("no grouped pass at this vocabulary: a plain topk")
    g = torch.Generator().manual_seed(vocab)
    rows = 6
    logits = torch.randn(rows, vocab, generator=g) * 4
    logits[1] = (logits[1] * 4).round() / 4  # coarse values: ties at the k-th
    logits[2, 3:] = float("-inf")  # fewer finite logits than k
    logits[3, 256:320] += 100  # the 64 largest in one or two groups
    logits = logits.to(dtype).to(
        "cuda" if path == "kernels" and torch.cuda.is_available() else "cpu"
    )
    for k in (1, 20, 50):
        group = _group_size(vocab, k)
        if path == "kernels" and group is None:
            continue  # a plain topk: no kernel
        values, ids = (
            sampling.top_candidates(logits, k, group)
            if path == "kernels"
            else top_candidates(logits, k)
        )
        assert values.shape == ids.shape == (rows, k)
        assert torch.equal(values, logits.topk(k, dim=-1).values)
        assert torch.equal(logits.gather(1, ids), values)
        assert all(len(set(row)) == k for row in ids.tolist())


def test_candidates_path_at_a_large_vocabulary_draws_what_the_full_vocabulary_draws():
    """At Qwen3's vocabulary size the candidates come from top_candidates' grouped pass;
    seeded rows draw exactly the tokens the whole-vocabulary masks draw."""
    g = torch.Generator().manual_seed(7)
    rows, vocab = 16, 151936
    logits = torch.randn(rows, vocab, generator=g) * 3
    top_k = torch.randint(1, 40, (rows,), generator=g)
    masks = dict(
        top_k=top_k,
        top_p=torch.rand(rows, generator=g).clamp(min=0.3),
        seeds=torch.randint(0, 2**40, (rows,), generator=g),
        positions=torch.randint(0, 999, (rows,), generator=g),
    )
    temperatures = torch.rand(rows, generator=g) + 0.5
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    assert torch.equal(
        sampler(logits, temperatures, **masks),
        sampler(logits, temperatures, **masks, max_k=int(top_k.max())),
    )


def test_half_precision_logits_draw_what_their_float32_copy_draws():
    """The sampler divides bf16 logits by the float32 temperatures without a float32 copy
    first: every path (temperature only, full-vocabulary masks, candidates) draws for seeded
    rows the tokens it draws from the float32 copy; without a greedy row, `greedy_rows=False`
    (the argmax skipped) draws the same too."""
    g = torch.Generator().manual_seed(1)
    rows, vocab = 256, 400
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(torch.bfloat16)
    temperatures = torch.rand(rows, generator=g) + 0.3
    seeds, positions = (
        torch.randint(0, 2**40, (rows,), generator=g),
        torch.randint(0, 999, (rows,), generator=g),
    )
    top_k = torch.randint(1, 50, (rows,), generator=g)
    cases = [{}, dict(top_p=torch.full((rows,), 0.9)), dict(top_k=top_k, max_k=int(top_k.max()))]
    for masks in cases:
        sampler = Sampler(seed=0, device=torch.device("cpu"))
        draws = [
            sampler(x, temperatures, seeds=seeds, positions=positions, **masks)
            for x in (logits, logits.float())
        ]
        assert torch.equal(draws[0], draws[1]), masks
        assert torch.equal(
            sampler(
                logits, temperatures, seeds=seeds, positions=positions, greedy_rows=False, **masks
            ),
            draws[0],
        )
        assert not torch.equal(draws[0], logits.argmax(-1))  # sampled, not greedy
    temperatures[0] = 0  # a greedy row: its argmax needs greedy_rows
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    assert sampler(logits, temperatures, seeds=seeds, positions=positions)[0] == logits[0].argmax()


def test_sampling_columns_kept_from_step_to_step_equal_fresh_ones():
    """The engine's SamplingColumns recomputes the rows' parameter columns only when the rows
    change; every step's batch equals one built afresh: the positions and min_tokens masks of
    that step, the columns of its rows (seeds, penalties, logprobs too)."""
    import numpy as np

    from nanovllm_final.engine.sampling import SamplingColumns, build_sampling_batch
    from nanovllm_final.engine.sequence import Sequence

    kinds = [
        SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=20),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9], max_tokens=20),
        SamplingParams(
            temperature=1.0, top_p=0.8, repetition_penalty=1.2, logprobs=2, max_tokens=20
        ),
    ]
    seqs = [Sequence([1, 2, 3], p.resolve({})) for p in kinds]
    columns = SamplingColumns()
    for step in range(6):
        if step == 3:  # a row ends: the columns follow the new rows
            seqs = seqs[1:] + [Sequence([4, 5], kinds[0].resolve({}))]
        got, fresh = build_sampling_batch(seqs, [0], columns), build_sampling_batch(seqs, [0])
        for field in fresh.__dataclass_fields__:
            a, b = getattr(got, field), getattr(fresh, field)
            if isinstance(b, dict):
                assert a.keys() == b.keys()
                assert all(
                    a[k] == b[k] if isinstance(b[k], list) else np.array_equal(a[k], b[k])
                    for k in b
                )
            elif isinstance(b, tuple):
                assert all(np.array_equal(x, y) for x, y in zip(a, b))
            else:
                assert np.array_equal(a, b) if b is not None else a is None, field
        assert (got.suppress is not None) == (step < 3)  # the min_tokens row, until it leaves
        for seq in seqs:
            seq.append_token(7)
