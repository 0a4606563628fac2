from collections import deque

from ..config import EngineConfig
from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


class Scheduler:
    """Continuous batching over a paged KV cache, with chunked prefill.

    Every step fills one budget of `max_num_batched_tokens` tokens. Running sequences
    come first, in admission order (one token each at decode, or the next chunk of a
    prompt still being prefilled), then waiting prompts are admitted in arrival order
    while blocks, batch slots and budget last; the last one admitted may get only a
    chunk. When decode runs out of blocks, the most recently admitted sequence is
    preempted: its blocks are freed and it goes back to the front of the queue, to be
    recomputed from its tokens (the prefix cache often still holds most of them).

    Overlap: a step counts as computed once it is launched (`launched`), so the next one
    can be scheduled while the device runs it. Each sequence it samples for has a pending
    token (counted, its id still on the device) until the engine resolves it (`resolve`); a
    sequence whose pending token ends it by length is not fed again, and one that turns
    out to stop ran one step in vain.

    The scheduler moves tokens and blocks; when a sequence is finished is the engine's
    call (`finish`)."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0  # in the current step
        self.total_preemptions = 0
        self.speculator = None  # speculative decoding: proposes tokens for decoding sequences (engine/speculator.py)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> list[Sequence]:
        """The sequences to run this step; each one's `num_scheduled_tokens` says how many tokens it feeds."""
        self.num_preemptions = 0
        if self.speculator is not None:
            self.speculator.propose(self.running)
        scheduled = self.schedule_running(self.max_num_batched_tokens)
        budget = self.max_num_batched_tokens - sum(seq.num_scheduled_tokens for seq in scheduled)
        if not self.num_preemptions:  # no admissions in a step that had to free memory
            scheduled += self.schedule_waiting(budget)
        return scheduled

    def schedule_running(self, budget: int) -> list[Sequence]:
        """In admission order: a decode token, or the next prompt chunk, while the budget lasts."""
        # This loop runs for every sequence at every step, so it asks each one's length once.
        scheduled, still_running, blocks = [], [], self.block_manager
        while self.running:
            seq = self.running.popleft()
            num_tokens = len(seq)
            if seq.spec_token_ids:  # verify proposals: slots for them too
                num_tokens += self.speculator.fit(seq, budget)
            if budget == 0 or (
                seq.num_pending and seq.reaches_length_limit(num_tokens, self.max_model_len)
            ):
                still_running.append(
                    seq
                )  # no room this step, or its last token is in flight: it keeps its blocks and waits
                continue
            missing = blocks.blocks_missing(
                seq, num_tokens
            )  # 0 unless its newest token starts a block
            while missing > 0 and missing > blocks.num_free_blocks:
                if self.running:
                    self.preempt(self.running.pop())  # the most recently admitted
                else:
                    self.preempt(seq)
                    break
            else:
                if missing > 0:
                    blocks.may_append(seq, missing)
                seq.num_scheduled_tokens = min(num_tokens - seq.num_cached_tokens, budget)
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
            leader = seq.leader
            if (
                leader is not None
                and leader.status == SequenceStatus.RUNNING
                and leader.num_cached_tokens < leader.num_prompt_tokens
            ):
                break  # a sibling waits while its leader computes the prompt, to find its blocks in the cache
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            if seq.num_completion_tokens == 0 and not seq.num_prompt_hit_tokens:
                seq.num_prompt_hit_tokens = seq.num_cached_tokens  # what the prefix cache served
            seq.num_scheduled_tokens = min(len(seq) - seq.num_cached_tokens, budget)
            budget -= seq.num_scheduled_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
            scheduled.append(seq)
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.spec_token_ids, seq.num_draft_cached = [], 0
        self.block_manager.deallocate(seq)
        seq.num_cached_tokens = 0  # its K/V are gone: recompute from the tokens
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self.total_preemptions += 1

    def launched(self, seqs: list[Sequence]) -> None:
        """The step is queued on the device: the fed tokens' K/V count as cached (their full
        blocks shareable: any step that reads them runs after this one), and each sequence whose
        feed reached its end gets a pending token (the step samples it)."""
        for seq in seqs:
            samples = seq.samples_this_step
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            seq.num_pending += samples
            self.block_manager.hash_blocks(seq, seq.num_cached_tokens)

    def resolve(self, seq: Sequence, token_id: int) -> None:
        """The step that sampled the sequence's oldest pending token is done: it is `token_id`."""
        seq.resolve(token_id)
        self.block_manager.hash_blocks(seq, seq.num_cached_tokens)  # a block that waited for it

    def finish(self, seq: Sequence, reason: str) -> None:
        """End the sequence (stopped, at its length limit, or aborted) and free its blocks."""
        if seq.is_finished:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:  # not there while its grammar compiles (structured output)
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        seq.num_pending = 0  # tokens still in flight are dropped: their steps ran in vain
        self.block_manager.deallocate(seq)
