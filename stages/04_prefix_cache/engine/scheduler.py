from collections import deque

from ..config import EngineConfig
from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


class Scheduler:
    """Continuous batching over a paged KV cache.

    Requests join as soon as there is room, not when a whole batch
    ends. Each step is either a prefill of newly admitted prompts (preferred) or a
    decode of every running sequence. When decode runs out of blocks, the most
    recently admitted sequence is preempted: its blocks are freed and it goes back to
    the front of the queue, to be recomputed from its tokens later."""

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

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The sequences to run this step, and whether it is a prefill step."""
        self.num_preemptions = 0
        scheduled = self.schedule_prefill()
        if scheduled:
            return scheduled, True
        return self.schedule_decode(), False

    def schedule_prefill(self) -> list[Sequence]:
        """Admit waiting prompts in arrival order while sequences, tokens and blocks allow.
        A prompt longer than the token budget still runs when it is alone in its step."""
        scheduled, num_tokens = [], 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if (
                scheduled and num_tokens + len(seq) > self.max_num_batched_tokens
            ) or not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            num_tokens += len(seq) - seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
            scheduled.append(seq)
        return scheduled

    def schedule_decode(self) -> list[Sequence]:
        """Every running sequence decodes one token; make room by preempting if needed."""
        scheduled = []
        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())  # the most recently admitted
                else:
                    self.preempt(seq)
                    break
            else:
                self.block_manager.may_append(seq)
                scheduled.append(seq)
        self.running.extend(scheduled)
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        seq.num_cached_tokens = 0  # its K/V are gone: recompute from the tokens
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """Append each sampled token; return the sequences that just finished (their blocks are freed)."""
        finished = []
        for seq, token_id in zip(seqs, token_ids):
            self.block_manager.hash_blocks(seq, len(seq))  # NEW in 04_prefix_cache: now shareable
            seq.num_cached_tokens = len(seq)  # the step wrote K/V for every token so far
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
