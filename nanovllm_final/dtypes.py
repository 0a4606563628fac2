"""The dtypes an engine computes and caches in, by name."""

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KV_CACHE_DTYPES = (
    "auto",
    "fp8",
    "fp8_e4m3",
)  # vLLM's names: fp8 is e4m3 (values up to +-448, 3 mantissa bits)


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in _DTYPES.values():
        return value
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"{value!r} is not a supported dtype; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def kv_cache_torch_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """What the KV cache stores: "auto" is the model's `dtype`, "fp8"/"fp8_e4m3" float8 e4m3."""
    return dtype if kv_cache_dtype == "auto" else torch.float8_e4m3fn
