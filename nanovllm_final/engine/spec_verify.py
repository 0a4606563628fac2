"""A verify step's sampling: the rows of each verifying sequence as the sampler sees them, the
rejection sampler queued on the device (PendingVerify), and its outcome (Verified): the
tokens each sequence emits. The warm-up step verifies too (`warmup_proposals`), so that its
peak memory covers a verify step's logits and draws."""

from dataclasses import dataclass

import numpy as np
import torch

from ..layers.sampler import Sampler, logprobs_of
from .rejection_sampler import verify
from .sampling import PendingSample, SampledTokens, SamplingBatch, build_sampling_batch
from .sequence import Sequence
from .step_input import to_device


class DraftRow:
    """A verify row as build_sampling_batch reads it: its sequence with the `i` proposals before
    the row taken as accepted (their penalties, min_tokens and output position)."""

    def __init__(self, seq: Sequence, i: int):
        self.seq, self.i = seq, i
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
    """A verify step's outcome on its way to the host."""

    def __init__(self, seqs: list[Sequence], accepted: torch.Tensor, chosen: PendingSample):
        self.seqs = seqs
        self.accepted = accepted.to("cpu", non_blocking=True)  # before `chosen` records its event
        self.chosen = (
            chosen  # (rows,) each row's proposal if accepted, else its drawn token; and logprobs
        )

    def result(self) -> Verified:
        rows, accepted = self.chosen.result(), self.accepted.tolist()
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


def verify_batch(seqs: list[Sequence], eos_token_ids: list[int]) -> SamplingBatch:
    """The rows of a verify step, 1 + k per sequence in `seqs` (k: its proposals), with `drafts`:
    the sequences and each row's proposal (-1: the bonus row)."""
    rows = [DraftRow(seq, i) for seq in seqs for i in range(len(seq.spec_token_ids) + 1)]
    batch = build_sampling_batch(rows, eos_token_ids)
    draft_ids = np.fromiter(
        (x for seq in seqs for x in (*seq.spec_token_ids, -1)), np.int64, len(rows)
    )
    batch.drafts = (seqs, draft_ids)
    return batch


@torch.inference_mode()
def verify_step(sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch) -> PendingVerify:
    """`logits`: (rows, vocab), a row per row of `batch` (verify_batch's)."""
    seqs, draft_ids = batch.drafts
    draft_ids = to_device(draft_ids, logits.device)  # (rows,)
    accepted, drawn = verify(sampler.generator, logits, batch, draft_ids)
    chosen = torch.where(accepted, draft_ids, drawn)  # (rows,)
    logprobs = () if batch.num_logprobs is None else logprobs_of(logits, chosen, batch.num_logprobs)
    return PendingVerify(seqs, accepted, PendingSample(chosen, logprobs))


def warmup_proposals(seqs: list[Sequence], k: int) -> None:
    """Turn the last min(k, length - 1) tokens of each warm-up sequence into proposals: the step
    feeds as many tokens and samples 1 + k rows per sequence, as a verify step may."""
    for seq in seqs:
        n = min(k, len(seq.token_ids) - 1)
        if n > 0:
            seq.spec_token_ids = seq.token_ids[-n:]
            del seq.token_ids[-n:]
            seq.num_prompt_tokens -= n
