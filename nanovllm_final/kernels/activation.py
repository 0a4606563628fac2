"""SwiGLU's gate in Triton: silu(gate) * up in one launch and one pass over memory.
Reference: layers/activation.py's SiluAndMul (the PyTorch code, and the CPU path);
tests/test_fused_kernels.py checks it against that under TRITON_INTERPRET=1."""

import torch
import triton
import triton.language as tl

from .common import rounded, warps
from .launch import pdl_args, wait_for_prior_kernel


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_xt, N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    wait_for_prior_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = offs < N
    gate = tl.load(x_ptr + t * stride_xt + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_xt + N + offs, mask=mask, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    act = rounded(g / (1.0 + tl.exp(-g)), dtype)  # F.silu, rounded like the reference
    tl.store(out_ptr + t * N + offs, (act * up.to(tl.float32)).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: (T, 2N) = [gate | up] -> (T, N) = silu(gate) * up, contiguous."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(-1) == 1
    tokens, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(tokens, n, dtype=x.dtype, device=x.device)
    if tokens > 0:
        block = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(tokens, triton.cdiv(n, block))](
            x, out, x.stride(0), N=n, BLOCK=block, num_warps=warps(block), **pdl_args(x.device)
        )
    return out
