"""Reading real config.json files (both layouts) and mapping checkpoint weights into fused parameters."""

import json

import pytest
import torch
from common import ENGINES, ROOT, engine_module, load_engine
from safetensors.torch import load_file

CONFIGS = ROOT / "tools" / "configs"


def read(name: str) -> tuple[dict, dict]:
    folder = CONFIGS / name
    gen = folder / "generation_config.json"
    return json.loads((folder / "config.json").read_text()), json.loads(
        gen.read_text()
    ) if gen.exists() else {}


@pytest.mark.parametrize("engine", ENGINES)
def test_real_checkpoint_configs(engine):
    ModelConfig = engine_module(engine, "config").ModelConfig
    qwen = ModelConfig.from_dict(*read("qwen3-0.6b"))
    assert (qwen.head_dim, qwen.tie_word_embeddings, qwen.torch_dtype) == (
        128,
        True,
        torch.bfloat16,
    )
    assert qwen.eos_token_ids == [
        151645,
        151643,
    ]  # config's eos first, then generation_config's others
    llama = ModelConfig.from_dict(*read("llama-3.2-1b"))
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.rope_theta == 500000.0
    tiny = ModelConfig.from_dict(*read("tinyllama-1.1b"))
    assert tiny.head_dim == 2048 // 32 and not tiny.tie_word_embeddings
    assert ModelConfig.from_dict(*read("qwen3-8b")).num_key_value_heads == 8


@pytest.mark.parametrize("engine", ENGINES)
def test_transformers5_layout(engine):
    ModelConfig = engine_module(engine, "config").ModelConfig
    raw, _ = read("llama-3.2-1b")
    scaling = raw.pop("rope_scaling")
    raw["rope_parameters"] = {**scaling, "rope_theta": raw.pop("rope_theta")}
    raw["dtype"] = raw.pop("torch_dtype")
    cfg = ModelConfig.from_dict(raw)
    assert (
        cfg.rope_theta == 500000.0
        and cfg.rope_scaling["factor"] == 32.0
        and cfg.torch_dtype == torch.bfloat16
    )


@pytest.mark.parametrize("engine", ENGINES)
def test_missing_required_field(engine):
    ModelConfig = engine_module(engine, "config").ModelConfig
    raw, _ = read("qwen3-0.6b")
    del raw["hidden_size"]
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("engine", ENGINES)
def test_loader_fills_fused_parameters(engine, model_dir):
    """qkv_proj rows are [q | k | v] and gate_up_proj rows [gate | up], straight from the checkpoint."""
    path = model_dir("qwen3-untied-mha")
    with load_engine(engine).LLM(path, device="cpu", max_model_len=32) as llm:
        runner = llm.engine.model_runner
        model = runner.model
        weights = load_file(path / "model.safetensors")
        attn = model.model.layers[1].self_attn
        expected = torch.cat([weights[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(attn.qkv_proj.weight, expected)
        assert torch.equal(
            attn.qkv_proj.bias,
            torch.cat([weights[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"]),
        )
        mlp = model.model.layers[0].mlp
        gate_up = torch.cat(
            [weights[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")]
        )
        assert torch.equal(mlp.gate_up_proj.weight, gate_up)
        assert torch.equal(model.lm_head.weight, weights["lm_head.weight"])
