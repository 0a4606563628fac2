"""The offline model factory writes model directories that transformers reads as we mean them."""

import json
import math
import re

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from tools import tiny_model
from tools.tiny_model import (
    FULL_SHAPES,
    build_config,
    build_if_missing,
    cached_model,
    make_model,
    param_shapes,
)

PROMPT_IDS = torch.tensor([[5, 77, 301, 42, 9, 260, 13, 499]])


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """make_model, each set of arguments built once per module."""
    built = {}

    def build(**kwargs):
        key = json.dumps(kwargs, sort_keys=True)
        if key not in built:
            built[key] = make_model(tmp_path_factory.mktemp("model"), **kwargs)
        return built[key]

    return build


def load_hf(path):
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    return model.eval()


@torch.no_grad()
def hf_logits(path) -> torch.Tensor:
    return load_hf(path)(PROMPT_IDS).logits


def read_config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def tensor_names(path) -> set[str]:
    with safe_open(path / "model.safetensors", "pt") as f:
        return set(f.keys())


def test_same_seed_same_bytes(tmp_path, build):
    again = make_model(tmp_path / "again", seed=0)
    other = make_model(tmp_path / "other", seed=1)
    first = build()
    for name in (
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tiny_model.json",
    ):
        assert (first / name).read_bytes() == (again / name).read_bytes()
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_layouts_load_in_transformers_with_identical_logits(build, arch):
    hf4, hf5 = build(arch=arch), build(arch=arch, config_layout="hf5")
    config4, config5 = read_config(hf4), read_config(hf5)
    assert (
        config4["architectures"] == [tiny_model.ARCHITECTURES[arch]]
        and config4["model_type"] == arch
    )
    assert {"rope_theta", "rope_scaling", "torch_dtype"} <= config4.keys()
    assert "rope_parameters" not in config4 and "dtype" not in config4
    assert config5["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert (
        config5["dtype"] == "float32"
        and not {"rope_theta", "rope_scaling", "torch_dtype"} & config5.keys()
    )
    logits4 = hf_logits(hf4)
    assert torch.equal(logits4, hf_logits(hf5))
    assert logits4.shape == (1, PROMPT_IDS.shape[1], 512)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_output_varies(build, arch):
    generated = load_hf(build(arch=arch)).generate(PROMPT_IDS, max_new_tokens=24, do_sample=False)
    assert len(set(generated[0, PROMPT_IDS.shape[1] :].tolist())) > 4


def test_parameter_names(build):
    names = tensor_names(build())
    assert {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.self_attn.k_norm.weight",
    } <= names
    assert not any("q_norm" in name for name in tensor_names(build(arch="llama")))
    assert names == set(param_shapes(read_config(build())))


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_heads(build, arch, tied):
    path = build(arch=arch, tie_word_embeddings=tied)
    assert read_config(path)["tie_word_embeddings"] is tied
    assert ("lm_head.weight" in tensor_names(path)) is not tied
    model = load_hf(path)
    same = torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert same is tied


def test_tiny_defaults_cover_both_heads():
    assert (
        build_config("qwen3")["tie_word_embeddings"]
        and not build_config("llama")["tie_word_embeddings"]
    )


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_gqa_and_mha(build, kv_heads):
    path = build(arch="llama", num_key_value_heads=kv_heads)
    with safe_open(path / "model.safetensors", "pt") as f:
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [
            kv_heads * 16,
            64,
        ]
    load_hf(path)
    with pytest.raises(ValueError):
        build_config("llama", num_key_value_heads=3)


def test_attention_bias(build):
    path = build(arch="qwen3", attention_bias=True)
    names = tensor_names(path)
    assert {f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkvo"} <= names
    load_hf(path)


def test_derive_head_dim_omits_head_dim(build):
    path = build(arch="llama", derive_head_dim=True)
    assert "head_dim" not in read_config(path)
    assert AutoConfig.from_pretrained(path).head_dim == 16
    assert torch.equal(hf_logits(path), hf_logits(build(arch="llama")))
    with pytest.raises(ValueError):  # Qwen3Config would read a missing head_dim as 128
        build_config("qwen3", derive_head_dim=True)
    with pytest.raises(ValueError):
        build_config("llama", head_dim=32, derive_head_dim=True)


def test_explicit_head_dim(build):
    path = build(arch="qwen3", head_dim=32)
    assert AutoConfig.from_pretrained(path).head_dim == 32
    assert hf_logits(path).shape[-1] == 512


@pytest.mark.parametrize("layout", ["hf4", "hf5"])
def test_llama3_rope_scaling_is_applied_by_transformers(build, layout):
    path = build(arch="llama", rope_scaling="llama3", config_layout=layout)
    written = read_config(path)
    scaling = written["rope_scaling"] if layout == "hf4" else written["rope_parameters"]
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
    assert scaling["original_max_position_embeddings"] < written["max_position_embeddings"]
    rope = AutoConfig.from_pretrained(path).rope_parameters
    assert rope["rope_type"] == "llama3" and rope["original_max_position_embeddings"] == 64
    # Same weights, other rotary frequencies: transformers really applied the scaling.
    assert not torch.allclose(hf_logits(path), hf_logits(build(arch="llama", config_layout=layout)))


def test_tokenizer_round_trips_and_has_chat_template(build):
    path = build()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == tiny_model.TOKENIZER_SIZE <= read_config(path)["vocab_size"]
    for text in [
        "Hello, world!",
        "  two  spaces\n\ttab",
        "naïve café — 你好 🙂",
        "def f(x):\n    return x",
    ]:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
    assert (
        len(tokenizer.encode("The weather report for Tuesday"))
        < len("The weather report for Tuesday") / 2
    )
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode(chat)[0] == tiny_model.IM_START_ID
    assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())
    assert (tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token) == (
        "<|im_end|>",
        "<|endoftext|>",
        "<|endoftext|>",
    )


def test_eos_ids_in_configs(build):
    path = build()
    config, generation = read_config(path), GenerationConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert config["eos_token_id"] == tokenizer.eos_token_id == tiny_model.IM_END_ID
    assert generation.eos_token_id == [
        tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")
    ]
    assert generation.bos_token_id == config["bos_token_id"] == tokenizer.bos_token_id
    assert generation.pad_token_id == tokenizer.pad_token_id


def test_sharded_weights_load(tmp_path, build, monkeypatch):
    monkeypatch.setattr(tiny_model, "MAX_SHARD_BYTES", 100_000)
    path = make_model(tmp_path, arch="llama")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (path / "model.safetensors").exists()
    assert torch.equal(hf_logits(path), hf_logits(build(arch="llama")))


# Shape fields of the real checkpoints, and their parameter counts as published.
REAL_SHAPES = {
    "qwen3-0.6b": ("qwen3", 28, 1024, 3072, 16, 8, 128, 151936, True, None, 596_049_920),
    "qwen3-8b": ("qwen3", 36, 4096, 12288, 32, 8, 128, 151936, False, None, 8_190_735_360),
    "qwen3-30b-a3b": ("qwen3_moe", 48, 2048, 6144, 32, 4, 128, 151936, False, None, 30_532_122_624),
    "llama-3.2-1b": ("llama", 16, 2048, 8192, 32, 8, 64, 128256, True, "llama3", 1_235_814_400),
    "tinyllama-1.1b": ("llama", 22, 2048, 5632, 32, 4, None, 32000, False, None, 1_100_048_384),
}
SHAPE_FIELDS = (
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
)


@pytest.mark.parametrize("shape", FULL_SHAPES)
def test_full_shape_configs(shape):
    config = build_config(shape=shape)
    shipped = json.loads((tiny_model.CONFIG_DIR / shape / "config.json").read_text())
    *fields, rope_type, params = REAL_SHAPES[shape]
    assert (
        [config.get(key) for key in SHAPE_FIELDS]
        == [shipped.get(key) for key in SHAPE_FIELDS]
        == fields
    )
    for key in (
        "rope_theta",
        "rope_scaling",
        "rms_norm_eps",
        "max_position_embeddings",
        "torch_dtype",
    ):
        assert config[key] == shipped[key]
    assert config["torch_dtype"] == "bfloat16" and config["initializer_range"] == 0.02
    assert (config["rope_scaling"] or {}).get("rope_type") == rope_type
    assert sum(math.prod(s) for s in param_shapes(config).values()) == params
    with pytest.raises(ValueError):
        build_config("llama" if fields[0].startswith("qwen3") else "qwen3", shape)


@pytest.mark.parametrize("layout", ["hf4", "hf5"])
@pytest.mark.parametrize("shape", FULL_SHAPES)
def test_full_shape_names_match_transformers(tmp_path, shape, layout):
    config = build_config(shape=shape, config_layout=layout)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config["tie_word_embeddings"]:
        del expected["lm_head.weight"]
    assert stacked_experts(param_shapes(config)) == expected
    assert model.config.rope_parameters["rope_theta"] == (
        config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    )


def stacked_experts(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Per-expert checkpoint names folded into the stacked parameters that transformers 5 builds
    (experts.gate_up_proj: (experts, 2 * width, hidden), experts.down_proj: (experts, hidden, width))."""
    stacked = {}
    for name, shape in shapes.items():  # experts in increasing order: the last one sets the count
        match = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if not match:
            stacked[name] = shape
        elif match[3] == "down":
            stacked[f"{match[1]}.down_proj"] = (int(match[2]) + 1, *shape)
        else:
            stacked[f"{match[1]}.gate_up_proj"] = (int(match[2]) + 1, 2 * shape[0], shape[1])
    return stacked


@pytest.mark.parametrize("layout", ["hf4", "hf5"])
def test_tiny_moe_loads_in_transformers(build, layout):
    path = build(arch="qwen3_moe", config_layout=layout)
    config = read_config(path)
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and not config["tie_word_embeddings"]
    assert config["num_experts" if layout == "hf4" else "num_local_experts"] == 8
    assert ("num_local_experts" in config) is (layout == "hf5") and ("num_experts" in config) is (
        layout == "hf4"
    )
    names = tensor_names(path)
    assert {
        "model.layers.0.mlp.gate.weight",
        "model.layers.1.mlp.experts.7.down_proj.weight",
    } <= names
    assert not any(".mlp.gate_proj." in name for name in names)
    assert names == set(param_shapes(config))
    hf = AutoConfig.from_pretrained(path)
    assert (
        hf.num_experts,
        hf.num_experts_per_tok,
        hf.moe_intermediate_size,
        hf.norm_topk_prob,
    ) == (8, 2, 32, True)
    logits = hf_logits(path)  # load_hf asserts no missing, unexpected or mismatched keys
    assert torch.equal(logits, hf_logits(build(arch="qwen3_moe")))
    generated = load_hf(path).generate(PROMPT_IDS, max_new_tokens=24, do_sample=False)
    assert len(set(generated[0, PROMPT_IDS.shape[1] :].tolist())) > 4


def test_moe_dense_layers_and_overrides(build):
    path = build(
        arch="qwen3_moe",
        num_hidden_layers=3,
        mlp_only_layers=[1],
        num_experts=4,
        num_experts_per_tok=3,
        moe_intermediate_size=16,
        norm_topk_prob=False,
    )
    names = tensor_names(path)
    assert (
        "model.layers.1.mlp.gate_proj.weight" in names
        and "model.layers.1.mlp.gate.weight" not in names
    )
    assert {
        "model.layers.0.mlp.experts.3.up_proj.weight",
        "model.layers.2.mlp.gate.weight",
    } <= names
    assert "model.layers.0.mlp.experts.4.up_proj.weight" not in names
    with safe_open(path / "model.safetensors", "pt") as f:
        assert f.get_slice("model.layers.2.mlp.experts.0.down_proj.weight").get_shape() == [64, 16]
    load_hf(path)
    with pytest.raises(ValueError, match="apply to qwen3_moe"):
        build_config("qwen3", num_experts=4)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        build_config("qwen3_moe", num_experts_per_tok=9)


def test_full_shape_generation_config():
    generation = tiny_model._generation_config("qwen3-0.6b")
    assert generation["eos_token_id"] == [tiny_model.IM_END_ID, tiny_model.ENDOFTEXT_ID]
    assert generation["temperature"] == 0.6 and generation["top_k"] == 20


def test_cached_model_builds_once_and_atomically(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny_model, "MODELS_DIR", tmp_path)
    path = cached_model("tiny-llama", arch="llama")
    assert path == tmp_path / "tiny-llama" and (path / "model.safetensors").exists()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert cached_model("tiny-llama", arch="llama") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    cached_model("tiny-llama", arch="llama", seed=1)  # other arguments: rebuilt in place
    assert (path / "model.safetensors").stat().st_mtime_ns != stamp
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-llama"]  # no temporary directory left


def test_build_if_missing_keeps_other_directories(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(FileExistsError):
        build_if_missing(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_cli(tmp_path):
    tiny_model.main(
        [
            str(tmp_path),
            "--arch",
            "llama",
            "--untied",
            "--mha",
            "--derive-head-dim",
            "--rope-scaling",
            "llama3",
            "--layout",
            "hf5",
        ]
    )
    config = read_config(tmp_path)
    assert config["num_key_value_heads"] == config["num_attention_heads"] == 4
    assert "head_dim" not in config and not config["tie_word_embeddings"]
    assert config["rope_parameters"]["rope_type"] == "llama3"
    load_hf(tmp_path)


def test_cli_if_missing_matches_cached_model(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny_model, "MODELS_DIR", tmp_path)
    tiny_model.main(
        [str(tmp_path / "tiny-qwen3"), "--arch", "qwen3", "--shape", "tiny", "--if-missing"]
    )
    stamp = (tmp_path / "tiny-qwen3" / "model.safetensors").stat().st_mtime_ns
    cached_model("tiny-qwen3", arch="qwen3")  # same model, however it is asked for: kept
    tiny_model.main([str(tmp_path / "tiny-qwen3"), "--if-missing"])
    assert (tmp_path / "tiny-qwen3" / "model.safetensors").stat().st_mtime_ns == stamp


def test_cli_if_missing_reports_the_final_directory(tmp_path, capsys):
    out_dir = tmp_path / "models" / "tiny-qwen3"
    tiny_model.main([str(out_dir), "--if-missing"])
    printed = capsys.readouterr().out
    assert f"model, 0.1M parameters, in {out_dir} (" in printed  # not the temporary build directory
    assert ".tiny-qwen3-" not in printed
    assert [p.name for p in out_dir.parent.iterdir()] == ["tiny-qwen3"]
