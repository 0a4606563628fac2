import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import dispatch


class SiluAndMul(nn.Module):
    """SwiGLU's gate: the input holds [gate | up] side by side; returns silu(gate) * up.
    On CUDA one Triton kernel (kernels/activation.py's silu_and_mul); the PyTorch code is the reference."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dispatch.use_kernel(x):
            return dispatch.activation.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)  # (tokens, intermediate) each
        return F.silu(gate) * up
