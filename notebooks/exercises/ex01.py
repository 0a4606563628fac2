"""Checks for 01_naive.ipynb: the naive generation loop, Gumbel-max sampling from uniform noise, and a
mixture of experts' routing (the top-k experts of each token, and the load per expert)."""

import torch

from . import stage
from .report import expect_close, expect_equal, fail

STAGE = "01_naive"
LOGITS = (0.5, 1.0, 2.0, 0.0, -0.5, -1.0, 1.5, 0.2)  # 8 tokens; the most likely is token 2


def check_naive_generate(naive_generate) -> str:
    """naive_generate(next_logits, prompt_ids, max_tokens) -> the greedy completion (list of ids).
    next_logits(token_ids) runs the stage's model over the whole sequence and returns the logits
    of its last position. Compared with the stage's LLM.generate: same tokens, same work per step."""
    st = stage.load(STAGE)
    context = stage.module(STAGE, "layers.context")
    prompts = [[5, 9, 14, 3, 77, 31, 8], [400, 12]]
    max_tokens = 6
    with st.LLM(stage.tiny_model(), device="cpu") as llm:
        model = llm.engine.model_runner.model
        fed = []

        @torch.inference_mode()
        def next_logits(token_ids):
            ids = [int(t) for t in token_ids]
            fed.append(ids)
            context.set_context(context.Context(cu_seqlens_q=[0, len(ids)]))
            try:
                hidden = model(torch.tensor(ids), torch.arange(len(ids)))  # (tokens, hidden)
            finally:
                context.set_context(None)
            return model.compute_logits(hidden[-1:])[0]  # (vocab,)

        for prompt in prompts:
            llm.stats.clear()
            expected = llm.generate([prompt], st.SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)[0]["token_ids"]
            fed.clear()
            got = naive_generate(next_logits, list(prompt), max_tokens)
            expect_equal(got, expected, "the completion differs from the stage's greedy LLM.generate",
                         prompt=prompt, max_tokens=max_tokens)
            want = [prompt + expected[:i] for i in range(max_tokens)]
            if fed != want:
                step = next((i for i, (a, b) in enumerate(zip(fed, want)) if a != b), min(len(fed), len(want)))
                fail(f"the right tokens, but not the naive way: step {step} should run the whole sequence so far "
                     f"(the stage ran {[r['num_tokens'] for r in llm.stats]} tokens per step)",
                     prompt=prompt, expected_at_that_step=want[step] if step < len(want) else "no more calls",
                     got=fed[step] if step < len(fed) else "no call")
    return (f"the same tokens as the stage's LLM.generate for {len(prompts)} prompts, "
            f"feeding the whole sequence every step ({len(prompts[0])}, {len(prompts[0]) + 1}, ... tokens)")


def check_gumbel_max(gumbel_max, samples: int = 20_000) -> str:
    """gumbel_max(logits, temperatures, uniform) -> token ids: greedy where the temperature is 0,
    else a draw from softmax(logits / T), made from the given uniform noise. Compared with
    softmax(logits / T) and with the stage's own Sampler, on one batch of mixed temperatures."""
    temperatures = (0.0, 0.5, 1.0, 2.0)
    logits = torch.tensor(LOGITS)  # (vocab,)
    vocab = len(logits)
    g = torch.Generator().manual_seed(1234)
    temps = torch.tensor(temperatures).repeat(samples)  # (rows,): 0, 0.5, 1, 2, 0, 0.5, ...
    rows = len(temps)
    uniform = torch.rand(rows, vocab, generator=g).clamp_(min=1e-12)  # (rows, vocab) in (0, 1)
    batch = logits.expand(rows, -1).clone()  # (rows, vocab)
    tokens = gumbel_max(batch.clone(), temps.clone(), uniform.clone())
    if not isinstance(tokens, torch.Tensor) or tokens.shape != (rows,):
        fail("return one token id per row: a tensor of shape (rows,)",
             expected=f"shape ({rows},)", got=tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__)
    if tokens.is_floating_point() or tokens.min() < 0 or tokens.max() >= vocab:
        fail("return token ids: integers in [0, vocab)", got=tokens[:8])
    again = gumbel_max(batch.clone(), temps.clone(), uniform.clone())
    if not torch.equal(tokens, again):
        fail("the same noise must give the same tokens: use the `uniform` argument, draw no noise of your own")

    Sampler = stage.module(STAGE, "layers.sampler").Sampler
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    greedy_rows = temps == 0
    stage_greedy = sampler(batch[greedy_rows], temps[greedy_rows])
    if not torch.equal(tokens[greedy_rows], stage_greedy):
        bad = (tokens[greedy_rows] != stage_greedy).nonzero()[0].item()
        fail("temperature 0 means greedy: the most likely token, whatever the noise",
             logits=LOGITS, expected=stage_greedy[bad].item(), got=tokens[greedy_rows][bad].item())
    tolerance = 5 * (0.25 / samples) ** 0.5  # five standard errors of a frequency
    worst = 0.0
    for t in temperatures[1:]:
        probs = torch.softmax(logits / t, dim=-1)
        freq = torch.bincount(tokens[temps == t], minlength=vocab).float() / samples
        stage_freq = torch.bincount(sampler(batch[:samples], torch.full((samples,), t)), minlength=vocab).float() / samples
        err = (freq - probs).abs()
        worst = max(worst, err.max().item())
        if err.max() > tolerance:
            i = err.argmax().item()
            fail(f"at T = {t} the draws do not follow softmax(logits / T): token {i} came up {freq[i]:.1%} of the time; "
                 f"softmax(logits / T) gives it {probs[i]:.1%}, and the stage's Sampler drew it {stage_freq[i]:.1%}",
                 logits=LOGITS, frequencies=[round(f, 3) for f in freq.tolist()],
                 softmax=[round(p, 3) for p in probs.tolist()])
    return (f"greedy at T = 0, and at T = 0.5, 1, 2 the frequencies of {samples:,} draws each are within "
            f"{worst:.3f} of softmax(logits / T) (allowed: {tolerance:.3f}), like the stage's Sampler")



def final_filter(logits: torch.Tensor, temperatures, top_k, top_p, min_p) -> torch.Tensor:
    """The final engine's masks (nanovllm_final.layers.sampler.mask_probs), renormalised."""
    import importlib

    mask_probs = importlib.import_module("nanovllm_final.layers.sampler").mask_probs
    probs = mask_probs(torch.softmax(logits / temperatures.unsqueeze(1), dim=-1), top_k, top_p, min_p)
    return probs / probs.sum(-1, keepdim=True)


def check_filter_probs(filter_probs) -> str:
    """STRETCH. filter_probs(logits, temperatures, top_k, top_p, min_p) -> (rows, vocab): the
    distribution a row samples from with vLLM's masks: softmax(logits / T); top_k keeps the k most
    likely (0: all); top_p then keeps the most likely tokens until their mass reaches p of what
    top_k kept (the token that crosses p stays, and so does the most likely one); min_p drops
    tokens below min_p times the most likely one's probability; renormalised to sum 1. Compared
    with the final engine's mask_probs."""
    g = torch.Generator().manual_seed(11)
    rows, vocab = 96, 40
    cases = {
        "no mask": (torch.zeros(rows, dtype=torch.long), torch.ones(rows), torch.zeros(rows)),
        "top_k only": (torch.randint(1, 12, (rows,), generator=g), torch.ones(rows), torch.zeros(rows)),
        "top_p only": (torch.zeros(rows, dtype=torch.long), 0.05 + 0.9 * torch.rand(rows, generator=g), torch.zeros(rows)),
        "min_p only": (torch.zeros(rows, dtype=torch.long), torch.ones(rows), 0.3 * torch.rand(rows, generator=g)),
        "all three": (torch.randint(0, 12, (rows,), generator=g), 0.05 + 0.9 * torch.rand(rows, generator=g),
                      0.2 * torch.rand(rows, generator=g)),
    }
    for name, (top_k, top_p, min_p) in cases.items():
        logits = 2.0 * torch.randn(rows, vocab, generator=g)  # (rows, vocab): no ties
        temperatures = 0.3 + 1.5 * torch.rand(rows, generator=g)  # (rows,)
        expected = final_filter(logits, temperatures, top_k, top_p, min_p)
        got = filter_probs(logits.clone(), temperatures.clone(), top_k.clone(), top_p.clone(), min_p.clone())
        if isinstance(got, torch.Tensor) and got.shape == expected.shape:
            bad = ((got.float() - expected).abs() > 1e-5).any(-1) | ~torch.isfinite(got.float()).all(-1)
            if bad.any():
                r = int(bad.nonzero()[0])
                kept = lambda p: (p[r] > 0).nonzero().flatten().tolist()
                fail(f"row {r} differs from the final engine's masks ({name})",
                     temperature=round(float(temperatures[r]), 3), top_k=int(top_k[r]), top_p=round(float(top_p[r]), 3),
                     min_p=round(float(min_p[r]), 3), expected_kept_tokens=kept(expected), got_kept_tokens=kept(got),
                     row_sums=f"expected 1, got {float(got[r].sum()):.4f}")
        expect_close(got, expected, f"the distribution differs from the final engine's masks ({name})", atol=1e-5)
    return (f"the same masked, renormalised distributions as the final engine's sampler in {len(cases)} batches of "
            f"{rows} rows (top_k, top_p, min_p alone and together)")


# ---- mixture of experts: the router's picks, and each expert's load ----


def _routing_cases() -> list[tuple[str, torch.Tensor, int, bool]]:
    """(name, router logits (tokens, experts), top_k, renormalize): the tiny MoE's shape, the real
    Qwen3-30B-A3B's (128 experts, 8 per token, bfloat16), top_k = 1 and top_k = all, and ties."""
    g = torch.Generator().manual_seed(7)
    cases = []
    for name, tokens, experts, top_k, dtype in (("8 experts, 2 per token", 6, 8, 2, torch.float32),
                                                ("128 experts, 8 per token, bfloat16", 32, 128, 8, torch.bfloat16),
                                                ("top_k = 1", 3, 16, 1, torch.float32),
                                                ("top_k = all 4 experts", 5, 4, 4, torch.float32)):
        logits = (1.5 * torch.randn(tokens, experts, generator=g)).to(dtype)  # (tokens, experts)
        cases += [(name, logits, top_k, renormalize) for renormalize in (True, False)]
    ties = torch.tensor([[0.0] * 8,  # every expert tied
                         [2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0, -1.0],  # three tied for two places
                         [3.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]])  # three tied for the second place
    cases += [("ties", ties, 2, renormalize) for renormalize in (True, False)]
    return cases


def _pairs(weights: torch.Tensor, ids: torch.Tensor, t: int) -> list[tuple[int, float]]:
    """Token t's (expert, weight) pairs, by expert id."""
    return sorted((int(e), round(float(w), 4)) for e, w in zip(ids[t].tolist(), weights[t].float().tolist()))


def check_route(route) -> str:
    """route(router_logits, top_k, renormalize) -> (weights, expert_ids), each (tokens, top_k):
    every token's top_k most likely experts under a softmax over all experts (in float32), with
    their probabilities as weights, scaled to sum to 1 when renormalize (config.json's
    norm_topk_prob); weights in the logits' dtype. A token's slots may come in any order, and of
    tied experts any may be picked. Compared with the stage's own route (layers/moe.py)."""
    stage_route = stage.module(STAGE, "layers.moe").route
    cases = _routing_cases()
    for name, logits, top_k, renormalize in cases:
        tokens, experts = logits.shape
        inputs = dict(case=name, router_logits=f"shape {tuple(logits.shape)}, {logits.dtype}", top_k=top_k,
                      renormalize=renormalize)
        got = route(logits.clone(), top_k, renormalize)
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(x, torch.Tensor) for x in got)):
            fail("return a pair of tensors: (weights, expert_ids)", **inputs, got=type(got).__name__)
        weights, ids = got
        for what, x in (("weights", weights), ("expert_ids", ids)):
            if x.shape != (tokens, top_k):
                fail(f"{what} has one row per token and one column per chosen expert: shape (tokens, top_k)",
                     **inputs, expected=(tokens, top_k), got=tuple(x.shape))
        if ids.is_floating_point() or ids.is_complex():
            fail("expert_ids are integer indices of experts (what topk returns)", **inputs, got=ids.dtype)
        if weights.dtype != logits.dtype:
            fail("the weights come back in the router logits' dtype: the layer multiplies each expert's output "
                 "by them", **inputs, expected=logits.dtype, got=weights.dtype)
        ids = ids.long()
        if ids.min() < 0 or ids.max() >= experts:
            fail(f"expert ids lie in [0, num_experts = {experts})", **inputs, got=ids[:4])
        repeated = (ids.sort(-1).values.diff(dim=-1) == 0).any(-1)  # (tokens,)
        if repeated.any():
            t = int(repeated.nonzero()[0])
            fail(f"token {t} picks one expert twice: a token's top_k experts are distinct", **inputs, got=ids[t])
        # the stage's routing: its picks, and every expert's probability (top_k = all experts, as they are)
        ref_weights, ref_ids = stage_route(logits, top_k, renormalize)  # (tokens, top_k) each
        all_probs, all_ids = stage_route(logits.float(), experts, False)  # (tokens, experts), most likely first
        probs = torch.zeros(tokens, experts).scatter(1, all_ids, all_probs)  # (tokens, experts), float32
        chosen = probs.gather(1, ids).sort(-1, descending=True).values  # (tokens, top_k): what yours picked
        best = probs.gather(1, ref_ids).sort(-1, descending=True).values  # what the stage picked
        eps = torch.finfo(logits.dtype).eps
        worse = (chosen < best * (1 - eps)).any(-1)  # a pick less likely than the stage's, beyond the dtype's precision
        if worse.any():
            t = int(worse.nonzero()[0])
            fail(f"token {t} does not get its {top_k} most likely experts (probabilities from a softmax over all "
                 f"{experts} experts, in float32)", **inputs,
                 expected_experts=sorted(ref_ids[t].tolist()), got=sorted(ids[t].tolist()),
                 your_picks_probabilities=[round(p, 4) for p in probs.gather(1, ids)[t].tolist()],
                 stage_picks_probabilities=[round(p, 4) for p in probs.gather(1, ref_ids)[t].tolist()])
        # your weights and the stage's, both ordered by probability (tied experts have equal weights)
        mine = probs.gather(1, ids).argsort(dim=-1, descending=True, stable=True)  # (tokens, top_k)
        theirs = probs.gather(1, ref_ids).argsort(dim=-1, descending=True, stable=True)
        ids, weights = ids.gather(1, mine), weights.gather(1, mine)
        expected = ref_weights.float().gather(1, theirs)  # (tokens, top_k)
        atol = max(eps, 1e-6)
        bad = ((weights.float() - expected).abs() > atol).any(-1) | ~torch.isfinite(weights.float()).all(-1)
        if bad.any():
            t = int(bad.nonzero()[0])
            sums, want = weights[t].float().sum().item(), expected[t].sum().item()
            if renormalize and abs(sums - 1) > top_k * atol:
                hint = (f"with renormalize=True (norm_topk_prob) a token's {top_k} weights are scaled to sum to 1: "
                        f"token {t}'s sum to {sums:.4f}")
            elif not renormalize and abs(sums - 1) <= top_k * atol < 1 - want:
                hint = (f"with renormalize=False the weights are the softmax over all {experts} experts, kept as they "
                        f"are: token {t}'s should sum to {want:.4f}, yours sum to 1 (a softmax over the top_k "
                        f"logits alone is the same as renormalising)")
            else:
                hint = f"token {t}'s weights differ from the stage's"
            fail(hint, **inputs, expected=_pairs(expected, ids, t), got=_pairs(weights, ids, t))
    return (f"the same experts and weights as the stage's route in {len(cases)} cases: float32 and bfloat16, "
            "renormalised and not, top_k = 1 up to all experts, ties")


def check_expert_load(expert_load) -> str:
    """expert_load(expert_ids, num_experts) -> (num_experts,) integer tensor: how many tokens each
    expert receives. A token counts once for every expert among its top_k (so the counts sum to
    tokens * top_k), and an expert no token picked counts 0. Compared with the rows the stage's
    Experts loop gathers for each expert (torch.where(expert_ids == e)), on the stage's routes."""
    stage_route = stage.module(STAGE, "layers.moe").route
    g = torch.Generator().manual_seed(8)
    cases = []
    for tokens, experts, top_k in ((12, 8, 2), (40, 128, 8), (1, 8, 2), (300, 16, 4)):
        logits = torch.randn(tokens, experts, generator=g)  # (tokens, experts)
        logits[:, -2:] -= 20.0  # the last two experts never win a place: their count is 0
        cases.append((stage_route(logits, top_k, True)[1], experts))
    for ids, experts in cases:
        tokens, top_k = ids.shape
        inputs = dict(expert_ids=f"shape {tuple(ids.shape)}", num_experts=experts)
        expected = torch.tensor([len(torch.where(ids == e)[0]) for e in range(experts)])  # (experts,)
        got = expert_load(ids.clone(), experts)
        if not isinstance(got, torch.Tensor) or got.shape != (experts,):
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            fail("return one count per expert, shape (num_experts,), counting 0 for an expert no token picked",
                 **inputs, expected=(experts,), got=shape)
        if got.is_floating_point() or got.is_complex():
            fail("the counts are integers (tokens, not weights)", **inputs, got=got.dtype)
        if int(got.sum()) == tokens != tokens * top_k:
            fail(f"the counts sum to {tokens}, the number of tokens: a token counts once for every one of its "
                 f"{top_k} experts (tokens * top_k = {tokens * top_k})", **inputs, expected=expected, got=got)
        expect_equal(got, expected, "the counts differ from the rows the stage's Experts loop gives each expert",
                     **inputs)
    return (f"the same tokens per expert as the stage's Experts loop gathers, in {len(cases)} routings "
            "(8 to 128 experts, experts without tokens included)")
