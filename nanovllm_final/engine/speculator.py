"""Speculative decoding wired into the engine's steps (rejection_sampler.py has the math,
proposers.py the proposals). A step's life with speculation:

    scheduler.schedule()   propose(): each decoding sequence gets up to k proposals
                           (seq.spec_token_ids); fit(): cut to the step's token budget; the
                           sequence feeds its last token and its proposals, with slots for all
    runner.execute()       the logits of all 1 + k rows of each verifying sequence
    verify()               accept or reject each proposal on the device (PendingVerify)
    accept()               after the step: the sequence takes its accepted proposals and the
                           token drawn after them as pending tokens (the engine resolves them one
                           by one, checking stops, max_tokens and min_tokens at each), and hands
                           back the K/V slots of the rejected ones: their blocks past the new end
                           go back to the free list, and the slots left in its last block are
                           overwritten by the next step. The prefix cache hashes only full blocks
                           of known tokens, so only accepted tokens are ever hashed.

A step where no sequence has proposals samples as without speculation. Overlap scheduling is
off while speculating: a step's proposals and slots depend on how many tokens the step before
accepted, which only the host learns when that step is done."""

from dataclasses import dataclass

import numpy as np
import torch

from ..layers.sampler import Sampler, logprobs_of
from ..config import EngineConfig
from ..speculative_config import SpeculativeConfig
from .block_manager import BlockManager
from .draft_model import DraftModelProposer
from .proposers import NgramProposer
from .rejection_sampler import verify
from .sampling import PendingSample, SampledTokens, build_sampling_batch
from .sequence import Sequence
from .step_input import to_device


class DraftRow:
    """A verify row as build_sampling_batch reads it: its sequence with the `i` proposals before
    the row taken as accepted (their penalties, min_tokens and output position)."""

    def __init__(self, seq: Sequence, i: int):
        self.seq, self.i = seq, i
        self.params, self.index, self.num_prompt_tokens = seq.params, seq.index, seq.num_prompt_tokens
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
        self.chosen = chosen  # (rows,) each row's proposal if accepted, else its drawn token; and logprobs

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


class Speculator:
    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, num_blocks: int):
        self.k, self.max_model_len, self.max_num_seqs = (
            spec.num_speculative_tokens,
            config.max_model_len,
            config.max_num_seqs,
        )
        if spec.method == "ngram":
            self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        else:  # one device: EngineConfig refuses it with tensor parallelism
            self.proposer = DraftModelProposer(config, spec.model, num_blocks)
        # a draft model proposes once the scheduler has given the proposals their slots (fill)
        self.after_schedule = spec.method == "draft_model"
        self.room = 0  # proposals the current step may still take
        self.reset()

    def reset(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k  # how often proposal i (0-based) was accepted

    # ---- scheduling ----

    def propose(self, running: list[Sequence], num_waiting: int) -> None:
        """Proposals for every running sequence that decodes (its one unfed token known), as
        many as its length limits leave room for. A step samples at most max_num_seqs rows (the
        warm-up step's, whose peak memory it measured): the proposals share what the running
        and the admissible waiting sequences leave of them."""
        self.room = max(0, self.max_num_seqs - len(running) - num_waiting)
        ready, ks = [], []
        for seq in running:
            seq.spec_token_ids = []
            num_tokens = len(seq)
            if seq.num_pending or num_tokens - seq.num_cached_tokens != 1:
                continue
            k = min(self.k, self.max_model_len - num_tokens - 1)
            if seq.params.max_tokens is not None:
                k = min(k, seq.params.max_tokens - seq.num_completion_tokens - 1)
            if k > 0 and self.room:
                ready.append(seq)
                ks.append(k)
        proposals = [[-1] * k for k in ks] if self.after_schedule else self.proposer.propose(ready, ks)
        for seq, ids in zip(ready, proposals):
            seq.spec_token_ids = ids

    def fill(self, seqs: list[Sequence]) -> None:
        """A draft model's proposals for the scheduled sequences, as many as their slots hold."""
        if self.after_schedule:
            drafting = [seq for seq in seqs if seq.spec_token_ids]
            for seq, ids in zip(
                drafting, self.proposer.propose(drafting, [len(s.spec_token_ids) for s in drafting])
            ):
                seq.spec_token_ids = ids

    def fit(self, seq: Sequence, budget: int) -> int:
        """Cut the sequence's proposals to the step's token budget and row room; how many it keeps."""
        keep = max(0, min(len(seq.spec_token_ids), budget - 1, self.room))
        del seq.spec_token_ids[keep:]
        self.room -= keep
        return keep

    # ---- verifying ----

    @staticmethod
    def drafted(seqs: list[Sequence]) -> bool:
        return any(seq.spec_token_ids for seq in seqs)

    def verify(
        self, sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: list[int]
    ) -> PendingVerify:
        """`logits`: (rows, vocab), 1 + k rows per sequence in `seqs` (k: its proposals)."""
        rows = [DraftRow(seq, i) for seq in seqs for i in range(len(seq.spec_token_ids) + 1)]
        batch = build_sampling_batch(rows, eos_token_ids)
        draft_ids = np.fromiter((x for seq in seqs for x in (*seq.spec_token_ids, -1)), np.int64, len(rows))
        draft_ids = to_device(draft_ids, logits.device)  # (rows,)
        accepted, drawn = verify(sampler.generator, logits, batch, draft_ids)
        chosen = torch.where(accepted, draft_ids, drawn)  # (rows,)
        logprobs = () if batch.num_logprobs is None else logprobs_of(logits, chosen, batch.num_logprobs)
        return PendingVerify(seqs, accepted, PendingSample(chosen, logprobs))

    def accept(self, verified: Verified, seqs: list[Sequence], block_manager: BlockManager) -> bool:
        """The step is done: each sequence's accepted proposals and drawn token become its pending
        tokens, the K/V of the rejected ones is dropped. True if a block table shrank."""
        shrank = False
        for seq, j in zip(seqs, verified.num_accepted):
            k = len(seq.spec_token_ids)
            if k:
                self.num_drafts += 1
                self.num_draft_tokens += k
                self.num_accepted_tokens += j
                for i in range(j):
                    self.accepted_per_pos[i] += 1
            seq.spec_token_ids = []
            if seq.is_finished:
                continue
            if k:  # a draft model fed the last token and the first k - 1 proposals
                seq.num_draft_cached = len(seq.token_ids) + min(j, k - 1)
            seq.num_cached_tokens = len(seq.token_ids) + j  # the fed token and the accepted proposals
            seq.num_pending = j + 1
            shrank |= block_manager.trim(seq, len(seq))
        return shrank

    def shutdown(self) -> None:
        if self.after_schedule:
            self.proposer.shutdown()

    def summary(self) -> dict:
        drafts, drafted = self.num_drafts, self.num_draft_tokens
        return {
            "spec_decode_num_drafts": drafts,  # verifications of a sequence with proposals
            "spec_decode_num_draft_tokens": drafted,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "spec_decode_acceptance_rate": self.num_accepted_tokens / drafted if drafted else 0.0,
            # tokens a verification emits on average: its accepted proposals and the drawn one
            "spec_decode_mean_acceptance_length": 1 + self.num_accepted_tokens / drafts if drafts else 0.0,
        }
