"""The fused Triton kernels (fused_triton.py), or None on a platform without Triton: the
layers then run their PyTorch code (the reference, and the CPU path) everywhere."""

try:
    from . import fused_triton
except ImportError:
    fused_triton = None
