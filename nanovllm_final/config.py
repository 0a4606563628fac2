"""The engine options, read and checked once, up front (config.json: model_config.py)."""

from dataclasses import dataclass, fields

import torch

from .devices import check_ranks_fit, resolve_device
from .dtypes import KV_CACHE_DTYPES, kv_cache_torch_dtype, parse_dtype
from .model_config import ModelConfig
from .speculative_config import SpeculativeConfig, check_options, parse_speculative_config
from .validate import INT32_MAX, INT64_MAX, INT64_MIN, Checked, Problem, option

__all__ = [
    "ATTENTION_BACKENDS",
    "EngineConfig",
    "ModelConfig",
    "check_tensor_parallel",
    "kv_cache_torch_dtype",
    "parse_dtype",
]
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")


@dataclass
class EngineConfig(Checked):
    """Every engine option of the public API; each is checked when it is set (validate.py)."""

    model: str
    device: str | None = option(
        None,
        "cuda or cpu (default: cuda if available)",
        str,
        pattern=r"cpu|cuda(:\d+)?",
        rule="'cpu', 'cuda', 'cuda:N'",
    )
    dtype: str | torch.dtype | None = option(
        None,
        "float32, float16 or bfloat16 (default: the checkpoint's on CUDA, float32 on CPU)",
        convert=lambda v: None if v is None else parse_dtype(v),
    )
    max_model_len: int = option(4096, "longest sequence, prompt plus output", low=1, high=INT32_MAX)
    max_num_seqs: int = option(256, "most sequences in one step", low=1, high=INT32_MAX)
    max_num_batched_tokens: int = option(
        16384, "most tokens in one step (longer prompts are chunked)", low=1, high=INT32_MAX
    )
    enforce_eager: bool = option(False, "no CUDA graphs")
    cuda_graph_max_tokens: int = option(
        8192,
        "largest step with prompt tokens replayed from a CUDA graph (0: those run "
        "eagerly; decode steps are replayed up to 512 sequences)",
        low=0,
        high=INT32_MAX,
    )
    overlap_scheduling: bool = option(
        True, "schedule the next step while the device runs this one (engine/llm_engine.py)"
    )
    tensor_parallel_size: int = option(
        1, "GPUs (or CPU processes) to split the model over", low=1, high=INT32_MAX
    )
    kvcache_block_size: int = option(16, "tokens per KV-cache block", low=1, high=INT32_MAX)
    num_kvcache_blocks: int = option(
        -1, "KV-cache blocks (-1: as many as memory allows)", low=-1, high=INT32_MAX
    )
    gpu_memory_utilization: float = option(
        0.9, "share of GPU memory the engine may use", float, low=0, low_open=True, high=1
    )
    cpu_kvcache_bytes: int = option(1 << 30, "KV-cache bytes on CPU", low=1, high=INT64_MAX)
    attention_backend: str = option(
        "auto", "auto, torch, triton or flash_attn", choices=ATTENTION_BACKENDS
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV-cache storage: auto (the model's dtype) or fp8 (alias fp8_e4m3: float8 e4m3 "
        "with a scale per layer and kv head; half the bytes of bfloat16)",
        choices=KV_CACHE_DTYPES,
    )
    seed: int = option(
        0, "seed of the sampler for requests without their own seed", low=INT64_MIN, high=INT64_MAX
    )
    speculative_config: SpeculativeConfig | None = option(
        None,
        'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": K, '
        '"prompt_lookup_min": A, "prompt_lookup_max": B} or '
        '{"method": "draft_model", "model": DIR, '
        '"num_speculative_tokens": K} (default: off)',
        convert=parse_speculative_config,
    )
    distributed_host: str = option(
        "127.0.0.1", "tensor parallelism: where the ranks meet (torch.distributed's TCP rendezvous)"
    )
    distributed_port: int = option(
        0,
        "tensor parallelism: rendezvous port (0: rank 0 picks a free one at start-up)",
        low=0,
        high=65535,
    )
    distributed_timeout: float = option(
        120.0,
        "tensor parallelism: seconds the rendezvous or a collective may wait for a peer",
        low=0,
        low_open=True,
        high=1e6,
    )

    @classmethod
    def from_options(cls, model: str, **options) -> "EngineConfig":
        known = {f.name for f in fields(cls)} - {"model"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known options: {sorted(known)}")
        config = cls(model=str(model), **options)
        config.validate()
        return config

    def validate(self) -> None:
        """What one field alone cannot say: values that depend on each other or on this machine."""
        if self.num_kvcache_blocks == 0:
            raise Problem(
                "num_kvcache_blocks must be -1 (automatic) or positive, got 0", "num_kvcache_blocks"
            )
        check_options(self.speculative_config, self.max_model_len)
        self.device = resolve_device(self.device)
        check_ranks_fit(self.tensor_parallel_size, self.device)

    @property
    def distributed_init_method(self) -> str:
        """The address every rank gives torch.distributed to meet."""
        host = (
            f"[{self.distributed_host}]" if ":" in self.distributed_host else self.distributed_host
        )  # IPv6
        return f"tcp://{host}:{self.distributed_port}"


def check_tensor_parallel(config: EngineConfig, model_config: ModelConfig) -> None:
    """Every rank takes an equal share of the heads, the MLP and the vocabulary, so the TP size
    must divide each of them. Checked before any process starts."""
    tp = config.tensor_parallel_size
    names = (
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "moe_intermediate_size",
        "vocab_size",
    )
    bad = [
        f"{name}={getattr(model_config, name)}"
        for name in names
        if getattr(model_config, name) % tp
    ]
    if bad:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide {', '.join(bad)} of this model: "
            "each rank takes an equal share"
        )
