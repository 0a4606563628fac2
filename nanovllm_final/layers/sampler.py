"""From logits to tokens: penalties, temperature, top-k / top-p / min-p masks and
Gumbel-max sampling, for a whole batch in one pass on the device.

Gumbel-max: argmax(p_i / E_i) with E_i ~ Exp(1) picks token i with probability
p_i / sum(p): -log E_i is Gumbel noise, and argmax(log p_i + Gumbel_i) ~ p. A mask that
sets p_i = 0 removes token i; nothing needs renormalising, and when every row keeps at
most k tokens, only the k most likely need to be looked at. A row with a seed draws its
noise from a counter-based hash of its key, made from (seed, output position), and the
token id, so its tokens do not depend on the rest of the batch, its order, or preemption;
the other rows draw from the engine's generator: on CUDA one random key per row, which the
Triton draw hashes the same way, in registers (no noise tensor is written or read); on the
CPU, torch's exponential noise."""

import enum

import torch
from torch import nn

from ..kernels import dispatch

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), without overflowing int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser: every input bit flips about half the output bits."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def seed_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(rows,) int64 keys in [0, 2**32) of seeded rows: a function of (seed, output position)."""
    key = _mix32(_mix32(seeds & _M32) ^ ((seeds >> 32) & _M32))  # (rows,)
    return _mix32(key ^ _mul32(positions & _M32, 0x9E3779B1))  # (rows,)


def keyed_exponential(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise that is a pure function of (row key, token id): (rows, n) for the token
    ids (n,) of the vocabulary or (rows, n) of each row's candidates. kernels/sampling.py's draws
    compute the same values in registers (_keyed_exponential)."""
    tokens = _mul32(token_ids.to(torch.int64), 0x27D4EB2F)  # (n,) or (rows, n)
    h = _mix32(_mix32(keys[:, None] ^ tokens) ^ keys[:, None])  # (rows, n)
    u = ((h >> 8).float() + 0.5) * 2.0**-24  # uniform in (0, 1), 24 bits
    u = u.clamp(
        max=1 - 2.0**-24
    )  # the top value rounds to 1.0 in float32: E = 0 would make p / E NaN, drawn by argmax
    return -torch.log(u)


def seeded_exponential(
    seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """keyed_exponential with the keys of seeded rows: a pure function of (seed, position, token id)."""
    return keyed_exponential(seed_keys(seeds, positions), token_ids)


def apply_penalties(
    logits: torch.Tensor,  # (rows, vocab) float32
    output_counts: torch.Tensor,  # (rows, vocab) how often each token was generated
    prompt_mask: torch.Tensor,  # (rows, vocab) bool: in the prompt
    repetition: torch.Tensor,  # (rows,) 1 = off
    presence: torch.Tensor,  # (rows,) 0 = off
    frequency: torch.Tensor,  # (rows,) 0 = off
) -> torch.Tensor:
    """vLLM's penalties: repetition divides positive (multiplies negative) logits of every token
    seen in the prompt or the output; presence and frequency subtract from generated tokens."""
    generated = output_counts > 0
    r = repetition.unsqueeze(1)  # (rows, 1)
    logits = torch.where(
        prompt_mask | generated, torch.where(logits > 0, logits / r, logits * r), logits
    )
    return logits - frequency.unsqueeze(1) * output_counts - presence.unsqueeze(1) * generated


def by_temperature(x: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """x (rows, n) / max(T, 1e-5) per row, in float32: bf16/fp16 logits are widened by the
    division itself (temperatures are float32), without a float32 copy first."""
    return x / temperatures.clamp(min=1e-5).unsqueeze(1)  # (rows, n)


def keep_sorted(
    sorted_p: torch.Tensor,  # (rows, n) probabilities, most likely first
    top_k: torch.Tensor | None,  # (rows,) int, 0 = all
    top_p: torch.Tensor | None,  # (rows,) float, 1 = all
) -> torch.Tensor:  # (rows, n) bool
    """top_k keeps the k most likely; top_p then keeps the most likely tokens until (the
    top-k renormalised) mass reaches p. The most likely token always stays."""
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, sorted_p.shape[-1]).unsqueeze(1)  # (rows, 1)
        keep &= torch.arange(sorted_p.shape[-1], device=sorted_p.device) < k
        sorted_p = sorted_p * keep
    if top_p is not None:
        total = sorted_p.sum(-1, keepdim=True)  # (rows, 1): the mass top-k kept
        before = sorted_p.cumsum(-1) - sorted_p  # (rows, n): mass of the more likely tokens
        keep &= (before < top_p.unsqueeze(1) * total) | (top_p >= 1).unsqueeze(1)
    return keep


def _group_size(vocab: int, k: int) -> int | None:
    """The widest group (a power of two, 16..128) that divides the vocabulary and leaves the
    k groups' logits at most an eighth of it; None: no such group, a plain top-k is as cheap."""
    for group in (128, 64, 32, 16):
        if vocab % group == 0 and 8 * k * group <= vocab:
            return group
    return None


def top_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits.topk(k, dim=-1): the k largest values of each row, largest first, and their ids
    (among equal values, any ids). Over a large vocabulary in two small passes instead of a
    radix select over all of it: the k groups (of `_group_size` logits) with the largest maxima
    hold the k largest logits (a group holding one of them has a maximum at least as large,
    and fewer than k other groups can have a larger one), so the top k of those k groups' logits
    are the answer."""
    rows, vocab = logits.shape
    group = _group_size(vocab, k)
    if group is None:
        return logits.topk(k, dim=-1)
    if dispatch.use_kernel(logits):
        return dispatch.sampling.top_candidates(
            logits, k, group
        )  # the same two passes, in two launches
    maxima = logits.unflatten(-1, (vocab // group, group)).amax(-1)  # (rows, vocab // group)
    groups = maxima.topk(k, dim=-1).indices  # (rows, k)
    ids = (groups.unsqueeze(-1) * group + torch.arange(group, device=logits.device)).flatten(
        1
    )  # (rows, k * group)
    values, pick = logits.gather(1, ids).topk(k, dim=-1)  # (rows, k)
    return values, ids.gather(1, pick)


def mask_probs(
    probs: torch.Tensor,  # (rows, vocab), softmax(logits / T)
    top_k: torch.Tensor | None,  # (rows,) int, 0 = all
    top_p: torch.Tensor | None,  # (rows,) float, 1 = all
    min_p: torch.Tensor | None,  # (rows,) float, 0 = all
) -> torch.Tensor:
    """Zero the tokens the masks drop (`keep_sorted`, over the sorted vocabulary); min_p drops
    tokens below min_p times the most likely one's probability."""
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k is not None or top_p is not None:
        sorted_p, order = probs.sort(dim=-1, descending=True)  # (rows, vocab)
        keep = keep.scatter(
            -1, order, keep_sorted(sorted_p, top_k, top_p)
        )  # back to vocabulary order
    if min_p is not None:
        keep &= probs >= min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return probs.masked_fill(~keep, 0.0)


class Path(enum.Enum):
    """How a step's tokens are drawn. `pick_path` is the one place that chooses."""

    VERIFY = "verify"  # speculative rows: accept or reject proposals (engine/rejection_sampler.py)
    GREEDY = "greedy"  # every row at temperature 0: the argmax, no noise
    FUSED_TEMPERATURE = (
        "fused_temperature"  # no masks, a kernel: Gumbel-max over the vocabulary, in one pass
    )
    FUSED_CANDIDATES = (
        "fused_candidates"  # every row has top_k, a kernel: masks and the draw among the candidates
    )
    CANDIDATES = (
        "candidates"  # every row has top_k: softmax, masks and noise over the top-k candidates
    )
    MASKED = "masked"  # masks, some row without top_k: softmax and masks over the vocabulary
    TEMPERATURE = "temperature"  # no masks: argmax(logits / T - log E), no softmax


def pick_path(
    vocab: int,
    fused: bool,
    *,
    verify: bool = False,
    all_greedy: bool = False,
    max_k: int | None = None,
    masks: bool = False,
) -> Path:
    """The draw of a batch, from what the host knows of it: `fused` (dispatch.use_kernel of its
    logits), rows that verify proposals, every row greedy, every row's top_k in 1..`max_k`, any
    top-k / top-p / min-p mask. Candidates only pay when max_k is below the vocabulary."""
    if verify:
        return Path.VERIFY
    if all_greedy:
        return Path.GREEDY
    if max_k is not None and max_k < vocab:
        return Path.FUSED_CANDIDATES if fused else Path.CANDIDATES
    if masks:
        return Path.MASKED
    return Path.FUSED_TEMPERATURE if fused else Path.TEMPERATURE


def candidate_probs(
    values: torch.Tensor,  # (rows, k) each row's k largest logits, largest first
    temperatures: torch.Tensor,  # (rows,) float32
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:  # (rows, k)
    """softmax(values / T) renormalised over the candidates, the masks' tokens zeroed."""
    probs = torch.softmax(by_temperature(values, temperatures), dim=-1)
    keep = keep_sorted(probs, top_k, top_p)
    if min_p is not None:
        keep &= probs >= min_p.unsqueeze(1) * probs[:, :1]
    return probs.masked_fill(~keep, 0.0)


class Sampler(nn.Module):
    """Greedy for temperature 0, masked Gumbel-max sampling otherwise."""

    def __init__(self, seed: int, device: torch.device):
        super().__init__()
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def forward(
        self,
        logits: torch.Tensor,  # (rows, vocab), after penalties
        temperatures: torch.Tensor,  # (rows,) float32, 0 = greedy
        top_k: torch.Tensor | None = None,
        top_p: torch.Tensor | None = None,
        min_p: torch.Tensor | None = None,
        seeds: torch.Tensor | None = None,  # (rows,) int64, -1 = no seed (the engine's generator)
        positions: torch.Tensor
        | None = None,  # (rows,) int64: the output index each row samples (with seeds)
        max_k: int | None = None,  # every row's top_k is in 1..max_k (known on the host)
        greedy_rows: bool = True,  # False: no row has temperature 0 (known on the host)
        path: Path | None = None,  # pick_path's choice (None: chosen here, from the arguments)
    ) -> torch.Tensor:  # (rows,) int64
        """With `max_k`, only the max_k largest logits of each row can be drawn, so the masks and
        the noise work on those candidates (a partial sort), not on the whole vocabulary. A seeded
        row draws the same token either way: its noise is a function of the token id. On CUDA,
        one Triton launch draws among the candidates (kernels/sampling.py's candidates_draw) or, without
        masks, over the vocabulary (gumbel_argmax), hashing each token's noise from
        its row's key: for seeded rows the tokens the PyTorch code below draws."""
        vocab = logits.shape[-1]
        if path is None:
            masks = top_k is not None or top_p is not None or min_p is not None
            path = pick_path(vocab, dispatch.use_kernel(logits), max_k=max_k, masks=masks)
        if path is Path.GREEDY:
            return logits.argmax(dim=-1)  # (rows,)
        if (
            path is Path.FUSED_TEMPERATURE
        ):  # one launch, the noise hashed in registers from each row's key
            keys = self.row_keys(seeds, positions, logits.shape[0], logits.device)
            return dispatch.sampling.gumbel_argmax(
                logits, keys, temperatures
            )  # the greedy rows' argmax too
        candidates = probs = None  # probs None: the draw needs no probabilities (temperature only)
        if path in (Path.CANDIDATES, Path.FUSED_CANDIDATES):
            values, candidates = top_candidates(logits, max_k)  # (rows, max_k), largest first
        if path is Path.FUSED_CANDIDATES:
            keys = self.row_keys(seeds, positions, logits.shape[0], logits.device)
            sampled = dispatch.sampling.candidates_draw(
                values, candidates, keys, temperatures, top_k, top_p, min_p
            )
        else:
            if path is Path.CANDIDATES:
                probs = candidate_probs(values, temperatures, top_k, top_p, min_p)
            elif path is Path.MASKED:
                probs = mask_probs(
                    torch.softmax(by_temperature(logits, temperatures), dim=-1), top_k, top_p, min_p
                )
            sampled = self.draw(logits, temperatures, probs, candidates, seeds, positions)
        if not greedy_rows:
            return sampled
        return torch.where(temperatures == 0, logits.argmax(dim=-1), sampled)

    def draw(
        self,
        logits: torch.Tensor,  # (rows, vocab)
        temperatures: torch.Tensor,  # (rows,)
        probs: torch.Tensor
        | None,  # (rows, vocab) or (rows, k) masked probabilities; None: temperature only
        candidates: torch.Tensor
        | None,  # (rows, k) the token ids of probs' columns; None: the vocabulary
        seeds: torch.Tensor | None,
        positions: torch.Tensor | None,
    ) -> torch.Tensor:  # (rows,) int64
        """Gumbel-max in PyTorch: Exp(1) noise from the generator, seeded rows' from their keys."""
        vocab = logits.shape[-1]
        shape = logits.shape if candidates is None else candidates.shape
        noise = torch.empty(shape, device=logits.device).exponential_(
            generator=self.generator
        )  # Exp(1)
        if seeds is not None:
            seeded = seeds >= 0  # (rows,)
            ids = (
                candidates if candidates is not None else torch.arange(vocab, device=logits.device)
            )
            noise = torch.where(
                seeded.unsqueeze(1), seeded_exponential(seeds.clamp(min=0), positions, ids), noise
            )
        if (
            probs is None
        ):  # argmax(p_i / E_i) = argmax(logit_i / T - log E_i): softmax's normaliser drops out
            choice = (by_temperature(logits, temperatures) - noise.log_()).argmax(dim=-1)  # (rows,)
        else:
            choice = (probs / noise).argmax(dim=-1)  # (rows,)
        return (
            choice if candidates is None else candidates.gather(1, choice.unsqueeze(1)).squeeze(1)
        )

    def row_keys(
        self,
        seeds: torch.Tensor | None,
        positions: torch.Tensor | None,
        rows: int,
        device: torch.device,
    ) -> torch.Tensor:
        """(rows,) int64 keys of the fused draws: seeded rows' seed_keys, the others' from the generator."""
        keys = torch.randint(0, 2**32, (rows,), generator=self.generator, device=device)
        if seeds is None:
            return keys
        return torch.where(seeds >= 0, seed_keys(seeds.clamp(min=0), positions), keys)


def logprobs_of(
    logits: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log_softmax of the raw logits in float32: the sampled tokens' (rows,), and the top k's
    values and ids (rows, k)."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # (rows, vocab)
    top = (
        lp.topk(k, dim=-1) if k > 0 else (lp.new_empty(len(lp), 0), token_ids.new_empty(len(lp), 0))
    )  # no views of lp
    return lp.gather(1, token_ids.unsqueeze(1)).squeeze(1), top[0], top[1]
