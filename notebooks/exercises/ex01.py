"""Checks for 01_naive.ipynb: the naive generation loop, and Gumbel-max sampling from uniform noise."""

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
