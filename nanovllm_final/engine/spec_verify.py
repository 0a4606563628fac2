"""A verify step's sampling: the rows of each verifying sequence as the sampler sees them, the
rejection sampler queued on the device (PendingVerify), and its outcome (Verified): the
tokens each sequence emits. The warm-up step verifies too (`warmup_proposals`), so that its
peak memory covers a verify step's logits and draws."""

from dataclasses import dataclass

import numpy as np
import torch

from ..layers.sampler import Sampler, logprobs_of
from .rejection_sampler import verify
from .sampling import (
    PendingSample,
    SampledTokens,
    SamplingBatch,
    SamplingColumns,
    build_sampling_batch,
    penalized,
)
from .sequence import Sequence
from .step_input import to_device


class DraftRow:
    """A verify row as build_sampling_batch reads it: its sequence with the `i` proposals before
    the row taken as accepted (their penalties, min_tokens and output position)."""

    def __init__(self, seq: Sequence, i: int):
        self.seq, self.i = seq, i
        self.seq_id = (seq.seq_id, i)  # the row's key in SamplingColumns
        self.params, self.index, self.num_prompt_tokens = (
            seq.params,
            seq.index,
            seq.num_prompt_tokens,
        )
        self.num_completion_tokens = seq.num_completion_tokens + i

    @property
    def token_ids(self) -> list[int]:  # read only with penalties
        return self.seq.token_ids + self.seq.spec_token_ids[: self.i]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class Verified(SampledTokens):
    """SampledTokens with a row per emitted token: `seqs[i]` emits `token_ids[i]`."""

    seqs: list[Sequence] | None = None
    num_accepted: list[int] | None = None  # per verified sequence, in step order


class PendingVerify:
    """A verify step's outcome on its way to the host: `chosen` (rows,) each row's proposal if
    accepted, else its drawn token (and logprobs); `accepted` (rows,) bool, copied to the host
    before `chosen` recorded its event, or None: greedy rows, accepted where the row's argmax,
    which `chosen` holds, is the proposal (`draft_ids` (rows,), -1 on bonus rows)."""

    def __init__(
        self,
        seqs: list[Sequence],
        draft_ids: np.ndarray,
        chosen: PendingSample,
        accepted: torch.Tensor | None = None,
    ):
        self.seqs, self.draft_ids, self.chosen, self.accepted = seqs, draft_ids, chosen, accepted

    def result(self) -> Verified:
        rows = self.chosen.result()
        accepted = (
            (self.draft_ids == np.asarray(rows.token_ids)).tolist()
            if self.accepted is None
            else self.accepted.tolist()
        )
        out = Verified([], [] if rows.logprobs is not None else None, [], [])
        row = 0
        for seq in self.seqs:
            k, j = len(seq.spec_token_ids), 0
            while j < k and accepted[row + j]:
                j += 1
            out.seqs += [seq] * (j + 1)
            out.token_ids += rows.token_ids[row : row + j + 1]
            if out.logprobs is not None:
                out.logprobs += rows.logprobs[row : row + j + 1]
            out.num_accepted.append(j)
            row += k + 1
        return out


def verify_batch(
    seqs: list[Sequence], eos_token_ids: list[int], columns: SamplingColumns | None = None
) -> SamplingBatch:
    """The rows of a verify step, 1 + k per sequence in `seqs` (k: its proposals), with `drafts`:
    the sequences and each row's proposal (-1: the bonus row). `columns`: the engine's, kept while
    the same rows verify."""
    rows = [DraftRow(seq, i) for seq in seqs for i in range(len(seq.spec_token_ids) + 1)]
    batch = build_sampling_batch(rows, eos_token_ids, columns)
    draft_ids = np.fromiter(
        (x for seq in seqs for x in (*seq.spec_token_ids, -1)), np.int64, len(rows)
    )
    batch.drafts = (seqs, draft_ids)
    return batch


@torch.inference_mode()
def verify_step(sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch) -> PendingVerify:
    """`logits`: (rows, vocab), a row per row of `batch` (verify_batch's). Greedy rows emit their
    argmax whether or not it is the proposal: the draw is a decode step's, and the host compares."""
    seqs, draft_ids = batch.drafts
    accepted = None
    if batch.all_greedy:
        chosen = penalized(logits, batch).argmax(dim=-1)  # (rows,)
    else:
        on_device = to_device(draft_ids, logits.device)  # (rows,)
        accepted, drawn = verify(sampler.generator, logits, batch, on_device)
        chosen = torch.where(accepted, on_device, drawn)  # (rows,)
        accepted = accepted.to("cpu", non_blocking=True)  # before PendingSample's event
    logprobs = () if batch.num_logprobs is None else logprobs_of(logits, chosen, batch.num_logprobs)
    return PendingVerify(seqs, draft_ids, PendingSample(chosen, logprobs), accepted)


def warmup_proposals(seqs: list[Sequence], k: int) -> None:
    """Turn the last min(k, length - 1) tokens of each warm-up sequence into proposals: the step
    feeds as many tokens and samples 1 + k rows per sequence, as a verify step may."""
    for seq in seqs:
        n = min(k, len(seq.token_ids) - 1)
        if n > 0:
            seq.spec_token_ids = seq.token_ids[-n:]
            del seq.token_ids[-n:]
            seq.num_prompt_tokens -= n
