"""Qwen3-MoE on every engine: the config fields in both layouts, the router and the experts
against Hugging Face's modules, every expert's weights required, and greedy tokens equal to
Hugging Face's `Qwen3MoeForCausalLM` on the same random weights (float32, CPU), also under
preemption, chunked prefill, prefix hits and with TP=2 (gloo) for 07 and final."""

import json
import multiprocessing
import os
import shutil

import pytest
import torch
from common import (
    ENGINES,
    ROOT,
    check_chunked_prefill,
    check_preemption,
    check_shared_prefix,
    engine_module,
    generate_and_compare,
    level,
    load_engine,
    random_prompts,
    total,
)
from filelock import FileLock

from tools.tiny_model import build_config, build_if_missing

# name -> factory arguments; the tiny MoE shape has 8 experts of width 32, 2 per token, renormalised
MOE_MODELS = {
    "moe": dict(
        arch="qwen3_moe"
    ),  # every layer sparse; config.json as the hub ships it (num_experts)
    # layer 1 dense (mlp_only_layers), top-3 of 6 not renormalised; transformers 5's layout (num_local_experts)
    "moe-mixed": dict(
        arch="qwen3_moe",
        num_hidden_layers=3,
        mlp_only_layers=[1],
        num_experts=6,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        config_layout="hf5",
        seed=5,
    ),
}


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory):
    """moe_dir(name) -> a tiny MoE checkpoint (a key of MOE_MODELS), built once per session."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "moe_models"
    root.mkdir(parents=True, exist_ok=True)

    def build(name: str):
        with FileLock(root / f"{name}.lock"):
            return build_if_missing(root / name, shape="tiny", **MOE_MODELS[name])

    return build


# ---------------------------------------------------------------- config.json


@pytest.mark.parametrize("engine", ENGINES)
def test_config_layouts(engine):
    ModelConfig = engine_module(engine, "config").ModelConfig
    real = json.loads((ROOT / "tools" / "configs" / "qwen3-30b-a3b" / "config.json").read_text())
    cfg = ModelConfig.from_dict(real)
    assert (
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.moe_intermediate_size,
        cfg.norm_topk_prob,
    ) == (128, 8, 768, True)
    assert all(cfg.is_moe_layer(i) for i in range(48))
    hf5 = build_config(**{k: v for k, v in MOE_MODELS["moe-mixed"].items() if k != "seed"})
    assert "num_local_experts" in hf5 and "num_experts" not in hf5  # what transformers 5 writes
    cfg = ModelConfig.from_dict(hf5)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.mlp_only_layers) == (
        6,
        3,
        False,
        [1],
    )
    assert [cfg.is_moe_layer(i) for i in range(3)] == [True, False, True]
    dense = ModelConfig.from_dict(build_config("qwen3"))
    assert dense.num_experts == 0 and not dense.is_moe_layer(0)


@pytest.mark.parametrize(
    "fields",
    [
        dict(decoder_sparse_step=2),
        dict(decoder_sparse_step=3, mlp_only_layers=[2]),
        dict(mlp_only_layers=[0, 3]),
    ],
)
def test_sparse_layers_as_transformers_builds_them(fields):
    """Which layers hold experts: our rule against the modules transformers instantiates."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (
        Qwen3MoeDecoderLayer,
        Qwen3MoeSparseMoeBlock,
    )

    raw = build_config("qwen3_moe", num_hidden_layers=6, **fields)
    ours = engine_module("01_naive", "config").ModelConfig.from_dict(raw)
    hf = Qwen3MoeConfig(
        **{k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    )
    with torch.device("meta"):
        theirs = [
            isinstance(Qwen3MoeDecoderLayer(hf, i).mlp, Qwen3MoeSparseMoeBlock) for i in range(6)
        ]
    assert [ours.is_moe_layer(i) for i in range(6)] == theirs
    assert any(theirs) and not all(theirs)


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            dict(num_experts_per_tok=9),
            "num_experts_per_tok must be an integer from 1 to num_experts=8",
        ),
        (dict(num_experts_per_tok=0), "num_experts_per_tok"),
        (dict(decoder_sparse_step=0), "decoder_sparse_step must be a positive integer"),
        (dict(moe_intermediate_size=None), "lacks the required field 'moe_intermediate_size'"),
    ],
)
def test_bad_moe_fields(fields, message):
    raw = build_config("qwen3_moe")
    for key, value in fields.items():
        if value is None:
            del raw[key]
        else:
            raw[key] = value
    for engine in ("01_naive", "final"):
        with pytest.raises(ValueError, match=message):
            engine_module(engine, "config").ModelConfig.from_dict(raw)


# ---------------------------------------------------------------- the block against Hugging Face's


@pytest.mark.parametrize("engine", ["01_naive", "07_tensor_parallel", "final"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_sparse_block_equals_transformers(engine, renormalize):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    raw = build_config(
        "qwen3_moe", num_experts=6, num_experts_per_tok=3, norm_topk_prob=renormalize
    )
    cfg = engine_module(engine, "config").ModelConfig.from_dict(raw)
    ours = engine_module(engine, "models.transformer").SparseMoeBlock(cfg)
    hf = Qwen3MoeSparseMoeBlock(
        Qwen3MoeConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    )
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)  # [gate | up] rows, as ours
        ours.experts.down_proj.copy_(hf.experts.down_proj)
        x = torch.randn(1, 11, cfg.hidden_size, generator=g)
        expected = hf(x)[0]
        weights, ids = engine_module(engine, "layers.moe").route(ours.gate(x[0]), 3, renormalize)
        assert len(ids.unique()) > 3  # the tokens spread over the experts
        if renormalize:
            torch.testing.assert_close(weights.sum(-1), torch.ones(11))
        torch.testing.assert_close(ours(x[0]), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("engine", [e for e in ENGINES if 6 <= level(e) <= 7])
def test_captured_path_equals_the_loop(engine):
    """What a captured decode step of 06 and 07 runs (every expert on every token, weighted 0
    where the router did not choose it) equals the loop over the experts that received tokens."""
    experts = engine_module(engine, "layers.moe").Experts(6, 16, 8)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g))
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g))
    x = torch.randn(5, 16, generator=g)
    weights, ids = engine_module(engine, "layers.moe").route(
        torch.randn(5, 6, generator=g), 2, renormalize=False
    )
    assert len(ids.unique()) < 6  # some experts get no token
    torch.testing.assert_close(
        experts.forward_every_expert(x, weights, ids),
        experts(x, weights, ids),
        atol=1e-5,
        rtol=1e-5,
    )


def test_experts_on_cpu_take_the_loop(monkeypatch):
    """The final engine's fused kernels are for CUDA; a CPU tensor runs the reference loop."""
    moe = engine_module("final", "layers.moe")
    if moe.dispatch.moe is None:
        pytest.skip("no Triton here")

    def fail(*args):
        raise AssertionError("the fused path ran on CPU")

    monkeypatch.setattr(moe.dispatch.moe, "fused_experts", fail)
    experts = moe.Experts(4, 8, 6)
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    x, ids = torch.randn(3, 8), torch.tensor([[0, 1], [1, 2], [3, 0]])
    assert experts(x, torch.full((3, 2), 0.5), ids).shape == (3, 8)


# ---------------------------------------------------------------- loading


@pytest.mark.parametrize("engine", ["01_naive", "final"])
def test_every_expert_weight_is_required(engine, moe_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    st = load_engine(engine)
    path = tmp_path / "m"
    shutil.copytree(moe_dir("moe"), path)
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(
        ValueError,
        match=r"lacks weights for: model\.layers\.1\.mlp\.experts\.gate_up_proj \[\(5, 'up'\)\]",
    ):
        st.LLM(path, device="cpu", max_model_len=64)
    weights["model.layers.1.mlp.experts.5.up_proj.weight"] = weights[
        "model.layers.1.mlp.experts.4.up_proj.weight"
    ].clone()
    weights["model.layers.0.mlp.experts.8.down_proj.weight"] = weights[
        "model.layers.0.mlp.experts.0.down_proj.weight"
    ].clone()
    save_file(weights, path / "model.safetensors")
    with pytest.raises(
        ValueError, match="weights for expert 8, but config.json says num_experts=8"
    ):
        st.LLM(path, device="cpu", max_model_len=64)


# ---------------------------------------------------------------- greedy tokens equal Hugging Face's


@pytest.mark.parametrize("model", list(MOE_MODELS))
@pytest.mark.parametrize("engine", ENGINES)
def test_greedy_matches_hf(engine, model, moe_dir, hf_greedy):
    st, path = load_engine(engine), moe_dir(model)
    prompts = random_prompts([1, 9, 30, 17, 4], seed=100 + level(engine))
    with st.LLM(path, device="cpu", max_model_len=128) as llm:
        generate_and_compare(st, llm, path, prompts, hf_greedy)


@pytest.mark.parametrize("engine", ENGINES)
def test_preemption(engine, moe_dir, hf_greedy):
    check_preemption(engine, moe_dir("moe"), hf_greedy, seed=120)


@pytest.mark.parametrize("engine", ENGINES)
def test_chunked_prefill(engine, moe_dir, hf_greedy):
    check_chunked_prefill(engine, moe_dir("moe-mixed"), hf_greedy, seed=130)


@pytest.mark.parametrize("engine", ENGINES)
def test_shared_prefix(engine, moe_dir, hf_greedy):
    check_shared_prefix(engine, moe_dir("moe-mixed"), hf_greedy, seed=140)


def test_final_engine_with_fused_experts(moe_dir, hf_greedy, monkeypatch):
    """The fused kernels in place of the loop inside the final engine (on CPU under the Triton
    interpreter; on CUDA they are chosen by themselves): still Hugging Face's greedy tokens."""
    moe = engine_module("final", "layers.moe")
    if moe.dispatch.moe is None:
        pytest.skip("no Triton here")
    if torch.cuda.is_available():
        pytest.skip(
            "on CUDA the kernels take CUDA tensors only: test_final_on_cuda_fused_experts_in_cuda_graphs"
        )
    calls = []

    def fused(self, x, weights, expert_ids):
        calls.append(len(x))
        return moe.dispatch.moe.fused_experts(
            x, self.gate_up_proj, self.down_proj, weights, expert_ids
        )

    monkeypatch.setattr(moe.Experts, "forward", fused)
    st, path = load_engine("final"), moe_dir("moe-mixed")
    with st.LLM(path, device="cpu", max_model_len=64) as llm:
        generate_and_compare(
            st, llm, path, random_prompts([13, 5], seed=170), hf_greedy, max_tokens=6
        )
    assert len(calls) >= 2 * 6 and max(calls) >= 18  # both sparse layers, prefill and decode steps


# ---------------------------------------------------------------- tensor parallelism


@pytest.mark.xdist_group("processes")
@pytest.mark.skipif(
    (os.cpu_count() or 1) < 2, reason="TP=2 on CPU needs two cores (one process per rank)"
)
@pytest.mark.parametrize("engine", [e for e in ENGINES if level(e) >= 7])
def test_tp2_matches_hf(engine, moe_dir, hf_greedy):
    """Each rank holds half of every expert's width (the router whole); with chunked prefill."""
    st, path = load_engine(engine), moe_dir("moe-mixed")
    prompts = random_prompts([40, 3, 37, 21, 9], seed=150)
    with st.LLM(
        path,
        device="cpu",
        max_model_len=128,
        kvcache_block_size=4,
        max_num_batched_tokens=16,
        tensor_parallel_size=2,
    ) as llm:
        assert len(multiprocessing.active_children()) == 1  # rank 1
        block = llm.engine.model_runner.model.model.layers[0].mlp
        assert tuple(block.experts.gate_up_proj.shape) == (6, 32, 64) and tuple(
            block.experts.down_proj.shape
        ) == (6, 64, 16)
        assert tuple(block.gate.weight.shape) == (6, 64)  # the router is replicated
        generate_and_compare(st, llm, path, prompts, hf_greedy)
        assert total(llm, "chunked_prefills") > 0
    assert multiprocessing.active_children() == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_final_on_cuda_fused_experts_in_cuda_graphs(moe_dir, hf_greedy):
    """On CUDA the final engine runs the fused kernels, captured in its decode graphs (float32,
    so that greedy tokens still equal Hugging Face's on CPU)."""
    st, path = load_engine("final"), moe_dir("moe")
    with st.LLM(
        path, device="cuda", dtype="float32", max_model_len=128, attention_backend="triton"
    ) as llm:
        assert llm.engine.model_runner.cuda_graphs.graphs  # captured, with the fused MoE inside
        generate_and_compare(st, llm, path, random_prompts([1, 9, 30, 17, 4], seed=160), hf_greedy)
        assert llm.engine.model_runner.num_graph_replays > 0


@pytest.mark.parametrize("engine", [e for e in ENGINES if level(e) >= 7])
def test_tp_must_divide_expert_width(engine, moe_dir, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(moe_dir("moe"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"moe_intermediate_size": 33}))
    with pytest.raises(
        ValueError, match="tensor_parallel_size=2 must divide moe_intermediate_size=33"
    ):
        load_engine(engine).LLM(path, device="cpu", tensor_parallel_size=2)
