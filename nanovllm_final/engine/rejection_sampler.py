"""Speculative sampling: verify k proposed tokens against the target model in one step, and
sample exactly from the target's distribution.

A verify step feeds a sequence's last token and its k proposals d_1..d_k; row i of its logits
gives the target's distribution p_i of the token after d_i (row 0: after the last token). Row
i < k tests d_{i+1}, drawn by the proposer from q_i:

    accept d_{i+1} with probability min(1, p_i(d) / q_i(d))
    else emit a token drawn from the normalised residual (p_i - q_i)+, and stop
    if all k are accepted, emit a bonus token drawn from p_k

The emitted token is distributed exactly as p_i: P(x) = q(x) min(1, p(x)/q(x)) +
(1 - sum_y min(q(y), p(y))) (p(x) - q(x))+ / sum_y (p(y) - q(y))+ = min(q(x), p(x)) +
(p(x) - q(x))+ = p(x), since both sums equal the mass where p and q differ. A proposer that
proposes one token (n-gram lookup, a greedy draft) has q = a point mass on d: d is accepted with
probability p(d), and the residual is p with d removed. Greedy rows have p = a point mass on the
argmax: d is accepted iff it is the argmax, else the argmax is emitted, token for token what
decoding without speculation emits.

p is what the sampler draws from (engine/sampling.py): penalties, temperature, top-k, top-p and
min-p applied to the row's logits, with each row penalised as if the proposals before it were
accepted. Seeded rows draw their uniform and their noise from (seed, output position, token id)
(layers/sampler.py's keyed noise), so a seeded request's tokens do not depend on the batch."""

import torch

from ..layers.sampler import by_temperature, keyed_exponential, mask_probs, seed_keys
from .sampling import SamplingBatch, penalized
from .step_input import to_device


def acceptance_probability(p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """(rows,) the chance that a proposed token d is kept: min(1, p(d) / q(d))."""
    return (p_draft / q_draft).clamp(max=1.0)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(rows, vocab) what a rejected row draws from (unnormalised): (p - q)+."""
    return (p - q).clamp(min=0.0)


def verify_rows(
    p: torch.Tensor,  # (rows, vocab) float32 target probabilities
    draft_ids: torch.Tensor,  # (rows,) int64 the proposal each row tests, -1: a bonus row (tests none)
    uniforms: torch.Tensor,  # (rows,) U(0, 1)
    noise: torch.Tensor,  # (rows, vocab) Exp(1)
    q: torch.Tensor
    | None = None,  # (rows, vocab) proposal probabilities (0 on bonus rows); None: point masses
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted (rows,) bool, drawn (rows,) int64): whether each row keeps its proposal, and the
    token it emits otherwise, drawn from the residual (a bonus row: from p) by Gumbel-max."""
    has_draft = draft_ids >= 0
    ids = draft_ids.clamp(min=0).unsqueeze(1)  # (rows, 1)
    if q is None:
        q = torch.zeros_like(p).scatter_(
            1, ids, has_draft.unsqueeze(1).to(p.dtype)
        )  # (rows, vocab)
    p_d, q_d = p.gather(1, ids).squeeze(1), q.gather(1, ids).squeeze(1)  # (rows,)
    accepted = has_draft & (uniforms < acceptance_probability(p_d, q_d.clamp(min=1e-30)))
    drawn = (residual(p, q) / noise).argmax(dim=-1)  # argmax(w / E) ~ w / sum(w)
    return accepted, drawn


def target_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """(rows, vocab) float32: what the sampler would draw each row from."""
    device = logits.device
    logits = penalized(logits, batch).float()
    temperatures = to_device(batch.temperatures, device)
    optional = [
        None if getattr(batch, n) is None else to_device(getattr(batch, n), device)
        for n in ("top_k", "top_p", "min_p")
    ]
    probs = mask_probs(torch.softmax(by_temperature(logits, temperatures), dim=-1), *optional)
    if (batch.temperatures == 0).any():  # known on the host: no sync
        greedy = (temperatures == 0).unsqueeze(1)  # (rows, 1)
        probs = torch.where(
            greedy,
            torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[1]).to(probs.dtype),
            probs,
        )
    return probs / probs.sum(dim=-1, keepdim=True)


def random_draws(
    generator: torch.Generator, batch: SamplingBatch, rows: int, vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(uniforms (rows,), noise (rows, vocab)): from the generator, or keyed by (seed, position)."""
    uniforms = torch.rand(rows, generator=generator, device=device)
    noise = torch.empty(rows, vocab, device=device).exponential_(generator=generator)
    if batch.seeds is None:
        return uniforms, noise
    seeds, positions = to_device(batch.seeds, device), to_device(batch.positions, device)
    seeded = seeds >= 0  # (rows,)
    keys = seed_keys(seeds.clamp(min=0), positions)
    keyed = keyed_exponential(
        keys, torch.arange(vocab + 1, device=device)
    )  # (rows, vocab + 1): the last one for u
    uniforms = torch.where(seeded, torch.exp(-keyed[:, vocab]), uniforms)  # exp(-E) ~ U(0, 1)
    return uniforms, torch.where(seeded.unsqueeze(1), keyed[:, :vocab], noise)


@torch.inference_mode()
def verify(
    generator: torch.Generator, logits: torch.Tensor, batch: SamplingBatch, draft_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted, drawn) of every row of a verify step with sampled rows, queued on the device
    (an all-greedy step takes the argmax alone: spec_verify.verify_step)."""
    p = target_probs(logits, batch)
    uniforms, noise = random_draws(generator, batch, *p.shape, logits.device)
    return verify_rows(p, draft_ids, uniforms, noise)
