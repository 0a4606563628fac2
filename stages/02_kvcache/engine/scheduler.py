from collections import deque

from ..config import EngineConfig
from .sequence import Sequence, SequenceStatus


class Scheduler:
    """Static batching: take up to `max_num_seqs` waiting requests, run them until
    every one has finished, and only then admit the next batch.

    NEW in 02_kvcache: each admitted sequence is given a cache row; the batch's first
    step is a prefill (whole prompts), every later step a decode (one token each).
    A finished sequence keeps its row until the whole batch is done."""

    def __init__(self, config: EngineConfig, eos_token_ids: list[int]):
        self.max_num_seqs = config.max_num_seqs
        self.max_model_len = config.max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> list[Sequence]:
        """The sequences to run this step."""
        if not any(not seq.is_finished for seq in self.running):
            self.running = []
            while self.waiting and len(self.running) < self.max_num_seqs:
                seq = self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                seq.cache_row = len(self.running)
                self.running.append(seq)
        return [seq for seq in self.running if not seq.is_finished]

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """Append each sampled token; return the sequences that just finished."""
        finished = []
        for seq, token_id in zip(seqs, token_ids):
            seq.num_cached_tokens = len(seq)  # the step wrote K/V for every token so far
            seq.append_token(token_id)
            if self.should_stop(seq, token_id):
                seq.status = SequenceStatus.FINISHED
                finished.append(seq)
        if all(seq.is_finished for seq in self.running):
            self.running = []
        return finished

    def should_stop(self, seq: Sequence, token_id: int) -> bool:
        return (
            (not seq.ignore_eos and token_id in self.eos_token_ids)
            or seq.num_completion_tokens >= seq.max_tokens
            or len(seq) >= self.max_model_len
        )
