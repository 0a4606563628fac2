"""Which device an engine runs on, and whether this machine has one for every rank."""

import os

import torch

from .validate import Problem


def resolve_device(device: str | None) -> str:
    """`device` as asked ("cpu", "cuda", "cuda:N"), or CUDA where there is one; a Problem if
    CUDA is asked for and absent."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise Problem(
            f"device {device!r} was asked for, but CUDA is not available here; use device='cpu'",
            "device",
        )
    return device


def check_ranks_fit(tensor_parallel_size: int, device: str) -> None:
    """One device per rank: a GPU each on CUDA, a process (at most one per core) each on a CPU."""
    if device.startswith("cuda"):
        available, kind = torch.cuda.device_count(), "CUDA devices are visible"
    else:
        available, kind = os.cpu_count() or 1, "CPU cores are available (each rank is a process)"
    if tensor_parallel_size > available:
        raise Problem(
            f"tensor_parallel_size={tensor_parallel_size} needs one device per rank, "
            f"but only {available} {kind}",
            "tensor_parallel_size",
        )
