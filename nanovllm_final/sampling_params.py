"""How to sample one request: vLLM's names and semantics.

A field left at None takes the checkpoint's generation_config.json value when the engine
admits the request (`resolve`), else the neutral value. Every bad value is a ValueError
naming the field, raised when the object is built."""

import dataclasses
from dataclasses import dataclass

# the fields generation_config.json may set, and their neutral values
GENERATION_CONFIG_FIELDS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    n: int = 1  # completions of the prompt (they share its KV blocks through the prefix cache)
    temperature: float | None = None  # 0: greedy
    top_p: float | None = None  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int | None = None  # keep the k most likely tokens; 0 or -1: all
    min_p: float | None = None  # drop tokens below min_p times the most likely one's probability
    seed: int | None = None  # the same tokens whatever else is in the batch
    max_tokens: int | None = 64  # None: until max_model_len
    min_tokens: int = 0  # EOS and stop_token_ids are suppressed until this many tokens
    stop: str | list[str] | None = None  # strings that end the completion (not included in its text)
    stop_token_ids: list[int] | None = None  # ids that end the completion (included in token_ids)
    ignore_eos: bool = False
    logprobs: int | None = None  # k: the sampled token's logprob and the k most likely, per token
    repetition_penalty: float | None = None  # > 1 discourages tokens of the prompt and the output
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence of every token already generated

    def __post_init__(self) -> None:
        def bad(field: str, rule: str) -> ValueError:
            return ValueError(f"{field} {rule}, got {getattr(self, field)!r}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "must be a positive integer")
        if self.temperature is not None and (not _is_number(self.temperature) or self.temperature < 0):
            raise bad("temperature", "must be >= 0 (0 is greedy)")
        if self.top_p is not None and (not _is_number(self.top_p) or not 0 < self.top_p <= 1):
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < -1):
            raise bad("top_k", "must be an integer >= -1 (0 and -1 mean all tokens)")
        if self.min_p is not None and (not _is_number(self.min_p) or not 0 <= self.min_p <= 1):
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "must be an integer")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be a positive integer (or None: until max_model_len)")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of them")
        self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of token ids (integers >= 0)")
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be True or False")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", "must be an integer >= 0 (the number of top tokens to return)")
        if self.repetition_penalty is not None and (not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0):
            raise bad("repetition_penalty", "must be > 0 (1 is off)")
        for field in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, field)) or not -2 <= getattr(self, field) <= 2:
                raise bad(field, "must be in [-2, 2]")

    def resolve(self, defaults: dict) -> "SamplingParams":
        """A copy whose None fields take `defaults` (generation_config.json), else the neutral values."""
        values = {}
        for field, neutral in GENERATION_CONFIG_FIELDS.items():
            if getattr(self, field) is None:
                values[field] = defaults.get(field, neutral)
        resolved = dataclasses.replace(self, **values)
        if resolved.top_k == -1:
            resolved.top_k = 0
        return resolved

    @property
    def has_penalties(self) -> bool:
        """Does sampling look at the tokens generated so far (repetition, presence, frequency)?"""
        return self.repetition_penalty != 1 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
