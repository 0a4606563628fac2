"""The `speculative_config` engine option, in vLLM's names:

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    {"method": "draft_model", "model": "path/to/draft", "num_speculative_tokens": 4}

A dict, or its JSON text (the `--speculative-config` flag). What depends on other options
(max_model_len) is checked by EngineConfig.validate, what depends on the target model (the
draft's vocabulary and tokenizer) when the engine starts (`check_draft`)."""

import json
import pathlib
from dataclasses import dataclass

from .model_config import ModelConfig
from .validate import Problem, is_int, show

FIELD = "speculative_config"
METHODS = ("ngram", "draft_model")
_KEYS = {
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"},
    "draft_model": {"method", "num_speculative_tokens", "model"},
}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" or "draft_model"
    num_speculative_tokens: int  # k: tokens proposed per sequence and step
    prompt_lookup_min: int = 1  # ngram: the shortest suffix looked up
    prompt_lookup_max: int = 4  # ngram: the longest suffix looked up (tried first)
    model: str | None = None  # draft_model: its checkpoint directory


def _int(value: dict, key: str, default: int | None, low: int = 1) -> int:
    got = value.get(key, default)
    if not is_int(got) or got < low:
        raise Problem(
            f"{FIELD}.{key} must be an integer >= {low}, got {show(got)}", f"{FIELD}.{key}"
        )
    return got


def parse_speculative_config(value) -> SpeculativeConfig | None:
    """A SpeculativeConfig from a dict or its JSON text (None: no speculation); a Problem naming
    the field otherwise."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise Problem(f"{FIELD} is not valid JSON: {err}", FIELD) from None
    if not isinstance(value, dict):
        raise Problem(f"{FIELD} must be a dict (or its JSON text), got {show(value)}", FIELD)
    method = value.get("method")
    if method not in METHODS:
        raise Problem(
            f"{FIELD}.method must be one of {', '.join(map(repr, METHODS))}, got {show(method)}",
            f"{FIELD}.method",
        )
    unknown = sorted(set(value) - _KEYS[method])
    if unknown:
        raise Problem(
            f"{FIELD} has keys {unknown} that method {method!r} does not take; it takes {sorted(_KEYS[method])}",
            FIELD,
        )
    k = _int(value, "num_speculative_tokens", None)
    if method == "ngram":
        low, high = _int(value, "prompt_lookup_min", 1), _int(value, "prompt_lookup_max", 4)
        if high < low:
            raise Problem(
                f"{FIELD}.prompt_lookup_max ({high}) must be >= prompt_lookup_min ({low})",
                f"{FIELD}.prompt_lookup_max",
            )
        return SpeculativeConfig(method, k, prompt_lookup_min=low, prompt_lookup_max=high)
    model = value.get("model")
    if not isinstance(model, str) or not pathlib.Path(model).is_dir():
        raise Problem(
            f"{FIELD}.model must be the draft model's checkpoint directory, got {show(model)}",
            f"{FIELD}.model",
        )
    return SpeculativeConfig(method, k, model=model)


def check_options(spec: SpeculativeConfig | None, max_model_len: int) -> None:
    """A verify step holds the last token, k proposals and room for the token it samples."""
    if spec is not None and spec.num_speculative_tokens + 2 > max_model_len:
        raise Problem(
            f"{FIELD}.num_speculative_tokens={spec.num_speculative_tokens} does not fit in max_model_len="
            f"{max_model_len}: a sequence needs a prompt token, the k proposals and the sampled token "
            f"(k <= {max_model_len - 2})",
            f"{FIELD}.num_speculative_tokens",
        )


def check_draft(spec: SpeculativeConfig | None, vocab_size: int, tokenizer) -> None:
    """The draft must share the target's vocabulary and tokenizer: its token ids are the target's."""
    if spec is None or spec.method != "draft_model":
        return
    from transformers import AutoTokenizer

    draft = ModelConfig.from_dir(spec.model)
    if draft.vocab_size != vocab_size:
        raise Problem(
            f"{FIELD}.model has vocab_size {draft.vocab_size}, the target {vocab_size}: the draft must "
            "share the target's vocabulary",
            f"{FIELD}.model",
        )
    if (
        tokenizer is not None
        and AutoTokenizer.from_pretrained(spec.model).get_vocab() != tokenizer.get_vocab()
    ):
        raise Problem(
            f"{FIELD}.model has another tokenizer than the target: the draft's token ids must be the target's",
            f"{FIELD}.model",
        )
