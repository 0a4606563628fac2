"""Checks for 01_naive.ipynb: the naive generation loop, and Gumbel-max sampling from uniform noise."""

import torch

from . import stage
from .report import expect_equal, fail

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

