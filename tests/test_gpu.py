"""GPU checks (skipped without CUDA): the Triton backend inside every paged engine
against Hugging Face, and CUDA-graph replay against eager execution."""

import pytest
import torch
from common import ENGINES, generate_and_compare, level, load_engine, random_prompts, stage_view

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("model", ["qwen3", "llama3-rope"])
@pytest.mark.parametrize("engine", [e for e in ENGINES if level(e) >= 3])
def test_triton_on_cuda_matches_hf(engine, model, model_dir, hf_greedy):
    """float32 on the GPU with tiny blocks, a KV budget that forces preemption and a
    token budget that forces chunked prefill (where the stage has them)."""
    st, path = load_engine(engine), model_dir(model)
    prompts = random_prompts([40, 3, 37, 21, 9, 30], seed=70)
    options = dict(
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        max_model_len=128,
        kvcache_block_size=4,
        num_kvcache_blocks=40,
        max_num_batched_tokens=32,
    )
    with st.LLM(path, **options) as llm:
        generate_and_compare(st, llm, path, prompts, hf_greedy, max_tokens=32)
        if level(engine) >= 3:
            assert sum(s["preemptions"] for s in llm.stats) > 0


@pytest.mark.parametrize("num_prompts", [1, 3, 8, 17, 40])
@pytest.mark.parametrize("engine", [e for e in ENGINES if level(e) >= 6])
def test_cudagraph_matches_eager(engine, num_prompts, model_dir):
    """Batch sizes on the ladder (1, 8) and off it (3 -> 4, 17 -> 32, 40 -> 48)."""
    st, path = load_engine(engine), model_dir("llama")
    prompts = random_prompts([4 + i % 13 for i in range(num_prompts)], seed=num_prompts)
    params = st.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    options = dict(device="cuda", dtype="float32", max_model_len=128, max_num_seqs=48)
    with st.LLM(path, enforce_eager=True, **options) as llm:
        eager = llm.generate(prompts, params, use_tqdm=False)
    with st.LLM(path, **options) as llm:
        graphed = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.model_runner.num_graph_replays > 0
    assert stage_view(graphed) == stage_view(eager)


def test_final_replays_steps_with_prompts(model_dir):
    """Prompts admitted beside running decodes and prompts chunked over several steps, replayed
    from the token-count graphs, give the eager engine's tokens; with cuda_graph_max_tokens=0
    only decode steps replay."""
    st, path = load_engine("final"), model_dir("llama")
    prompts = random_prompts([5 + (i * 37) % 90 for i in range(12)], seed=12)
    params = [
        st.SamplingParams(temperature=0.0, max_tokens=4 + i % 9, ignore_eos=True) for i in range(12)
    ]
    options = dict(
        device="cuda", dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64
    )
    with st.LLM(path, enforce_eager=True, **options) as llm:
        eager = llm.generate(prompts, params, use_tqdm=False)
    for max_tokens in (64, 0):
        with st.LLM(path, cuda_graph_max_tokens=max_tokens, **options) as llm:
            graphed = llm.generate(prompts, params, use_tqdm=False)
            replays = llm.engine.model_runner.cuda_graphs.num_replays
            assert replays["decode"] > 0 and (replays["prompt"] > 0) == (max_tokens > 0)
        assert stage_view(graphed) == stage_view(eager)


def test_final_freezes_what_lives_as_long_as_the_engine(model_dir):
    """On CUDA the model runner moves what exists once it is built out of the collector's reach
    (gc.freeze) and gives it back at shutdown; requests the engine serves stay collectable."""
    import gc

    st = load_engine("final")
    gc.unfreeze()
    with st.LLM(
        model_dir("llama"), device="cuda", dtype="float32", max_model_len=128, max_num_seqs=4
    ) as llm:
        frozen = gc.get_freeze_count()
        assert frozen > 1000
        llm.generate(
            random_prompts([8, 12], seed=3),
            st.SamplingParams(max_tokens=4, ignore_eos=True),
            use_tqdm=False,
        )
        assert (
            gc.get_freeze_count() <= frozen
        )  # none of what the requests allocated (frozen objects may still be freed)
    assert gc.get_freeze_count() == 0


def test_final_pdl_changes_no_token(model_dir, monkeypatch):
    """Kernels launched with programmatic dependent launch (kernels/launch.py) give the tokens of
    plain launches: bf16, CUDA graphs, seeded top-k/top-p and temperature-only rows, batches on
    and off the graph ladder."""
    from nanovllm_final.kernels import launch

    st, path = load_engine("final"), model_dir("qwen3")
    launch.pdl_args.cache_clear()
    if not launch.pdl_args(torch.device("cuda", torch.cuda.current_device()))["PDL"]:
        pytest.skip("no programmatic dependent launch on this GPU or Triton")
    prompts = random_prompts([5 + (i * 29) % 60 for i in range(11)], seed=21)
    params = [
        st.SamplingParams(
            temperature=0.8,
            top_k=20 if i % 2 else 0,
            top_p=0.9 if i % 2 else 1.0,
            seed=i,
            max_tokens=16,
            ignore_eos=True,
        )
        for i in range(11)
    ]
    outputs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("NANOVLLM_PDL", flag)
        launch.pdl_args.cache_clear()
        with st.LLM(
            path, device="cuda", dtype="bfloat16", max_model_len=128, max_num_seqs=16
        ) as llm:
            outputs[flag] = llm.generate(prompts, params, use_tqdm=False)
            assert llm.engine.model_runner.cuda_graphs.num_replays["prompt"] > 0
    launch.pdl_args.cache_clear()
    assert stage_view(outputs["1"]) == stage_view(outputs["0"])
