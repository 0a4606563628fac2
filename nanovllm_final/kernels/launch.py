"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may start
while the kernel before it in the stream is still finishing, so its launch and its programs'
start overlap the previous kernel's last wave instead of following it. Each such kernel waits
(griddepcontrol.wait) before it reads or writes anything, so it sees every result of the
kernel before it; as every PDL kernel waits, that holds for all earlier kernels too. A decode
step is a few hundred short kernels, each of which would otherwise start only once the one
before it has drained.

`pdl_args(device)` gives the launch arguments: the PDL constexpr that makes a kernel call
`wait_for_prior_kernel`, and Triton's launch_pdl option. Off on CPU, under the Triton
interpreter, before compute capability 9.0, with a Triton that lacks griddepcontrol, and when
the environment sets NANOVLLM_PDL=0 (read once per device, to measure what PDL gives)."""

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: PDL stays off
    gdc_launch_dependents = gdc_wait = None


@functools.cache
def pdl_args(device: torch.device) -> dict:
    """{"PDL": True, "launch_pdl": True} where PDL works, else {"PDL": False}."""
    on = (
        gdc_wait is not None
        and device.type == "cuda"
        and os.environ.get("TRITON_INTERPRET") != "1"
        and os.environ.get("NANOVLLM_PDL", "1") != "0"
        and torch.cuda.get_device_capability(device) >= (9, 0)
    )
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def wait_for_prior_kernel(PDL: tl.constexpr):
    """A PDL kernel's first statement: let the next kernel launch, then wait until the one
    before has finished and its writes are visible."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
