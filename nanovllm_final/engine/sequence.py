import itertools
from enum import Enum, auto

from ..sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One completion being generated: its prompt, the tokens generated so far, how to
    sample, and where its K/V live. A request with n completions has n sequences."""

    _ids = itertools.count()

    def __init__(
        self,
        token_ids: list[int],
        params: SamplingParams,
        index: int = 0,
        leader: "Sequence | None" = None,
    ):
        self.seq_id = next(Sequence._ids)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)  # the tokens whose ids the host knows
        self.num_prompt_tokens = len(token_ids)
        self.params = params  # resolved: no None fields left but max_tokens
        self.request_id = ""  # set by its Request
        self.index = index  # which of its request's n completions
        # The sibling that computes the shared prompt first; while it does, this one waits,
        # so that it finds the prompt's blocks in the cache when admitted.
        self.leader = leader
        self.num_cached_tokens = 0  # tokens whose K/V are in the cache (only the rest are fed)
        self.num_prompt_hit_tokens = 0  # prompt tokens the prefix cache served at first admission
        self.block_table: list[
            int
        ] = []  # the physical KV blocks holding this sequence, in token order
        self.num_scheduled_tokens = 0  # tokens fed this step (a prompt may take several steps)
        self.num_hashed_blocks = 0  # leading blocks of block_table registered in the prefix cache
        self.num_prompt_scored = (
            0  # prompt positions whose logprobs a launched step computes (prompt_logprobs.py)
        )
        # Overlap scheduling: tokens sampled by steps still on the device. They follow
        # token_ids; their ids are the in-flight step's to hold (llm_engine.InFlight) until it
        # completes and `resolve` appends them.
        self.num_pending = 0
        # Speculative decoding (engine/speculator.py): this step's proposals, fed after the last
        # token; the step's outcome decides which of them become tokens.
        self.spec_token_ids: list[int] = []
        self.num_draft_cached = 0  # tokens whose K/V the draft model has (engine/draft_model.py)
        self.finish_reason: str | None = None
        self.grammar = (
            None  # structured output: its xgrammar matcher, advanced by each resolved token
        )
        self.grammar_early: bool | None = (
            None  # overlap: the matcher took the pending token already (accepted?)
        )

    def __len__(self) -> int:
        """Tokens, pending ones included: what the cache must hold and the next step may feed."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_completion_tokens(self) -> int:
        """Generated tokens, pending ones included (the index the next sampled token gets)."""
        return len(self.token_ids) + self.num_pending - self.num_prompt_tokens  # len(self) - prompt

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host knows (all but the pending ones)."""
        return len(self.token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        """The generated tokens known so far."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def samples_this_step(self) -> bool:
        """Does this step's feed reach the sequence's end (so a token is sampled)?"""
        fed = self.num_cached_tokens + self.num_scheduled_tokens
        return fed == len(self.token_ids) + self.num_pending + len(
            self.spec_token_ids
        )  # == len(self) + proposals

    def reaches_length_limit(self, num_tokens: int, max_model_len: int) -> bool:
        """Does the sequence end by length once it holds `num_tokens` tokens (max_tokens or max_model_len)?"""
        max_tokens = self.params.max_tokens
        return (
            max_tokens is not None and num_tokens - self.num_prompt_tokens >= max_tokens
        ) or num_tokens >= max_model_len

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def resolve(self, token_id: int) -> None:
        """The oldest pending token is `token_id`."""
        self.token_ids.append(token_id)
        self.num_pending -= 1
