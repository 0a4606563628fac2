from collections import deque

from ..config import EngineConfig
from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


class Scheduler:
    """Continuous batching over a paged KV cache, with chunked prefill.

    Requests join as soon as there is room. When decode runs out of blocks, the most
    recently admitted sequence is preempted: its blocks are freed and it goes back to
    the front of the queue, to be recomputed from its tokens later.

    Every step fills one budget of `max_num_batched_tokens`
    tokens. Running sequences come first (one token each for decode, or the next chunk
    of a prompt that is still being prefilled), then chunks of waiting prompts. A
    prompt longer than what is left of the budget is split across steps, so no step is
    longer than the budget and decoding sequences never stall behind a long prompt."""

    def __init__(self, config: EngineConfig, eos_token_ids: list[int], block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0  # in the current step, for stats

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> list[Sequence]:
        """The sequences to run this step; each one's `num_scheduled_tokens` says how many tokens it feeds."""
        self.num_preemptions = 0
        scheduled = self.schedule_running(self.max_num_batched_tokens)
        budget = self.max_num_batched_tokens - sum(seq.num_scheduled_tokens for seq in scheduled)
        if not self.num_preemptions:  # no admissions in a step that had to free memory
            scheduled += self.schedule_waiting(budget)
        return scheduled

    def schedule_running(self, budget: int) -> list[Sequence]:
        """In admission order: a decode token, or the next prompt chunk, while the budget lasts."""
        scheduled, still_running = [], []
        while self.running:
            seq = self.running.popleft()
            if budget == 0:
                still_running.append(seq)  # no room this step; it keeps its blocks and waits
                continue
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())  # the most recently admitted
                else:
                    self.preempt(seq)
                    break
            else:
                self.block_manager.may_append(seq)
                seq.num_scheduled_tokens = min(len(seq) - seq.num_cached_tokens, budget)
                budget -= seq.num_scheduled_tokens
                scheduled.append(seq)
                still_running.append(seq)
        self.running.extend(still_running)
        return scheduled

    def schedule_waiting(self, budget: int) -> list[Sequence]:
        """Admit waiting prompts in arrival order; the last one admitted may get only a chunk."""
        scheduled = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            seq.num_scheduled_tokens = min(len(seq) - seq.num_cached_tokens, budget)
            budget -= seq.num_scheduled_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
            scheduled.append(seq)
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        seq.num_cached_tokens = 0  # its K/V are gone: recompute from the tokens
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence], token_ids: list[int | None]) -> list[Sequence]:
        """Append each sampled token; return the sequences that just finished (their blocks are freed)."""
        finished = []
        for seq, token_id in zip(seqs, token_ids):
            num_tokens = seq.num_cached_tokens + seq.num_scheduled_tokens  # K/V in the cache now
            self.block_manager.hash_blocks(seq, num_tokens)  # now shareable
            seq.num_cached_tokens = num_tokens
            if num_tokens < len(seq):
                continue  # a prompt chunk; nothing is sampled yet
            seq.append_token(token_id)
            if self.should_stop(seq, token_id):
                seq.status = SequenceStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished

    def should_stop(self, seq: Sequence, token_id: int) -> bool:
        return (
            (not seq.ignore_eos and token_id in self.eos_token_ids)
            or seq.num_completion_tokens >= seq.max_tokens
            or len(seq) >= self.max_model_len
        )
