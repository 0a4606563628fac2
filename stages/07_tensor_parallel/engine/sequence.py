import itertools
from enum import Enum, auto

from ..sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request: its prompt, the tokens generated so far, and how to sample."""

    _ids = itertools.count()

    def __init__(self, token_ids: list[int], params: SamplingParams):
        self.seq_id = next(Sequence._ids)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.temperature = params.temperature
        self.max_tokens = params.max_tokens
        self.ignore_eos = params.ignore_eos
        # how many of its tokens already have their K/V in the cache (only the rest are fed)
        self.num_cached_tokens = 0
        # the physical KV blocks holding this sequence, in token order
        self.block_table: list[int] = []
        # tokens fed this step (a prompt may take several steps)
        self.num_scheduled_tokens = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
