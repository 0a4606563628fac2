"""The fused Triton kernels (fused_triton.py, fused_moe.py), or None on a platform without
Triton: the layers then run their PyTorch code (the reference, and the CPU path) everywhere."""

try:
    from . import fused_moe, fused_triton
except ImportError:
    fused_moe = fused_triton = None


def takes_gemv(x) -> bool:
    """Whether a layer's input x (tokens, features) takes the matrix-vector kernels
    (fused_moe.gemv, dense_mlp): on CUDA with Triton, at most GEMV_ROWS contiguous rows."""
    return fused_moe is not None and x.is_cuda and x.shape[0] <= fused_moe.GEMV_ROWS and x.is_contiguous()
