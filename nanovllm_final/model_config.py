"""A model's config.json (and generation_config.json's sampling defaults), read into the
fields the engine uses, in either of transformers' layouts."""

import json
import pathlib
from dataclasses import dataclass, field

import torch

from .checkpoint_checks import check_checkpoint
from .dtypes import parse_dtype
from .sampling_params import GENERATION_CONFIG_FIELDS
from .validate import is_int


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
    eos_token_ids: list[int] = field(
        default_factory=list
    )  # config.json's and generation_config.json's
    generation_defaults: dict = field(
        default_factory=dict
    )  # generation_config.json's sampling fields
    use_sliding_window: bool = False
    # mixture of experts (Qwen3-MoE); dense models have num_experts == 0
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k: how many experts each token is sent to
    moe_intermediate_size: int = 0  # each expert's SwiGLU width
    norm_topk_prob: bool = False  # scale the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # layer i has experts if (i + 1) % decoder_sparse_step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and i is not listed here

    def is_moe_layer(self, layer: int) -> bool:
        """Does decoder layer `layer` (0-based) hold experts, or a dense MLP? HF's rule."""
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
        if not any(
            path.glob("*.safetensors")
        ):  # one file, or the shards of model.safetensors.index.json
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
        rope_theta, scaling = rope_fields(raw)
        heads = need("num_attention_heads")
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
            eos_token_ids=eos_ids(raw, generation_config or {}),
            generation_defaults={
                k: v
                for k, v in (generation_config or {}).items()
                if k in GENERATION_CONFIG_FIELDS and v is not None
            },
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


def moe_fields(raw: dict) -> dict:
    """The mixture-of-experts fields of a config.json, checked: the expert count is
    `num_experts` as the hub ships it, or `num_local_experts` as transformers 5 writes it.
    {} for a dense model."""
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
    if not is_int(top_k) or not 1 <= top_k <= num_experts:
        raise ValueError(
            f"num_experts_per_tok must be an integer from 1 to num_experts={num_experts}, "
            f"got {top_k!r}"
        )
    if not is_int(step) or step < 1:
        raise ValueError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    if not is_int(raw["moe_intermediate_size"]) or raw["moe_intermediate_size"] < 1:
        raise ValueError(
            "moe_intermediate_size must be a positive integer, "
            f"got {raw['moe_intermediate_size']!r}"
        )
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=raw["moe_intermediate_size"],
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        decoder_sparse_step=step,
        mlp_only_layers=list(dense),
    )


def rope_fields(raw: dict) -> tuple[float, dict | None]:
    """RoPE's base and its scaling (None: plain RoPE), from the top level (transformers 4.x) or
    rope_parameters (transformers 5)."""
    rope = raw.get("rope_parameters") or {}
    rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling") or (
        rope if rope.get("rope_type", "default") != "default" else None
    )
    if scaling is not None:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.get("type", "default"))
    return rope_theta, scaling


def eos_ids(raw: dict, generation_config: dict) -> list[int]:
    """config.json's EOS ids, then generation_config.json's, each once."""
    eos: list[int] = []
    for source in (raw, generation_config):
        ids = source.get("eos_token_id")
        for i in [ids] if isinstance(ids, int) else ids or []:
            if i not in eos:
                eos.append(i)
    return eos
