"""How to sample one request: vLLM's names and semantics.

A field left at None takes the checkpoint's generation_config.json value when the engine
admits the request (`resolve`), else the neutral value. Every value is checked when it is
set (at construction or later), against what its field says (validate.py): a bad one is a
`Problem`, a ValueError naming the field. The rules beyond vLLM's, so that no value can
break a step: integers fit int64, floats are finite, a bool is not a number; n is at most
MAX_N; temperature stays in [0, 1e6] and repetition_penalty in [1e-6, 1e6], where float32
probabilities and logits keep their meaning; top_p takes (0, 1], as vLLM does (the sampler
floors it where float32 needs it: engine/sampling.py); an empty stop
string is refused (as vLLM does; [] or None: no stop strings); top_k beyond the
vocabulary keeps every token (like 0). Token ids and logprobs are checked against the
model's vocabulary when the request is queued (`validate_request`)."""

import copy
from dataclasses import dataclass

from .structured_outputs import StructuredOutputsParams, to_structured
from .validate import INT64_MAX, INT64_MIN, Checked, Problem, option

MAX_N = 128  # completions per request (OpenAI's limit): each is a sequence the scheduler runs like a request of its own
# the fields generation_config.json may set, and their neutral values
GENERATION_CONFIG_FIELDS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


def _strings(value):
    """stop: one string, a list of them, or None (no stop strings)."""
    return (
        [value]
        if isinstance(value, str)
        else []
        if value is None
        else list(value)
        if isinstance(value, tuple)
        else value
    )


def _ids(value):
    return [] if value is None else list(value) if isinstance(value, tuple) else value


@dataclass
class SamplingParams(Checked):
    n: int = option(
        1,
        f"completions per prompt, at most {MAX_N} (they share the prompt's KV blocks)",
        low=1,
        high=MAX_N,
    )
    temperature: float | None = option(
        None, "0 is greedy; unset: generation_config.json's, else 1.0", float, low=0, high=1e6
    )
    top_p: float | None = option(
        None,
        "nucleus: keep the most likely tokens up to this probability mass (a tiny one: "
        "the most likely token only)",
        float,
        low=0,
        low_open=True,
        high=1,
    )
    top_k: int | None = option(
        None,
        "keep the k most likely tokens (0, -1, or more than the vocabulary: all)",
        int,
        low=-1,
        high=INT64_MAX,
    )
    min_p: float | None = option(
        None,
        "drop tokens below min_p times the most likely token's probability",
        float,
        low=0,
        high=1,
    )
    seed: int | None = option(
        None,
        "this request's random seed (the same tokens whatever else runs)",
        int,
        low=INT64_MIN,
        high=INT64_MAX,
    )
    max_tokens: int | None = option(
        64,
        "most tokens to generate per completion (None: until max_model_len)",
        low=1,
        high=INT64_MAX,
        optional=True,
    )
    min_tokens: int = option(
        0, "suppress EOS and stop ids until this many tokens", low=0, high=INT64_MAX
    )
    stop: str | list[str] | None = option(
        None,
        "a string that ends the completion, not included in its text (repeat for several)",
        list,
        items=str,
        optional=False,
        convert=_strings,
        rule="a non-empty string or a list of them",
    )
    stop_token_ids: list[int] | None = option(
        None,
        "a token id that ends the completion, included in its token_ids (repeat for several)",
        list,
        items=int,
        low=0,
        high=INT64_MAX,
        optional=False,
        convert=_ids,
    )
    ignore_eos: bool = option(False, "keep going past EOS tokens")
    logprobs: int | None = option(
        None,
        "return the log-probabilities of the sampled token and the k most likely, per token",
        int,
        low=0,
        high=INT64_MAX,
    )
    prompt_logprobs: int | None = option(
        None,
        "return each prompt token's log-probability given the ones before it "
        "and the k most likely, per position (the first: None)",
        int,
        low=0,
        high=INT64_MAX,
    )
    repetition_penalty: float | None = option(
        None,
        "> 1 discourages tokens of the prompt and the output (1: off)",
        float,
        low=1e-6,
        high=1e6,
    )
    presence_penalty: float = option(
        0.0, "subtracted once from every token already generated", float, low=-2, high=2
    )
    frequency_penalty: float = option(
        0.0, "subtracted per occurrence of every token already generated", float, low=-2, high=2
    )
    structured_outputs: StructuredOutputsParams | None = option(
        None,
        "what the output must match: one of json (a schema), json_object, regex, choice, grammar (EBNF)",
        convert=to_structured,
        rule="a StructuredOutputsParams or a dict with one of its fields",
    )

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise Problem(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                "min_tokens",
            )

    def resolve(self, defaults: dict, vocab_size: int | None = None) -> "SamplingParams":
        """A copy whose None fields take `defaults` (generation_config.json, checked when the
        model was loaded), else the neutral values; top_k -1 or beyond `vocab_size` becomes 0 (all)."""
        values = {"stop": list(self.stop), "stop_token_ids": list(self.stop_token_ids)}
        values |= {
            field: defaults.get(field, neutral)
            for field, neutral in GENERATION_CONFIG_FIELDS.items()
            if getattr(self, field) is None
        }
        resolved = copy.copy(self)
        resolved.__dict__.update(
            values
        )  # every value was checked when it was set: nothing to check again
        if resolved.top_k == -1 or (vocab_size is not None and resolved.top_k >= vocab_size):
            resolved.__dict__["top_k"] = 0
        return resolved

    @property
    def has_penalties(self) -> bool:
        """Does sampling look at the tokens generated so far (repetition, presence, frequency)?"""
        return (
            self.repetition_penalty != 1
            or bool(self.presence_penalty)
            or bool(self.frequency_penalty)
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
