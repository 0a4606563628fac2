"""Helpers every kernel file shares: the rounding that makes a kernel round where its PyTorch
reference rounds, SwiGLU's gate on float32 projections, and warps by block size."""

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
