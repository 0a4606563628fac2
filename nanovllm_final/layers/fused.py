"""The fused Triton kernels (fused_triton.py, fused_moe.py), or None on a platform without
Triton: the layers then run their PyTorch code (the reference, and the CPU path) everywhere."""

try:
    from . import fused_moe, fused_triton
except ImportError:
    fused_moe = fused_triton = None
