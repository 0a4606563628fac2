"""The sampling side of a step: each sampling row's parameters as arrays (rank 0 only)."""

from dataclasses import dataclass

import numpy as np

from .sequence import Sequence


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

    @property
    def all_greedy(self) -> bool:
        """Every row takes the argmax: no masks, no noise to compute."""
        return not self.temperatures.any()


def completion_seed(seed: int, index: int) -> int:
    """The seed of completion `index` of a request seeded with `seed` (its n completions differ)."""
    return (seed + index * 0x9E3779B97F4A7C15) % 2**63


def build_sampling_batch(seqs: list[Sequence], eos_token_ids: list[int]) -> SamplingBatch:
    """`seqs`: the sequences that sample this step, in row order."""
    params = [s.params for s in seqs]

    def column(name: str, dtype, off) -> np.ndarray | None:
        values = np.array([getattr(p, name) for p in params], dtype)
        return None if (values == off).all() else values

    suppress_rows, suppress_ids = [], []
    for row, (seq, p) in enumerate(zip(seqs, params)):
        if seq.num_completion_tokens < p.min_tokens:  # EOS and stop ids may not end it yet
            ids = ([] if p.ignore_eos else eos_token_ids) + p.stop_token_ids
            suppress_rows += [row] * len(ids)
            suppress_ids += ids
    penalized = any(p.has_penalties for p in params)
    asked = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingBatch(
        temperatures=np.array([p.temperature for p in params], np.float32),
        top_k=column("top_k", np.int64, 0),
        top_p=column("top_p", np.float32, 1.0),
        min_p=column("min_p", np.float32, 0.0),
        seeds=np.array([-1 if p.seed is None else completion_seed(p.seed, s.index) for s, p in zip(seqs, params)], np.int64)
        if any(p.seed is not None for p in params) else None,
        positions=np.array([s.num_completion_tokens for s in seqs], np.int64),
        penalties=None if not penalized else {
            "repetition": np.array([p.repetition_penalty for p in params], np.float32),
            "presence": np.array([p.presence_penalty for p in params], np.float32),
            "frequency": np.array([p.frequency_penalty for p in params], np.float32),
            "prompt_ids": [s.token_ids[: s.num_prompt_tokens] for s in seqs],
            "output_ids": [s.completion_token_ids for s in seqs],
        },
        suppress=(np.array(suppress_rows, np.int64), np.array(suppress_ids, np.int64)) if suppress_rows else None,
        num_logprobs=max(asked) if asked else None,
    )
