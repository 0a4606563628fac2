"""Model construction: the architectures we support, keyed by config.json's `architectures`."""

from dataclasses import dataclass

import torch

from ..model_config import ModelConfig
from .transformer import CausalLM


@dataclass(frozen=True)
class Architecture:
    """How one family departs from the plain pre-norm decoder of transformer.py."""

    qk_norm: bool = False  # RMSNorm on each head of q and k (Qwen3)
    qkv_bias: bool | None = None  # bias on q, k, v; None: config.json's attention_bias
    o_bias: bool | None = None  # bias on o_proj; None: config.json's attention_bias


ARCHITECTURES = {
    "Qwen3ForCausalLM": Architecture(qk_norm=True),
    "LlamaForCausalLM": Architecture(),
    "Qwen2ForCausalLM": Architecture(qkv_bias=True, o_bias=False),  # Qwen2 and Qwen2.5
    "Qwen3MoeForCausalLM": Architecture(qk_norm=True),  # experts where config.json says (SparseMoeBlock)
}


def check_architecture(cfg: ModelConfig) -> Architecture:
    if cfg.architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {cfg.architecture!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    if cfg.use_sliding_window:
        raise ValueError("use_sliding_window=true in config.json: sliding-window attention is not supported")
    return ARCHITECTURES[cfg.architecture]


def build_model(cfg: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Create the model's parameters directly on `device` in `dtype` (uninitialised: the loader fills them)."""
    arch = check_architecture(cfg)
    qkv_bias = cfg.attention_bias if arch.qkv_bias is None else arch.qkv_bias
    o_bias = cfg.attention_bias if arch.o_bias is None else arch.o_bias
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = CausalLM(cfg, max_positions, qk_norm=arch.qk_norm, qkv_bias=qkv_bias, o_bias=o_bias)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()
