"""A checkpoint's config.json and generation_config.json values that the engine computes with,
checked before it does: a bad one is a ValueError naming the file and the field. A checkpoint's
sampling defaults must pass SamplingParams' checks and its EOS ids must be in the vocabulary,
or the checkpoint is refused (not silently changed)."""

from .dtypes import parse_dtype
from .sampling_params import GENERATION_CONFIG_FIELDS, SamplingParams
from .validate import INT32_MAX, is_int, is_number

SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)


def bad(file: str, key: str, rule: str, value) -> ValueError:
    return ValueError(f"{file}: {key} must be {rule}, got {value!r}")


def check_checkpoint(raw: dict, generation_config: dict) -> None:
    """config.json's fields (`raw`) and generation_config.json's, each check in its function."""
    check_sizes(raw)
    check_rope_and_norm(raw)
    check_flags(raw)
    check_dtype_and_architectures(raw)
    for file, source in (("config.json", raw), ("generation_config.json", generation_config)):
        check_eos_ids(file, source, raw.get("vocab_size"))
    check_sampling_defaults(generation_config)


def check_sizes(raw: dict) -> None:
    """Every size a positive integer (the required ones that are missing: ModelConfig.from_dict
    says so), and the query heads a multiple of the KV heads."""
    for key in SIZES:
        if raw.get(key) is not None and not (is_int(raw[key]) and 1 <= raw[key] <= INT32_MAX):
            raise bad("config.json", key, "a positive integer", raw[key])
    heads, kv_heads = raw.get("num_attention_heads"), raw.get("num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        raise bad(
            "config.json",
            "num_attention_heads",
            f"a multiple of num_key_value_heads ({kv_heads})",
            heads,
        )


def check_rope_and_norm(raw: dict) -> None:
    """The norm's epsilon and RoPE's base positive numbers; RoPE's parameters objects."""
    rope = raw.get("rope_parameters")
    for key, value in (
        ("rms_norm_eps", raw.get("rms_norm_eps")),
        ("rope_theta", raw.get("rope_theta")),
        ("rope_parameters.rope_theta", rope.get("rope_theta") if isinstance(rope, dict) else None),
    ):
        if value is not None and not (is_number(value) and value > 0):
            raise bad("config.json", key, "a positive number", value)
    for key in ("rope_scaling", "rope_parameters"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise bad("config.json", key, "an object or null", raw[key])


def check_flags(raw: dict) -> None:
    for key in ("tie_word_embeddings", "attention_bias", "use_sliding_window"):
        if raw.get(key) is not None and not isinstance(raw[key], bool):
            raise bad("config.json", key, "true or false", raw[key])


def check_dtype_and_architectures(raw: dict) -> None:
    try:
        parse_dtype(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
    except ValueError as err:
        raise ValueError(f"config.json: torch_dtype: {err}") from None
    archs = raw.get("architectures")
    if archs is not None and not (
        isinstance(archs, list) and all(isinstance(a, str) for a in archs)
    ):
        raise bad("config.json", "architectures", "a list of class names", archs)


def check_eos_ids(file: str, source: dict, vocab: int | None) -> None:
    """`source`'s eos_token_id: a token id, or a list of them, in the vocabulary."""
    ids = source.get("eos_token_id")
    ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
    if vocab is not None and not all(is_int(i) and 0 <= i < vocab for i in ids):
        raise bad(
            file,
            "eos_token_id",
            f"a token id (or a list of them) in the vocabulary [0, {vocab})",
            source["eos_token_id"],
        )


def check_sampling_defaults(generation_config: dict) -> None:
    """Each sampling default of generation_config.json passes SamplingParams' checks."""
    for key in GENERATION_CONFIG_FIELDS:
        if generation_config.get(key) is not None:
            try:
                SamplingParams(**{key: generation_config[key]})
            except ValueError as err:
                raise ValueError(f"generation_config.json: {err}") from None
