"""Engine options and the model's config.json, read and checked once, up front."""

import json
import os
import pathlib
from dataclasses import dataclass, field, fields

import torch

from .sampling_params import GENERATION_CONFIG_FIELDS, SamplingParams
from .speculative_config import SpeculativeConfig, check_options, parse_speculative_config
from .validate import INT32_MAX, INT64_MAX, INT64_MIN, Checked, Problem, is_int, is_number, option

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names: fp8 is e4m3 (values up to +-448, 3 mantissa bits)


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in _DTYPES.values():
        return value
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"{value!r} is not a supported dtype; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def kv_cache_torch_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """What the KV cache stores: "auto" is the model's `dtype`, "fp8"/"fp8_e4m3" float8 e4m3."""
    return dtype if kv_cache_dtype == "auto" else torch.float8_e4m3fn


@dataclass
class EngineConfig(Checked):
    """Every engine option of the public API; each is checked when it is set (validate.py)."""

    model: str
    device: str | None = option(None, "cuda or cpu (default: cuda if available)", str, pattern=r"cpu|cuda(:\d+)?",
                                rule="'cpu', 'cuda', 'cuda:N'")
    dtype: str | torch.dtype | None = option(None, "float32, float16 or bfloat16 (default: the checkpoint's on CUDA, float32 on CPU)",
                                             convert=lambda v: None if v is None else parse_dtype(v))
    max_model_len: int = option(4096, "longest sequence, prompt plus output", low=1, high=INT32_MAX)
    max_num_seqs: int = option(256, "most sequences in one step", low=1, high=INT32_MAX)
    max_num_batched_tokens: int = option(16384, "most tokens in one step (longer prompts are chunked)", low=1, high=INT32_MAX)
    enforce_eager: bool = option(False, "no CUDA graphs")
    cuda_graph_max_tokens: int = option(8192, "largest step with prompt tokens replayed from a CUDA graph (0: those run "
                                        "eagerly; decode steps are replayed up to 512 sequences)", low=0, high=INT32_MAX)
    overlap_scheduling: bool = option(True, "schedule the next step while the device runs this one (engine/llm_engine.py)")
    tensor_parallel_size: int = option(1, "GPUs (or CPU processes) to split the model over", low=1, high=INT32_MAX)
    kvcache_block_size: int = option(16, "tokens per KV-cache block", low=1, high=INT32_MAX)
    num_kvcache_blocks: int = option(-1, "KV-cache blocks (-1: as many as memory allows)", low=-1, high=INT32_MAX)
    gpu_memory_utilization: float = option(0.9, "share of GPU memory the engine may use", float, low=0, low_open=True, high=1)
    cpu_kvcache_bytes: int = option(1 << 30, "KV-cache bytes on CPU", low=1, high=INT64_MAX)
    attention_backend: str = option("auto", "auto, torch, triton or flash_attn", choices=ATTENTION_BACKENDS)
    kv_cache_dtype: str = option("auto", "KV-cache storage: auto (the model's dtype) or fp8 (alias fp8_e4m3: float8 e4m3 "
                                 "with a scale per layer and kv head; half the bytes of bfloat16)", choices=KV_CACHE_DTYPES)
    seed: int = option(0, "seed of the sampler for requests without their own seed", low=INT64_MIN, high=INT64_MAX)
    speculative_config: SpeculativeConfig | None = option(
        None, 'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": K, '
        '"prompt_lookup_min": A, "prompt_lookup_max": B} or {"method": "draft_model", "model": DIR, '
        '"num_speculative_tokens": K} (default: off)',
        convert=parse_speculative_config)
    distributed_host: str = option("127.0.0.1", "tensor parallelism: where the ranks meet (torch.distributed's TCP rendezvous)")
    distributed_port: int = option(0, "tensor parallelism: rendezvous port (0: rank 0 picks a free one at start-up)", low=0, high=65535)
    distributed_timeout: float = option(120.0, "tensor parallelism: seconds the rendezvous or a collective may wait for a peer",
                                        low=0, low_open=True, high=1e6)

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
        """What one field alone cannot say: the values that depend on each other or on this machine."""
        if self.num_kvcache_blocks == 0:
            raise Problem("num_kvcache_blocks must be -1 (automatic) or positive, got 0", "num_kvcache_blocks")
        check_options(self.speculative_config, self.max_model_len, self.tensor_parallel_size)
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise Problem(f"device {self.device!r} was asked for, but CUDA is not available here; use device='cpu'", "device")
        # one device per rank (on CPU, one process per rank: at most one per core)
        if self.device.startswith("cuda"):
            available, kind = torch.cuda.device_count(), "CUDA devices are visible"
        else:
            available, kind = os.cpu_count() or 1, "CPU cores are available (each rank is a process)"
        if self.tensor_parallel_size > available:
            raise Problem(f"tensor_parallel_size={self.tensor_parallel_size} needs one device per rank, but only {available} {kind}",
                          "tensor_parallel_size")

    @property
    def distributed_init_method(self) -> str:
        """The address every rank gives torch.distributed to meet."""
        host = f"[{self.distributed_host}]" if ":" in self.distributed_host else self.distributed_host  # IPv6
        return f"tcp://{host}:{self.distributed_port}"


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
    eos_token_ids: list[int] = field(default_factory=list)  # config.json's and generation_config.json's
    generation_defaults: dict = field(default_factory=dict)  # generation_config.json's sampling fields
    use_sliding_window: bool = False
    # mixture of experts (Qwen3-MoE); dense models have num_experts == 0
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k: how many experts each token is sent to
    moe_intermediate_size: int = 0  # each expert's SwiGLU width
    norm_topk_prob: bool = False  # scale the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # layer i has experts if (i + 1) % decoder_sparse_step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and i is not listed here

    def is_moe_layer(self, layer: int) -> bool:
        """Does decoder layer `layer` (0-based) hold experts, or a dense MLP? Hugging Face's rule."""
        return self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_dir(cls, model_dir: str | pathlib.Path) -> "ModelConfig":
        path = pathlib.Path(model_dir)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
        config_file = path / "config.json"
        if not config_file.exists():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
        if not any(path.glob("*.safetensors")):  # one file, or the shards of model.safetensors.index.json
            raise FileNotFoundError(f"{path} has no *.safetensors weight files")
        gen_file = path / "generation_config.json"
        raw, gen = read_json(config_file), read_json(gen_file) if gen_file.exists() else {}
        try:
            return cls.from_dict(raw, gen)
        except ValueError as err:  # it names the file and the field; say which checkpoint
            raise ValueError(f"{path}: {err}") from None

    @classmethod
    def from_dict(cls, raw: dict, generation_config: dict | None = None) -> "ModelConfig":
        """Read both layouts: transformers 4.x (top-level rope_theta, rope_scaling,
        torch_dtype) and transformers 5 (rope_parameters, dtype)."""
        check_checkpoint(raw, generation_config or {})

        def need(key: str):
            if key not in raw:
                raise ValueError(f"config.json lacks the required field {key!r}")
            return raw[key]

        archs = need("architectures")
        arch = archs[0] if archs else ""
        rope = raw.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
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
            generation_defaults={k: v for k, v in (generation_config or {}).items() if k in GENERATION_CONFIG_FIELDS and v is not None},
            use_sliding_window=bool(raw.get("use_sliding_window", False)),
            **moe_fields(raw),
        )


def read_json(file: pathlib.Path) -> dict:
    """A checkpoint's JSON file; a corrupt one is a ValueError naming it."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def check_checkpoint(raw: dict, generation_config: dict) -> None:
    """config.json's and generation_config.json's values the engine computes with, checked
    before it does: a bad one is a ValueError naming the file and the field. A checkpoint's
    sampling defaults must pass SamplingParams' checks and its EOS ids must be in the
    vocabulary, or the checkpoint is refused (not silently changed)."""

    def bad(file: str, key: str, rule: str, value) -> ValueError:
        return ValueError(f"{file}: {key} must be {rule}, got {value!r}")

    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings")
    for key in sizes:  # the required ones that are missing: from_dict says so
        if raw.get(key) is not None and not (is_int(raw[key]) and 1 <= raw[key] <= INT32_MAX):
            raise bad("config.json", key, "a positive integer", raw[key])
    heads, kv_heads = raw.get("num_attention_heads"), raw.get("num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        raise bad("config.json", "num_attention_heads", f"a multiple of num_key_value_heads ({kv_heads})", heads)
    rope = raw.get("rope_parameters")
    for key, value in (("rms_norm_eps", raw.get("rms_norm_eps")), ("rope_theta", raw.get("rope_theta")),
                       ("rope_parameters.rope_theta", rope.get("rope_theta") if isinstance(rope, dict) else None)):
        if value is not None and not (is_number(value) and value > 0):
            raise bad("config.json", key, "a positive number", value)
    for key in ("rope_scaling", "rope_parameters"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise bad("config.json", key, "an object or null", raw[key])
    for key in ("tie_word_embeddings", "attention_bias", "use_sliding_window"):
        if raw.get(key) is not None and not isinstance(raw[key], bool):
            raise bad("config.json", key, "true or false", raw[key])
    try:
        parse_dtype(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
    except ValueError as err:
        raise ValueError(f"config.json: torch_dtype: {err}") from None
    archs = raw.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise bad("config.json", "architectures", "a list of class names", archs)
    vocab = raw.get("vocab_size")
    for file, source in (("config.json", raw), ("generation_config.json", generation_config)):
        ids = source.get("eos_token_id")
        ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
        if vocab is not None and not all(is_int(i) and 0 <= i < vocab for i in ids):
            raise bad(file, "eos_token_id", f"a token id (or a list of them) in the vocabulary [0, {vocab})", source["eos_token_id"])
    for key in GENERATION_CONFIG_FIELDS:
        if generation_config.get(key) is not None:
            try:
                SamplingParams(**{key: generation_config[key]})
            except ValueError as err:
                raise ValueError(f"generation_config.json: {err}") from None


def moe_fields(raw: dict) -> dict:
    """The mixture-of-experts fields of a config.json, checked: the expert count is `num_experts`
    as the hub ships it, or `num_local_experts` as transformers 5 writes it. {} for a dense model."""
    num_experts = raw.get("num_experts", raw.get("num_local_experts")) or 0
    if not num_experts:
        return {}
    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        if key not in raw:
            raise ValueError(f"config.json has num_experts={num_experts} but lacks the required field {key!r}")
    top_k, step, dense = raw["num_experts_per_tok"], raw.get("decoder_sparse_step", 1), raw.get("mlp_only_layers") or []
    if not is_int(top_k) or not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok must be an integer from 1 to num_experts={num_experts}, got {top_k!r}")
    if not is_int(step) or step < 1:
        raise ValueError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    if not is_int(raw["moe_intermediate_size"]) or raw["moe_intermediate_size"] < 1:
        raise ValueError(f"moe_intermediate_size must be a positive integer, got {raw['moe_intermediate_size']!r}")
    return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["moe_intermediate_size"],
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)), decoder_sparse_step=step, mlp_only_layers=list(dense))


def check_tensor_parallel(config: EngineConfig, model_config: ModelConfig) -> None:
    """Every rank takes an equal share of the heads, the MLP and the vocabulary, so the TP size must divide each of them. Checked before any process starts."""
    tp = config.tensor_parallel_size
    names = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size", "vocab_size")
    bad = [f"{name}={getattr(model_config, name)}" for name in names if getattr(model_config, name) % tp]
    if bad:
        raise ValueError(f"tensor_parallel_size={tp} must divide {', '.join(bad)} of this model: each rank takes an equal share")

