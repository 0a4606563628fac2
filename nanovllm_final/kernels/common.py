"""Helpers every kernel file shares: the rounding that makes a kernel round where its PyTorch
reference rounds, SwiGLU's gate on float32 projections, warps by block size, and the counters
of the split-K kernels (decode attention, the few-row tensor-core product)."""

import torch
import triton
import triton.language as tl


def warps(block: int) -> int:
    """num_warps of an elementwise launch whose program covers `block` elements."""
    return 1 if block <= 256 else 4 if block <= 2048 else 8


@triton.jit
def rounded(x, dtype: tl.constexpr):
    """float32 x rounded to `dtype` (nearest, ties to even) and widened back. For bf16 by
    integer arithmetic on the bits: a compiler may fold a plain down-and-up cast away."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def swiglu(acc_g, acc_u, dtype: tl.constexpr):
    """silu(gate) * up from the float32 projections, rounded to `dtype` where the reference
    rounds: the projections, silu(gate), the product."""
    gate, up = rounded(acc_g, dtype), rounded(acc_u, dtype)
    act = rounded(gate / (1.0 + tl.exp(-gate)), dtype)
    return (act * up).to(dtype)


class SplitCounters:
    """A split-K kernel's counters: int32 zeros that outlive each launch (the program that adds the
    splits resets its counter to 0). One growing buffer per device; a smaller one is kept as long
    as this object, as a CUDA graph may have captured it. Each Attention layer owns one; gemv.py's
    split product keeps one for the process."""

    def __init__(self):
        self.buffers: dict[torch.device, list[torch.Tensor]] = {}

    def get(self, device: torch.device, n: int) -> torch.Tensor:
        """>= n zeros on `device`."""
        buffers = self.buffers.setdefault(device, [])
        if not buffers or buffers[-1].numel() < n:
            buffers.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
        return buffers[-1]
