"""Engine options and the model's config.json, read and checked once, up front."""

import json
import pathlib
from dataclasses import dataclass, field, fields

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in _DTYPES.values():
        return value
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {value!r} is not supported; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


@dataclass
class EngineConfig:
    """Every engine option of the public API. Every stage accepts all of them. An option that
    only tunes a mechanism this stage does not have yet (kvcache_block_size before paging, say)
    is ignored; a value that asks for such a mechanism is refused, naming the stage where it arrives."""

    model: str
    device: str | None = None  # None: "cuda" if available, else "cpu"
    dtype: str | torch.dtype | None = None  # None: the checkpoint's on CUDA, float32 on CPU
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    kvcache_block_size: int = 16
    num_kvcache_blocks: int = -1
    gpu_memory_utilization: float = 0.9
    cpu_kvcache_bytes: int = 1 << 30
    attention_backend: str = "auto"
    seed: int = 0

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
        for name in (
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "tensor_parallel_size",
            "kvcache_block_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_kvcache_blocks != -1 and self.num_kvcache_blocks < 1:
            raise ValueError(
                f"num_kvcache_blocks must be -1 (automatic) or positive, got {self.num_kvcache_blocks}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.tensor_parallel_size > 1:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} asks for tensor parallelism: it arrives in "
                f"stage 07_tensor_parallel; {__package__} runs on one device"
            )
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(
                f"device {self.device!r} was asked for, but CUDA is not available here; use device='cpu'"
            )
        if self.dtype is not None:
            self.dtype = parse_dtype(self.dtype)


@dataclass
class ModelConfig:
    """The fields of a Hugging Face config.json that the engine uses."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: torch.dtype
    eos_token_ids: list[int] = field(default_factory=list)
    # mixture of experts (Qwen3-MoE); dense models have num_experts == 0
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k: how many experts each token is sent to
    moe_intermediate_size: int = 0  # each expert's SwiGLU width
    norm_topk_prob: bool = False  # scale the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # layer i has experts if (i + 1) % decoder_sparse_step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and i is not listed here

    def is_moe_layer(self, layer: int) -> bool:
        """Does decoder layer `layer` (0-based) hold experts, or a dense MLP? Hugging Face's rule."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dir(cls, model_dir: str | pathlib.Path) -> "ModelConfig":
        path = pathlib.Path(model_dir)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
        config_file = path / "config.json"
        if not config_file.exists():
            raise FileNotFoundError(
                f"{path} has no config.json: not a Hugging Face model directory"
            )
        if not any(path.glob("*.safetensors")):
            raise FileNotFoundError(f"{path} has no *.safetensors weight files")
        raw = json.loads(config_file.read_text())
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.exists() else {}
        return cls.from_dict(raw, gen)

    @classmethod
    def from_dict(cls, raw: dict, generation_config: dict | None = None) -> "ModelConfig":
        """Read both layouts: transformers 4.x (top-level rope_theta, rope_scaling,
        torch_dtype) and transformers 5 (rope_parameters, dtype)."""

        def need(key: str):
            if key not in raw:
                raise ValueError(f"config.json lacks the required field {key!r}")
            return raw[key]

        archs = need("architectures")
        arch = archs[0] if archs else ""
        rope = raw.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = raw.get("rope_scaling") or (
            rope if rope.get("rope_type", "default") != "default" else None
        )
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
        heads = need("num_attention_heads")
        eos: list[int] = []
        for source in (raw, generation_config or {}):
            ids = source.get("eos_token_id")
            for i in [ids] if isinstance(ids, int) else ids or []:
                if i not in eos:
                    eos.append(i)
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or need("hidden_size") // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=need("max_position_embeddings"),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", False),
            torch_dtype=parse_dtype(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            eos_token_ids=eos,
            **moe_fields(raw),
        )


def moe_fields(raw: dict) -> dict:
    """The mixture-of-experts fields of a config.json, checked: the expert count is `num_experts`
    as the hub ships it, or `num_local_experts` as transformers 5 writes it. {} for a dense model."""
    num_experts = raw.get("num_experts", raw.get("num_local_experts")) or 0
    if not num_experts:
        return {}
    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        if key not in raw:
            raise ValueError(
                f"config.json has num_experts={num_experts} but lacks the required field {key!r}"
            )
    top_k, step, dense = (
        raw["num_experts_per_tok"],
        raw.get("decoder_sparse_step", 1),
        raw.get("mlp_only_layers") or [],
    )
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(
            f"num_experts_per_tok must be an integer from 1 to num_experts={num_experts}, got {top_k!r}"
        )
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    if not isinstance(raw["moe_intermediate_size"], int) or raw["moe_intermediate_size"] < 1:
        raise ValueError(
            f"moe_intermediate_size must be a positive integer, got {raw['moe_intermediate_size']!r}"
        )
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=raw["moe_intermediate_size"],
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        decoder_sparse_step=step,
        mlp_only_layers=list(dense),
    )
