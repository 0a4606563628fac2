"""Kernel or reference: the one place that decides which computes a layer's operation.

The Triton kernels run on CUDA tensors of the dtypes they are written for, where Triton is
installed; everywhere else (a CPU, a platform without Triton) the layers run their PyTorch
code, which is also the reference the kernels are tested against. The Triton interpreter
(TRITON_INTERPRET=1) runs the kernels on a CPU only where a caller asks for them directly (the
kernel tests): the layers keep their PyTorch code there. `reference_only()` makes every layer
take its PyTorch code on CUDA too, to compare the two paths. `fp8_dot` decides how the attention
kernels read an fp8 KV cache."""

import contextlib
import functools
import os

import torch

from . import tuning

try:  # the kernel modules import triton
    from . import activation, gemv, moe, norm_rope, sampling
except ImportError:
    activation = gemv = moe = norm_rope = sampling = None

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_reference_only = False


def use_kernel(x: torch.Tensor) -> bool:
    """Whether x's operation runs as a Triton kernel (else the layer's PyTorch code)."""
    return not _reference_only and norm_rope is not None and x.is_cuda and x.dtype in KERNEL_DTYPES


def takes_gemv(x: torch.Tensor, kind: str = "linear") -> bool:
    """Whether a layer's input x (tokens, features) takes the few-row kernels (gemv.py) of a
    projection kind (linear, gate_up or down): a kernel's input of at most the kind's few_rows
    (its gemv rows and dot_rows) contiguous rows."""
    return (
        use_kernel(x)
        and x.shape[0] <= tuning.for_device(x.device).few_rows(kind)
        and x.is_contiguous()
    )


def fp8_dot(q: torch.Tensor) -> bool:
    """Whether attention over an fp8 KV cache multiplies e4m3 on tensor cores (q quantized, the
    cache's tiles as they are: kernels/attention.py) rather than widening every K/V tile to 16
    bits in registers: for fp16/bf16 q on CUDA devices of compute capability 8.9 and later (Ada,
    Hopper: fp8 `tl.dot`) where the environment sets NANOVLLM_FP8_DOT=1 (read once per device).
    Widening is the default: on an H100 the decode kernel reads the cache as fast either way and
    the widened products are the more exact (benchmarks/results/fp8_attention_h100.json,
    kv_cache_quality_h100.json). float32 q always widens: 8 bits would undo its precision."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _fp8_dot_device(q.device)


@functools.cache
def _fp8_dot_device(device: torch.device) -> bool:
    return os.environ.get("NANOVLLM_FP8_DOT", "0") == "1" and torch.cuda.get_device_capability(
        device
    ) >= (8, 9)


@contextlib.contextmanager
def reference_only():
    """Within the block, every layer runs its PyTorch code."""
    global _reference_only
    saved, _reference_only = _reference_only, True
    try:
        yield
    finally:
        _reference_only = saved
