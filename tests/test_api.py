"""The public API's behaviours and its errors on bad input, for every engine."""

import json
import shutil

import pytest
from common import ENGINES, load_engine, random_prompts, stage_view


@pytest.fixture(params=ENGINES)
def st(request):
    return load_engine(request.param)


@pytest.fixture(scope="module")
def shared_llm_cache():
    return {}


@pytest.fixture
def llm(st, model_dir, shared_llm_cache):
    """One LLM per engine for the whole module (building one costs a model load)."""
    if st not in shared_llm_cache:
        shared_llm_cache[st] = st.LLM(model_dir("qwen3"), device="cpu", max_model_len=64)
    yield shared_llm_cache[st]


def test_outputs_in_prompt_order_with_text(st, llm):
    prompts = ["hello world", "the cat", "a"]
    outs = llm.generate(prompts, st.SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    for out in outs:  # the final engine's results add keys (finish_reason, metrics, ...)
        assert sorted(out) == ["text", "token_ids"] or (
            st.__name__ == "nanovllm_final" and {"text", "token_ids"} < set(out)
        )
    for prompt, out in zip(prompts, outs):
        single = llm.generate(
            [prompt], st.SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False
        )
        assert stage_view([out]) == stage_view(single)
        assert out["text"] == llm.tokenizer.decode(out["token_ids"], skip_special_tokens=True)


def test_string_and_token_prompts_agree(st, llm):
    ids = llm.tokenizer.encode("the quick brown fox", add_special_tokens=False)
    params = st.SamplingParams(temperature=0.0, max_tokens=6)
    a, b = stage_view(llm.generate(["the quick brown fox", ids], params, use_tqdm=False))
    assert a == b


def test_max_tokens_and_ignore_eos(st, llm):
    prompts = random_prompts([4, 6], seed=1)
    outs = llm.generate(
        prompts, st.SamplingParams(temperature=0.7, max_tokens=9, ignore_eos=True), use_tqdm=False
    )
    assert [len(o["token_ids"]) for o in outs] == [9, 9]


def test_stops_at_eos(st, llm):
    """With EOS allowed, a completion ends at its first EOS id or at max_tokens."""
    eos = set(llm.model_config.eos_token_ids)
    assert len(eos) == 2  # config and generation_config name different ids; both count
    outs = llm.generate(
        random_prompts([3] * 12, seed=2),
        st.SamplingParams(temperature=1.0, max_tokens=40),
        use_tqdm=False,
    )
    for out in outs:
        ids = out["token_ids"]
        hits = [i for i, t in enumerate(ids) if t in eos]
        assert (hits and hits[0] == len(ids) - 1) or (not hits and len(ids) == 40)


def test_per_prompt_sampling_params(st, llm):
    params = [st.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 5)]
    outs = llm.generate(random_prompts([3, 3], seed=3), params, use_tqdm=False)
    assert [len(o["token_ids"]) for o in outs] == [2, 5]


def test_stats_mark_prefill_steps(st, llm):
    """From 02 on, a step that feeds whole prompts is a prefill; the steps after it decode."""
    before = len(llm.stats)
    llm.generate(
        random_prompts([5, 3], seed=5),
        st.SamplingParams(max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    steps = llm.stats[before:]
    if st.__name__.endswith("01_naive"):  # no cache: every step feeds every token
        assert all("is_prefill" not in step for step in steps)
    else:
        assert [step["is_prefill"] for step in steps] == [True, False, False, False]


def test_empty_generate(st, llm):
    assert llm.generate([], st.SamplingParams(), use_tqdm=False) == []


def test_generation_stops_at_max_model_len(st, llm):
    prompt = random_prompts([60], seed=4)[0]
    out = llm.generate([prompt], st.SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)[
        0
    ]
    assert len(prompt) + len(out["token_ids"]) == 64


@pytest.mark.parametrize(
    "prompts, params, message",
    [
        ([[]], None, "is empty"),
        ([""], None, "is empty"),
        ([[1, 2, 10**6]], None, "outside the vocabulary"),
        ([[1, -1]], None, "outside the vocabulary"),
        ([list(range(3, 67))], None, "max_model_len"),
        (["a", "b"], "one-param-list", "2 prompts"),
        ("a string, not a list", None, "list of strings"),
        ([3.5], None, "string or a list of ints"),
    ],
)
def test_bad_prompts(st, llm, prompts, params, message):
    if params == "one-param-list":
        params = [st.SamplingParams()]
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine  # nothing was queued by a rejected call
    assert (
        not engine.has_unfinished_requests()
        if st.__name__ == "nanovllm_final"
        else engine.is_finished()
    )


@pytest.mark.parametrize(
    "kwargs, message", [(dict(temperature=-0.1), "temperature"), (dict(max_tokens=0), "max_tokens")]
)
def test_bad_sampling_params(st, kwargs, message):
    with pytest.raises(ValueError, match=message):
        st.SamplingParams(**kwargs)


def test_missing_model_dir(st, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        st.LLM(tmp_path / "nope", device="cpu")


@pytest.mark.parametrize(
    "remove, message",
    [
        ("config.json", "config.json"),
        ("model.safetensors", "safetensors"),
        ("tokenizer.json", "tokenizer"),
    ],
)
def test_incomplete_model_dir(st, model_dir, tmp_path, remove, message):
    path = tmp_path / "m"
    shutil.copytree(model_dir("qwen3"), path)
    (path / remove).unlink()
    if remove == "tokenizer.json":
        (path / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match=message):
        st.LLM(path, device="cpu")


def test_unsupported_architecture(st, model_dir, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(model_dir("qwen3"), path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["MistralForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM, LlamaForCausalLM"):
        st.LLM(path, device="cpu")


def test_missing_weights(st, model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "m"
    shutil.copytree(model_dir("qwen3"), path)
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match="lacks weights.*layers.1.self_attn.qkv_proj"):
        st.LLM(path, device="cpu")


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(dtype="int8"), "dtype"),
        (dict(attention_backend="magic"), "attention_backend"),
        (dict(max_num_sequences=4), "unknown engine option"),
    ],
)
def test_bad_engine_options(st, model_dir, options, message):
    with pytest.raises(ValueError, match=message):
        st.LLM(model_dir("qwen3"), device="cpu", **options)


def test_cuda_asked_without_cuda(st, model_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="CUDA is not available"):
        st.LLM(model_dir("qwen3"), device="cuda")


def test_command_line(st, model_dir, capsys):
    import importlib

    main = importlib.import_module(st.__name__ + ".__main__").main
    main(
        [
            "--model",
            str(model_dir("qwen3")),
            "--prompt",
            "hello",
            "--max-tokens",
            "4",
            "--device",
            "cpu",
            "--chat",
        ]
    )
    assert capsys.readouterr().out.startswith("### hello\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "/no/such/dir", "--prompt", "hi"])
    assert exit_info.value.code == 2


def test_generate_after_shutdown(st, model_dir):
    llm = st.LLM(model_dir("qwen3"), device="cpu", max_model_len=32)
    llm.shutdown()
    llm.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(["hi"], st.SamplingParams(max_tokens=2), use_tqdm=False)
