"""Sampling a step, from its sequences to token ids on the host (rank 0 only):

    batch = build_sampling_batch(seqs, eos_token_ids)  # host: each row's parameters as arrays
    pending = runner.sample(logits, batch)             # queued on the device (sample() below)
    pending.token_ids                                  # (rows,) on the device: overlap feeds them to the next step
    pending.result()                                   # waits for the copies: SampledTokens

The math (penalties, masks, Gumbel-max, logprobs) is layers/sampler.py's, and so is the choice of
the draw (`pick_path`, given the batch's host facts by `batch_path`); this module turns sequences
into its inputs and its outputs into what the engine reads."""

from dataclasses import dataclass, field

import numpy as np
import torch

from ..kernels import dispatch
from ..layers.sampler import Path, Sampler, apply_penalties, logprobs_of, pick_path
from .sequence import Sequence
from .step_input import to_device, upload
from .structured import apply_bitmask

# below 1 / vocabulary every top_p keeps the most likely token alone; flooring it there keeps
# top_p x mass a normal float32 (a top_p of 1e-300 is 0 in float32, and would keep no token)
TOP_P_FLOOR = 1e-8


@dataclass
class SamplingBatch:
    temperatures: np.ndarray  # (rows,) float32, 0 = greedy
    top_k: np.ndarray | None  # (rows,) int64, 0 = off; None: off for every row
    top_p: np.ndarray | None  # (rows,) float32, 1 = off
    min_p: np.ndarray | None  # (rows,) float32, 0 = off
    seeds: np.ndarray | None  # (rows,) int64, -1 = the engine's generator; None: no row has a seed
    positions: np.ndarray  # (rows,) int64: output index of the token each row samples
    penalties: dict | None  # repetition/presence/frequency (rows,) and the rows' prompt/output ids
    suppress: tuple[np.ndarray, np.ndarray] | None  # (row, token id) pairs masked out (min_tokens)
    num_logprobs: int | None  # the largest `logprobs` of the rows; None: no row asks
    on_device: dict = field(
        default_factory=dict
    )  # the columns' device copies, kept with the columns (SamplingColumns)
    grammar: object | None = (
        None  # structured output: the constrained rows and their bitmask (structured.HostMask)
    )
    drafts: tuple | None = (
        None  # speculative: the verifying sequences and each row's proposal (spec_verify.py)
    )

    @property
    def all_greedy(self) -> bool:
        """Every row takes the argmax: no masks, no noise to compute."""
        return not self.temperatures.any()

    @property
    def max_k(self) -> int | None:
        """Every row keeps at most its top_k: a partial sort of max(top_k) columns is enough."""
        return int(self.top_k.max()) if self.top_k is not None and (self.top_k > 0).all() else None


def batch_path(batch: SamplingBatch, logits: torch.Tensor) -> Path:
    """The draw the batch takes (layers/sampler.py's pick_path), from what the host knows of it."""
    masks = batch.top_k is not None or batch.top_p is not None or batch.min_p is not None
    return pick_path(
        logits.shape[-1],
        dispatch.use_kernel(logits),
        verify=batch.drafts is not None,
        all_greedy=batch.all_greedy,
        max_k=batch.max_k,
        masks=masks,
    )


def completion_seed(seed: int, index: int) -> int:
    """The seed of completion `index` of a request seeded with `seed` (its n completions differ)."""
    return (seed + index * 0x9E3779B97F4A7C15) % 2**63


def param_columns(seqs: list[Sequence]) -> dict:
    """What the rows' sampling parameters alone decide: their columns (None for a knob no row
    turns), the penalty weights, whether any row has min_tokens, the most logprobs asked."""
    params = [s.params for s in seqs]

    def column(name: str, dtype, off) -> np.ndarray | None:
        values = np.array([getattr(p, name) for p in params], dtype)
        return None if (values == off).all() else values

    asked = [p.logprobs for p in params if p.logprobs is not None]
    return {
        "temperatures": np.array([p.temperature for p in params], np.float32),
        "top_k": column("top_k", np.int64, 0),
        "top_p": None
        if (top_p := column("top_p", np.float32, 1.0)) is None
        else np.maximum(top_p, TOP_P_FLOOR),
        "min_p": column("min_p", np.float32, 0.0),
        "seeds": np.array(
            [
                -1 if p.seed is None else completion_seed(p.seed, s.index)
                for s, p in zip(seqs, params)
            ],
            np.int64,
        )
        if any(p.seed is not None for p in params)
        else None,
        "penalties": None
        if not any(p.has_penalties for p in params)
        else {
            "repetition": np.array([p.repetition_penalty for p in params], np.float32),
            "presence": np.array([p.presence_penalty for p in params], np.float32),
            "frequency": np.array([p.frequency_penalty for p in params], np.float32),
        },
        "min_tokens": any(p.min_tokens for p in params),
        "num_logprobs": max(asked) if asked else None,
        "on_device": {},  # filled by sample(): the columns are uploaded once while they stay
    }


class SamplingColumns:
    """param_columns of the rows, kept while a step samples the same sequences as the step
    before (most decode steps); a sequence's parameters never change."""

    def __init__(self):
        self.seq_ids: list[int] = []
        self.columns: dict = {}

    def get(self, seqs: list[Sequence]) -> dict:
        seq_ids = [s.seq_id for s in seqs]
        if seq_ids != self.seq_ids:
            self.columns, self.seq_ids = param_columns(seqs), seq_ids
        return self.columns


def build_sampling_batch(
    seqs: list[Sequence], eos_token_ids: list[int], columns: SamplingColumns | None = None
) -> SamplingBatch:
    """`seqs`: the sequences that sample this step, in row order. `columns`: the engine's, kept
    from step to step (computed afresh when None)."""
    cols = columns.get(seqs) if columns is not None else param_columns(seqs)
    suppress_rows, suppress_ids = [], []
    if cols["min_tokens"]:
        for row, seq in enumerate(seqs):
            p = seq.params
            if seq.num_completion_tokens < p.min_tokens:  # EOS and stop ids may not end it yet
                ids = ([] if p.ignore_eos else eos_token_ids) + p.stop_token_ids
                suppress_rows += [row] * len(ids)
                suppress_ids += ids
    penalties = cols["penalties"]
    return SamplingBatch(
        temperatures=cols["temperatures"],
        top_k=cols["top_k"],
        top_p=cols["top_p"],
        min_p=cols["min_p"],
        seeds=cols["seeds"],
        positions=np.fromiter((s.num_completion_tokens for s in seqs), np.int64, len(seqs)),
        penalties=None
        if penalties is None
        else {
            **penalties,
            "prompt_ids": [s.token_ids[: s.num_prompt_tokens] for s in seqs],
            "output_ids": [s.completion_token_ids for s in seqs],
        },
        suppress=(np.array(suppress_rows, np.int64), np.array(suppress_ids, np.int64))
        if suppress_rows
        else None,
        num_logprobs=cols["num_logprobs"],
        on_device=cols["on_device"],
    )


@dataclass
class SampledTokens:
    token_ids: list[int]  # one per sampling row
    logprobs: (
        list[dict] | None
    )  # per row {"token_id", "logprob", "top_logprobs"}; None if no row asked


class PendingSample:
    """A step's sampled ids (and logprobs) on their way to the host: the copies are queued
    behind the step on the device, and `result()` waits for them (the step's one sync)."""

    def __init__(self, token_ids: torch.Tensor, logprobs: tuple[torch.Tensor, ...] = ()):
        self.token_ids = token_ids  # (rows,) on the device
        self.host = [
            t.to("cpu", non_blocking=True) for t in (token_ids, *logprobs)
        ]  # into pinned memory on CUDA
        self.done = torch.cuda.Event() if token_ids.is_cuda else None
        if self.done is not None:
            self.done.record()

    def result(self) -> SampledTokens:
        if self.done is not None:
            self.done.synchronize()
        ids, *rest = (t.tolist() for t in self.host)
        if not rest:
            return SampledTokens(ids, None)
        chosen, top_values, top_ids = rest
        logprobs = [
            {"token_id": t, "logprob": lp, "top_logprobs": dict(zip(i, v))}
            for t, lp, v, i in zip(ids, chosen, top_values, top_ids)
        ]
        return SampledTokens(ids, logprobs)


@torch.inference_mode()
def sample(
    sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch, path: Path | None = None
) -> PendingSample:
    """Penalties, the grammar's mask, then the draw `path` (batch_path's when None); logprobs from
    the raw logits. Queued on the device."""
    device = logits.device
    path = batch_path(batch, logits) if path is None else path
    raw = logits  # (rows, vocab) in the model's dtype
    logits = penalized(logits, batch)
    if batch.grammar is not None:  # before every draw below: each picks among the allowed tokens
        inplace = (
            logits is not raw or batch.num_logprobs is None
        )  # the logprobs read the raw logits
        logits = apply_bitmask(logits, *batch.grammar.to(device), inplace=inplace)
    if path is Path.GREEDY:
        token_ids = logits.argmax(dim=-1)  # (rows,)
    else:
        # the rows' columns on the device, in one copy while the rows stay; positions change every step
        names = [
            name
            for name in ("top_k", "top_p", "min_p", "seeds")
            if getattr(batch, name) is not None
        ]
        if device not in batch.on_device:
            batch.on_device[device] = upload(
                [getattr(batch, name) for name in names] + [batch.temperatures], device
            )
        *columns, temperatures = batch.on_device[device]
        optional = dict(zip(names, columns))
        if batch.seeds is not None:  # the seeded noise's input
            optional["positions"] = to_device(batch.positions, device)
        greedy_rows = bool((batch.temperatures == 0).any())
        token_ids = sampler(
            logits, temperatures, max_k=batch.max_k, greedy_rows=greedy_rows, path=path, **optional
        )
    if batch.num_logprobs is None:
        return PendingSample(token_ids)
    return PendingSample(token_ids, logprobs_of(raw, token_ids, batch.num_logprobs))


def penalized(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """(rows, vocab) the logits with the batch's penalties applied and its suppressed ids at -inf."""
    device, vocab_size = logits.device, logits.shape[1]
    if batch.penalties is not None:
        p = batch.penalties
        logits = apply_penalties(
            logits.float(),
            token_counts(p["output_ids"], vocab_size, device),
            token_counts(p["prompt_ids"], vocab_size, device) > 0,
            to_device(p["repetition"], device),
            to_device(p["presence"], device),
            to_device(p["frequency"], device),
        )
    if batch.suppress is not None:
        rows, ids = batch.suppress
        logits = logits.index_put(
            (to_device(rows, device), to_device(ids, device)),
            torch.tensor(float("-inf"), dtype=logits.dtype, device=device),
        )
    return logits


def token_counts(
    token_lists: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """(rows, vocab) float32: how often each token occurs in each row's list."""
    width = max(1, max(len(ids) for ids in token_lists))
    padded = np.full(
        (len(token_lists), width), vocab_size, np.int64
    )  # vocab_size: padding, dropped below
    for i, ids in enumerate(token_lists):
        padded[i, : len(ids)] = ids
    index = to_device(padded, device)
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    return counts.scatter_add_(1, index, torch.ones_like(index, dtype=counts.dtype))[:, :vocab_size]
