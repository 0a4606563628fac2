"""x W^T on the CPU for two or more rows through oneDNN, on a copy of the weight packed for it.

torch's F.linear multiplies float32 matrices on the CPU with MKL, whose kernels for a few rows
are slow on AMD CPUs: on the course machine's EPYC (one thread, course model's shapes) five rows
took 2.5 to 3 times one row, so a verify step of speculative decoding (1 + k rows a sequence), a
small decode batch or a short prompt chunk cost far more than their weights' reads. oneDNN on a
weight reordered once takes 1.1 to 2.2 times less there from two rows up to 256 (and the same
results within float32 rounding) for a weight of 2^17 elements or more; a smaller one, and one
row, keep MKL (oneDNN's call costs about 15 us more, which a small product does not win back). On
Intel's CPUs MKL's few-row kernels are the faster, so the oneDNN path runs on AMD's alone
(`ONEDNN_CPU`; NANOVLLM_CPU_ONEDNN=1 or 0 forces it on or off). The packed copy lives beside the
weight (a CPU engine holds its float32 matrices twice) and is packed again when the weight
changes. Elsewhere (CUDA, other dtypes, a torch without oneDNN) this is F.linear."""

import os

import torch
import torch.nn.functional as F


def cpu_vendor() -> str | None:
    """The CPU's vendor_id in /proc/cpuinfo (AuthenticAMD, GenuineIntel), None where there is none."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


AVAILABLE = (
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
)


def onednn_cpu(switch: str, vendor: str | None) -> bool:
    """Whether products take oneDNN: as NANOVLLM_CPU_ONEDNN (`switch`) says ("1" or "0"), else on
    AMD's CPUs, whose MKL few-row products oneDNN beats."""
    return {"1": True, "0": False}.get(switch, vendor == "AuthenticAMD")


ONEDNN_CPU = onednn_cpu(os.environ.get("NANOVLLM_CPU_ONEDNN", ""), cpu_vendor())
ROWS_HINT = 8  # the row count oneDNN reorders the weight for (any count runs on it)
MIN_WEIGHT = 1 << 17  # elements: from here on oneDNN is the faster for two rows or more


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x (rows, in), weight (out, in): (rows, out)."""
    if not (
        AVAILABLE
        and ONEDNN_CPU
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[0] > 1
        and weight.numel() >= MIN_WEIGHT
        and x.dtype == weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
    ):
        return F.linear(x, weight, bias)
    packed = getattr(weight, "onednn_packed", None)
    if packed is None or packed[0] != weight._version:
        with torch.no_grad():
            packed = (
                weight._version,
                torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT),
            )
        weight.onednn_packed = packed
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed[1], bias, "none", [], "")
