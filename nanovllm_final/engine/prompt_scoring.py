"""Which rows of a step score prompt positions (prompt_logprobs.py computes them). Built on
rank 0 with the step's inputs, sent with them to every rank."""

from dataclasses import dataclass

import numpy as np

from .sequence import Sequence


@dataclass
class PromptScoring:
    """The rows of a step whose next prompt token is scored (sent to every rank)."""

    rows: np.ndarray  # (scored,) int64: index of the row in the step's tokens
    targets: np.ndarray  # (scored,) int64: the prompt token that row predicts
    num_top: int  # the most `prompt_logprobs` of the scored sequences
    owners: list[int]  # index in the step's sequences of each scored sequence, in row order
    counts: list[int]  # rows of each of them


def needs_prompt_scores(seq: Sequence) -> bool:
    """Are some of this sequence's prompt positions still to be scored? (Only a request's first
    completion scores; its siblings share the prompt.)"""
    asks = seq.params.prompt_logprobs is not None and seq.index == 0
    return asks and seq.num_prompt_scored < seq.num_prompt_tokens - 1


def plan_scoring(
    seqs: list[Sequence], starts: np.ndarray, ends: np.ndarray, cu: np.ndarray
) -> PromptScoring | None:
    """The rows to score in a step that feeds sequence i's positions [starts[i], ends[i]) at
    rows cu[i]..; None when no sequence asks."""
    rows, targets, owners, counts, num_top = [], [], [], [], 0
    for i, seq in enumerate(seqs):
        if not needs_prompt_scores(seq):
            continue
        first, last = (
            max(int(starts[i]), seq.num_prompt_scored),
            min(int(ends[i]), seq.num_prompt_tokens - 1),
        )
        if first >= last:
            continue
        rows.append(np.arange(first, last) - starts[i] + cu[i])
        targets.append(np.asarray(seq.token_ids[first + 1 : last + 1], np.int64))
        owners.append(i)
        counts.append(last - first)
        num_top = max(num_top, seq.params.prompt_logprobs)
    if not owners:
        return None
    return PromptScoring(
        np.concatenate(rows).astype(np.int64), np.concatenate(targets), num_top, owners, counts
    )


def mark_launched(scoring: PromptScoring | None, seqs: list[Sequence]) -> None:
    """The step is queued: its scored positions are not scored again."""
    if scoring is not None:
        for i, count in zip(scoring.owners, scoring.counts):
            seqs[i].num_prompt_scored += count
