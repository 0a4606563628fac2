import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import dispatch


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like Hugging Face's.

    Called as ``norm(x)`` it returns the normalised x. Called as ``norm(x, residual)``
    it first adds the residual stream (the fused add of pre-norm transformers) and
    returns ``(normalised, new_residual)``. On CUDA one Triton kernel does it all
    (kernels/norm_rope.py's rms_norm); the PyTorch code is the reference and the CPU path."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if (
            dtype == self.weight.dtype == torch.float32
        ):  # the same in one op (a CPU step pays per op)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if dispatch.use_kernel(x):
            return dispatch.norm_rope.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual  # (tokens, hidden)
        return self._norm(x), x
