"""The named benchmark workloads: they live in nanovllm_final/workloads.py, so that the
installed `nanovllm bench` command runs them too; the benchmark runner and its tests
import them from here."""

from nanovllm_final.workloads import (
    WORKLOADS,
    Workload,
    get,
    long_prompts,
    make_workload,
    nanovllm,
    parameters,
    resolve_params,
    shared_prefix,
    tiny_cpu,
)

__all__ = [
    "WORKLOADS",
    "Workload",
    "get",
    "long_prompts",
    "make_workload",
    "nanovllm",
    "parameters",
    "resolve_params",
    "shared_prefix",
    "tiny_cpu",
]
