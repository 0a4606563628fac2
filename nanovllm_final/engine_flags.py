"""The engine options (EngineConfig's fields) as command-line flags, for every command of
the `nanovllm` console script (generate, chat, bench and serve): one flag per field but
`model`, which each command takes its own way. The engine's `seed` is `--engine-seed`
(`--seed` is a request's)."""

import argparse
import dataclasses

from .config import EngineConfig

MODEL_HELP = "checkpoint directory, or a hub id in the local Hugging Face cache"
ENGINE_HELP = {
    "device": "cuda or cpu (default: cuda if available)",
    "dtype": "float32, float16 or bfloat16 (default: the checkpoint's on CUDA, float32 on CPU)",
    "max_model_len": "longest sequence, prompt plus output",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "most tokens in one step (longer prompts are chunked)",
    "enforce_eager": "no CUDA graphs",
    "overlap_scheduling": "schedule the next step while the device runs this one",
    "tensor_parallel_size": "GPUs (or CPU processes) to split the model over",
    "kvcache_block_size": "tokens per KV-cache block",
    "num_kvcache_blocks": "KV-cache blocks (-1: as many as memory allows)",
    "gpu_memory_utilization": "share of GPU memory the engine may use",
    "cpu_kvcache_bytes": "KV-cache bytes on CPU",
    "attention_backend": "auto, torch, triton or flash_attn",
    "seed": "seed of the sampler for requests without their own seed",
    "distributed_host": "tensor parallelism: where the ranks meet",
    "distributed_port": "tensor parallelism: rendezvous port (0: a free one)",
    "distributed_timeout": "tensor parallelism: seconds to wait for a peer",
}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _engine_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineConfig) if f.name != "model"]


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """A flag per engine option, defaulting to None: an option left out keeps the engine's default."""
    group = parser.add_argument_group("engine options (LLM(model, **options); see nanovllm_final's README)")
    for f in _engine_fields():
        name, dest = ("engine_seed" if f.name == "seed" else f.name), f"engine_{f.name}"
        if isinstance(f.default, bool):  # --x turns it on; an option on by default also gets --no-x
            action = argparse.BooleanOptionalAction if f.default else "store_true"
            group.add_argument(flag(name), dest=dest, action=action, default=None, help=ENGINE_HELP[f.name])
        else:
            kind = type(f.default) if f.default is not None else str
            default = "" if f.default is None else f" (default: {f.default})"  # None: the help says what happens
            group.add_argument(flag(name), dest=dest, type=kind, metavar=kind.__name__.upper(), help=ENGINE_HELP[f.name] + default)


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options given on the command line, as LLM's keyword arguments."""
    return {f.name: getattr(args, f"engine_{f.name}") for f in _engine_fields() if getattr(args, f"engine_{f.name}") is not None}
