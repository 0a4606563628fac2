"""Model construction from a ModelConfig: which architectures we support and how."""

import torch

from ..config import ModelConfig
from .transformer import CausalLM

# architecture name in config.json -> does it normalise q and k per head?
SUPPORTED_ARCHITECTURES = {"Qwen3ForCausalLM": True, "LlamaForCausalLM": False, "Qwen3MoeForCausalLM": True}


def check_architecture(cfg: ModelConfig) -> None:
    if cfg.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {cfg.architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def build_model(cfg: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Create the model's parameters directly on `device` in `dtype` (uninitialised: the loader fills them)."""
    check_architecture(cfg)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = CausalLM(cfg, SUPPORTED_ARCHITECTURES[cfg.architecture], max_positions)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()
