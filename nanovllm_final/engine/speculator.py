"""Speculative decoding wired into the engine's steps (rejection_sampler.py has the math,
proposers.py the proposals). A step's life with speculation:

    scheduler.schedule()   propose(): each decoding sequence gets up to k proposals
                           (seq.spec_token_ids); fit(): cut to the step's token budget; the
                           sequence feeds its last token and its proposals, with slots for all
    runner.execute()       the logits of all 1 + k rows of each verifying sequence
    runner.sample()        accept or reject each proposal on the device (PendingVerify); greedy
                           rows draw their argmax alone, and the host keeps the proposals equal to it
    accept()               after the step: the sequence takes its accepted proposals and the
                           token drawn after them as pending tokens (the engine resolves them one
                           by one, checking stops, max_tokens and min_tokens at each), and hands
                           back the K/V slots of the rejected ones: their blocks past the new end
                           go back to the free list, and the slots left in its last block are
                           overwritten by the next step. The prefix cache hashes only full blocks
                           of known tokens, so only accepted tokens are ever hashed.

A step where no sequence has proposals samples as without speculation. Overlap scheduling
and speculation take turns: a step's proposals and slots depend on how many tokens the step
before accepted, which only the host learns when that step is done, so a step that verifies,
or after which the proposer looks again, is completed before the next is scheduled. A look
that finds nothing to propose for any decoding sequence (n-gram lookup with no match) rests
the proposer for 1, 2, 4, ... up to MAX_REST steps, which run overlapped. So does a verify step
after which the accepted proposals per verifying sequence, averaged over the recent verify steps
(ACCEPTED_WEIGHT for the newest), fall below MIN_ACCEPTED: verifying costs more than a decode
step and gives up the overlap, which proposals that are mostly wrong do not win back. A verify
step that keeps the average at MIN_ACCEPTED or above ends the dry spell. The average and the
rest are the engine's, over every running sequence; a request that arrives at an idle engine
starts them afresh.
Without overlap scheduling the proposer looks at every step."""

from ..config import EngineConfig
from ..speculative_config import SpeculativeConfig
from .block_manager import BlockManager
from .draft_model import DraftModelProposer
from .proposers import NgramProposer
from .sequence import Sequence
from .spec_verify import Verified

MAX_REST = 16  # the longest rest after dry looks: 1/17 of the steps pay for looking again
MIN_ACCEPTED = 0.5  # accepted proposals per verifying sequence, on average, that keep looking
ACCEPTED_WEIGHT = 0.25  # the newest verify step's weight in that average


class Speculator:
    """The engine's speculative decoding: a proposer, the verify step's sampling, the rollback,
    and the counters of llm.metrics()."""

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, num_blocks: int):
        self.k, self.max_model_len = spec.num_speculative_tokens, config.max_model_len
        if spec.method == "ngram":
            self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        else:  # one device: EngineConfig refuses it with tensor parallelism
            self.proposer = DraftModelProposer(config, spec.model, num_blocks)
        # a draft model proposes once the scheduler has given the proposals their slots (fill)
        self.after_schedule = spec.method == "draft_model"
        self.rests = config.overlap_scheduling  # dry spells run overlapped
        self.idle()
        self.reset()

    def idle(self) -> None:
        """A request arrives at an idle engine: it looks at once, judged on its own acceptance."""
        self.resting = 0  # steps left in the current rest
        self.dry = 0  # looks in a row that proposed nothing or verified too little
        self.accepted = 1.0  # accepted proposals per verifying sequence, recent verify steps

    def reset(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k  # how often proposal i (0-based) was accepted

    # ---- scheduling ----

    def propose(self, running: list[Sequence]) -> None:
        """Proposals for every running sequence that decodes (its one unfed token known), as
        many as its length limits leave room for; none while resting."""
        if self.resting:
            self.resting -= 1
            return
        ready, ks = [], []
        for seq in running:
            seq.spec_token_ids = []
            num_tokens = len(seq)
            if seq.num_pending or num_tokens - seq.num_cached_tokens != 1:
                continue
            k = min(self.k, self.max_model_len - num_tokens - 1)
            if seq.params.max_tokens is not None:
                k = min(k, seq.params.max_tokens - seq.num_completion_tokens - 1)
            if k > 0:
                ready.append(seq)
                ks.append(k)
        proposals = (
            [[-1] * k for k in ks] if self.after_schedule else self.proposer.propose(ready, ks)
        )
        for seq, ids in zip(ready, proposals):
            seq.spec_token_ids = ids
        if ready and not any(proposals):
            self._dry_look()

    def _dry_look(self) -> None:
        """A look that won nothing: with overlap, the proposer rests 1, 2, 4, ... steps."""
        self.dry += 1
        if self.rests:
            self.resting = min(2 ** (self.dry - 1), MAX_REST)

    @property
    def needs_tokens(self) -> bool:
        """Whether the next schedule needs this step's tokens on the host: the proposer looks
        again (a step verifies only after a look that proposed, which starts no rest)."""
        return not self.resting

    def fill(self, seqs: list[Sequence]) -> None:
        """A draft model's proposals for the scheduled sequences, as many as their slots hold."""
        if self.after_schedule:
            drafting = [seq for seq in seqs if seq.spec_token_ids]
            proposals = self.proposer.propose(
                drafting, [len(seq.spec_token_ids) for seq in drafting]
            )
            for seq, ids in zip(drafting, proposals):
                seq.spec_token_ids = ids

    def fit(self, seq: Sequence, budget: int) -> int:
        """Cut the sequence's proposals to the step's token budget; how many it keeps."""
        keep = max(0, min(len(seq.spec_token_ids), budget - 1))
        del seq.spec_token_ids[keep:]
        return keep

    # ---- verifying ----

    @staticmethod
    def drafted(seqs: list[Sequence]) -> bool:
        return any(seq.spec_token_ids for seq in seqs)

    def accept(self, verified: Verified, seqs: list[Sequence], block_manager: BlockManager) -> bool:
        """The step is done: each sequence's accepted proposals and drawn token become its pending
        tokens, the K/V of the rejected ones is dropped. True if a block table shrank."""
        shrank, drafts, accepted = False, self.num_drafts, self.num_accepted_tokens
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
            seq.num_cached_tokens = (
                len(seq.token_ids) + j
            )  # the fed token and the accepted proposals
            seq.num_pending = j + 1
            shrank |= block_manager.trim(seq, len(seq))
        if self.num_drafts > drafts:
            per_seq = (self.num_accepted_tokens - accepted) / (self.num_drafts - drafts)
            self.accepted += ACCEPTED_WEIGHT * (per_seq - self.accepted)
            if self.accepted < MIN_ACCEPTED:
                self._dry_look()
            else:
                self.dry = 0
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
            "spec_decode_mean_acceptance_length": 1 + self.num_accepted_tokens / drafts
            if drafts
            else 0.0,
        }
