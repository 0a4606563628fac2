"""Every value is checked where it enters (SamplingParams, engine options, the checkpoint's
config.json and generation_config.json, each request), with a ValueError naming the field,
and no request can break, hang or starve the engine: one LLM is safe from two threads, and
its streams may be interleaved with each other and with generate."""

import itertools
import json
import math
import threading

import pytest
from common import ROOT, random_prompts

from nanovllm_final import LLM, SamplingParams
from nanovllm_final.config import EngineConfig, ModelConfig
from nanovllm_final.engine.front_end import validate_request
from nanovllm_final.sampling_params import MAX_N
from nanovllm_final.validate import Problem, options

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir("qwen3"), device="cpu", max_model_len=64, kvcache_block_size=4) as llm:
        yield llm


def within(seconds: float, fn, *args):
    """fn(*args) on a thread that must finish in time (a hang fails the test instead of stalling it)."""
    result = {}

    def run():
        try:
            result["value"] = fn(*args)
        except BaseException as err:  # noqa: BLE001 - re-raised below
            result["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} still running after {seconds} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


def tokens(outs: list[dict]) -> list[list[int]]:
    return [o["token_ids"] for o in outs]


# ---- SamplingParams: strict types, int64 integers, finite floats, sane ranges ----

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", 2**63),
        ("seed", 2**63),
        ("seed", -(2**63) - 1),
        ("stop_token_ids", [2**63]),
        ("max_tokens", 2**63),
        ("min_tokens", 2**64),
        ("logprobs", 2**63),
        ("n", MAX_N + 1),
        ("n", 10**6),
        ("temperature", NAN),
        ("temperature", INF),
        ("temperature", 1e300),
        ("top_p", NAN),
        ("top_p", 0.0),
        ("min_p", NAN),
        ("repetition_penalty", NAN),
        ("repetition_penalty", INF),
        ("repetition_penalty", 1e-300),
        ("presence_penalty", NAN),
        ("frequency_penalty", -INF),
        ("n", True),
        ("max_tokens", True),
        ("top_k", False),
        ("logprobs", True),
        ("stop_token_ids", [True]),
        ("max_tokens", "5"),
        ("temperature", "1"),
        ("seed", "0"),
        ("ignore_eos", "yes"),
        ("ignore_eos", 1),
        ("min_tokens", 1.0),
        ("stop", ""),
        ("stop", ["a", ""]),
        ("stop", [b"a"]),
        ("stop_token_ids", 5),
    ],
)
def test_sampling_params_refuse(field, value):
    with pytest.raises(Problem, match=field) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field and isinstance(info.value, ValueError)


def test_sampling_params_are_checked_when_set_later():
    params = SamplingParams(temperature=0.5)
    for field, value in (("temperature", NAN), ("top_k", 2**63), ("stop", "")):
        with pytest.raises(Problem, match=field):
            setattr(params, field, value)
    assert params.temperature == 0.5 and params.top_k is None and params.stop == []
    params.stop = "end"  # a string is a list of one
    assert params.stop == ["end"]


def test_sampling_params_take_the_limits():
    p = SamplingParams(
        n=MAX_N,
        seed=-(2**63),
        top_k=2**63 - 1,
        temperature=1e6,
        top_p=1e-6,
        repetition_penalty=1e-6,
        stop=[],
        stop_token_ids=(),
    )
    assert (p.n, p.stop, p.stop_token_ids) == (MAX_N, [], [])
    assert p.resolve({}, vocab_size=512).top_k == 0  # beyond the vocabulary: every token, like 0
    assert SamplingParams(top_k=511).resolve({}, vocab_size=512).top_k == 511


def test_options_list_every_field_with_help_and_type():
    listed = {o.name: o for o in options(SamplingParams)}
    assert list(listed) == [f for f in SamplingParams.__dataclass_fields__]
    assert all(o.help for o in listed.values())
    assert (
        listed["temperature"].annotation == float | None
        and listed["n"].default == 1
        and listed["n"].spec.high == MAX_N
    )
    assert {o.name for o in options(EngineConfig)} == set(EngineConfig.__dataclass_fields__) - {
        "model"
    }


# ---- engine options ----


@pytest.mark.parametrize(
    "options_, field",
    [
        (dict(gpu_memory_utilization="0.5"), "gpu_memory_utilization"),
        (dict(seed=2**70), "seed"),
        (dict(device="foo"), "device"),
        (dict(max_model_len=True), "max_model_len"),
        (dict(max_num_seqs="8"), "max_num_seqs"),
        (dict(enforce_eager="yes"), "enforce_eager"),
        (dict(num_kvcache_blocks=0), "num_kvcache_blocks"),
        (dict(distributed_port=70000), "distributed_port"),
        (dict(distributed_timeout=NAN), "distributed_timeout"),
        (dict(kvcache_block_size=4.0), "kvcache_block_size"),
    ],
)
def test_engine_options_refuse(model_dir, options_, field):
    with pytest.raises(ValueError, match=field) as info:
        LLM(model_dir("qwen3"), **({"device": "cpu"} | options_))
    assert info.value.param == field


# ---- the checkpoint's own files ----


def checkpoint_with(model_dir, tmp_path, name: str, edit) -> str:
    """The tiny checkpoint with one file changed (`edit(dict) -> dict`, or a str: the file's new text); the others linked."""
    source, path = model_dir("qwen3"), tmp_path / "m"
    path.mkdir()
    for file in source.iterdir():
        if file.name != name:
            (path / file.name).symlink_to(file)
    text = (
        edit if isinstance(edit, str) else json.dumps(edit(json.loads((source / name).read_text())))
    )
    (path / name).write_text(text)
    return path


@pytest.mark.parametrize(
    "name, edit, fields",
    [
        (
            "generation_config.json",
            lambda g: g | {"top_k": 2**63},
            ("generation_config.json", "top_k"),
        ),
        (
            "generation_config.json",
            lambda g: g | {"temperature": "hot"},
            ("generation_config.json", "temperature"),
        ),
        (
            "generation_config.json",
            lambda g: g | {"eos_token_id": [2, 99999]},
            ("generation_config.json", "eos_token_id"),
        ),
        ("config.json", lambda c: c | {"eos_token_id": -1}, ("config.json", "eos_token_id")),
        (
            "config.json",
            lambda c: c | {"max_position_embeddings": 0},
            ("config.json", "max_position_embeddings"),
        ),
        (
            "config.json",
            lambda c: c | {"num_attention_heads": True},
            ("config.json", "num_attention_heads"),
        ),
        (
            "config.json",
            lambda c: c | {"num_key_value_heads": 3},
            ("config.json", "num_key_value_heads"),
        ),
        ("config.json", lambda c: c | {"rope_theta": -1.0}, ("config.json", "rope_theta")),
        ("config.json", '{"vocab_size": 512,', ("config.json", "not valid JSON")),
        ("generation_config.json", "[1, 2]", ("generation_config.json", "JSON object")),
    ],
)
def test_bad_checkpoint_files_are_refused_naming_file_and_field(
    model_dir, tmp_path, name, edit, fields
):
    path = checkpoint_with(model_dir, tmp_path, name, edit)
    with pytest.raises(ValueError) as info:
        LLM(path, device="cpu")
    assert all(f in str(info.value) for f in fields), str(info.value)


def test_bad_model_argument_and_shard_index(model_dir, tmp_path):
    for model in (123, "", None):
        with pytest.raises(ValueError, match="model must be") as info:
            LLM(model, device="cpu")
        assert info.value.param == "model"
    path = checkpoint_with(model_dir, tmp_path, "model.safetensors.index.json", '{"weight_map": ')
    with pytest.raises(ValueError, match="model.safetensors.index.json is not valid JSON"):
        LLM(path, device="cpu")


def test_model_config_from_dict_checks_types():
    raw = json.loads((ROOT / "tools" / "configs" / "qwen3-0.6b" / "config.json").read_text())
    ModelConfig.from_dict(raw)
    for key, value in (
        ("vocab_size", "151936"),
        ("hidden_size", 0),
        ("architectures", "Qwen3ForCausalLM"),
        ("tie_word_embeddings", "yes"),
    ):
        with pytest.raises(ValueError, match=f"config.json: {key}"):
            ModelConfig.from_dict(raw | {key: value})


# ---- requests: the vocabulary, the context, once through validate_request ----


def test_requests_outside_the_model_are_refused_before_any_work(llm):
    vocab, engine = llm.model_config.vocab_size, llm.engine
    cases = [
        ([5, vocab], SamplingParams(), "prompt", "invalid_value"),
        (
            [5, 6],
            SamplingParams(min_tokens=1, stop_token_ids=[999999]),
            "stop_token_ids",
            "invalid_value",
        ),
        ([5, 6], SamplingParams(stop_token_ids=[vocab]), "stop_token_ids", "invalid_value"),
        ([5, 6], SamplingParams(logprobs=vocab + 1), "logprobs", "invalid_value"),
        (list(range(3, 67)), SamplingParams(), "prompt", "context_length_exceeded"),
        ([5, True], SamplingParams(), "prompt", "invalid_value"),
        ([5, 6], {"temperature": 0}, "sampling_params", "invalid_value"),
    ]
    for ids, params, param, code in cases:
        problem = validate_request(ids, params, llm.config, llm.model_config)
        assert (problem.param, problem.code) == (param, code), problem.message
        for submit in (
            lambda: engine.add_request(ids, params),
            lambda: llm.generate([ids], params, use_tqdm=False),
        ):
            with pytest.raises(Problem) as info:
                submit()
            assert (info.value.param, info.value.code) == (param, code)
    assert not engine.has_unfinished_requests()
    # a batch is queued all or nothing: the bad third prompt keeps the first two out
    with pytest.raises(Problem, match="prompt 2 has token ids"):
        llm.generate([[5, 6], [7, 8], [9, vocab]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert (
        validate_request(
            [5, vocab - 1],
            SamplingParams(stop_token_ids=[vocab - 1], logprobs=vocab),
            llm.config,
            llm.model_config,
        )
        is None
    )


def test_the_limits_sample_sensibly(llm):
    """top_k beyond the vocabulary keeps every token; the smallest top_p keeps the most likely one."""
    prompts = random_prompts([5, 8], seed=30)

    def run(**kw):
        params = SamplingParams(**({"temperature": 1.0, "seed": 3} | kw), max_tokens=6)
        return tokens(llm.generate(prompts, params, use_tqdm=False))

    assert run(top_k=2**63 - 1) == run(top_k=0) == run(top_k=llm.model_config.vocab_size)
    assert run(top_k=2) != run(top_k=0)  # top_k does take effect below the vocabulary
    assert run(top_p=1e-6) == run(min_p=1.0) == run(temperature=0.0)


def test_request_ids_never_collide(llm):
    engine, params = llm.engine, SamplingParams(max_tokens=2, **GREEDY)
    auto = engine.add_request([5, 6], params)
    user = engine.add_request(
        [7, 8], params, request_id=str(int(auto) + 1)
    )  # the id the counter gives next
    nxt = engine.add_request([9, 10], params)
    assert len({auto, user, nxt}) == 3
    for bad in (4, "", b"x"):
        with pytest.raises(Problem, match="request_id"):
            engine.add_request([5], params, request_id=bad)
    with pytest.raises(Problem, match="already in use"):
        engine.add_request([5], params, request_id=user)
    while engine.has_unfinished_requests():
        engine.step()


def test_abort_then_re_add_never_hands_out_the_stale_abort(llm):
    engine = llm.engine
    old, new = random_prompts([9, 6], seed=31)
    (expected,) = tokens(
        llm.generate([new], SamplingParams(max_tokens=5, **GREEDY), use_tqdm=False)
    )
    engine.add_request(old, SamplingParams(max_tokens=20, **GREEDY), request_id="x")
    engine.step()
    engine.abort_request("x")
    engine.add_request(new, SamplingParams(max_tokens=5, **GREEDY), request_id="x")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.outputs[0].finish_reason for o in outs if o.finished] == ["length"]
    assert outs[-1].prompt_token_ids == new and outs[-1].outputs[0].token_ids == expected


# ---- the LLM face ----


def test_chat_refuses_what_a_template_cannot_take(llm):
    for messages, match in (
        ([{"role": "user", "content": 5}], r"messages\[0\]\['content'\]"),
        ([{"role": 1, "content": "hi"}], r"messages\[0\]\['role'\]"),
    ):
        with pytest.raises(ValueError, match=match):
            llm.chat(messages, use_tqdm=False)
    with pytest.raises(ValueError, match="non-empty list"):
        llm.encode_chat([])
    with pytest.raises(Problem, match="chat_template_kwargs") as info:
        llm.chat(
            [{"role": "user", "content": "hi"}],
            chat_template_kwargs={"chat_template": "{{ 'x' }}"},
            use_tqdm=False,
        )
    assert info.value.param == "chat_template_kwargs"


def test_metrics_after_shutdown_is_a_clear_error(model_dir):
    llm = LLM(model_dir("qwen3"), device="cpu", max_model_len=32)
    llm.shutdown()
    for read in (llm.metrics, lambda: llm.stats, lambda: list(llm.stream([[5, 6]]))):
        with pytest.raises(RuntimeError, match="shut down"):
            read()


def test_generate_from_two_threads(llm):
    prompts = random_prompts([4, 9, 13, 6, 11, 7], seed=32)
    params = SamplingParams(max_tokens=8, **GREEDY)
    expected = tokens(llm.generate(prompts, params, use_tqdm=False))
    results = {}

    def worker(name: str, part: list[list[int]]):
        results[name] = [tokens(llm.generate(part, params, use_tqdm=False)) for _ in range(2)]

    threads = [
        threading.Thread(target=worker, args=("a", prompts[:3])),
        threading.Thread(target=worker, args=("b", prompts[3:])),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert results["a"] == [expected[:3]] * 2 and results["b"] == [expected[3:]] * 2
    assert not llm.engine.has_unfinished_requests()


def joined(events) -> list[int]:
    return sum((e["token_ids"] for e in events), [])


def test_interleaved_streams_each_get_all_of_their_outputs(llm):
    a, b = random_prompts([5, 9], seed=33)
    params = [SamplingParams(max_tokens=10, **GREEDY), SamplingParams(max_tokens=7, **GREEDY)]
    expected = tokens(llm.generate([a, b], params, use_tqdm=False))

    def interleave():
        pairs = list(itertools.zip_longest(llm.stream([a], params[0]), llm.stream([b], params[1])))
        return [[e for e, _ in pairs if e], [e for _, e in pairs if e]]

    events_a, events_b = within(60, interleave)
    assert [joined(events_a), joined(events_b)] == expected
    assert (
        events_a[-1]["finished"]
        and events_b[-1]["finished"]
        and sum(e["finished"] for e in events_a + events_b) == 2
    )
    # zip stops at the shorter stream: the other is closed, its request aborted and its blocks freed
    free = llm.engine.block_manager.num_free_blocks
    within(60, lambda: list(zip(llm.stream([a], params[0]), llm.stream([b], params[1]))))
    assert (
        not llm.engine.has_unfinished_requests()
        and llm.engine.block_manager.num_free_blocks == free
    )


def test_generate_while_a_stream_is_half_consumed(llm):
    a, b = random_prompts([6, 10], seed=34)
    params = SamplingParams(max_tokens=9, **GREEDY)
    expected = tokens(llm.generate([a, b], params, use_tqdm=False))

    def mixed():
        stream = llm.stream([a], params)
        first = [next(stream), next(stream)]
        middle = tokens(llm.generate([b], params, use_tqdm=False))
        return first + list(stream), middle

    events, middle = within(60, mixed)
    assert (
        middle == expected[1:]
        and joined(events) == expected[0]
        and events[-1]["finish_reason"] == "length"
    )
    assert not llm.engine.has_unfinished_requests()


def test_a_stream_left_early_frees_its_blocks(llm):
    free = llm.engine.block_manager.num_free_blocks
    for event in llm.stream(random_prompts([12], seed=35), SamplingParams(max_tokens=30, **GREEDY)):
        break
    assert event["token_ids"] and not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == free


def test_a_stream_closed_during_a_step_is_aborted_by_the_next(llm):
    """A stream collected in the middle of a step (by the garbage collector, say) must not
    change the engine under the step: its requests are aborted when the next step starts."""
    a, b = random_prompts([7, 5], seed=36)
    params = SamplingParams(max_tokens=8, **GREEDY)
    (expected,) = tokens(llm.generate([b], params, use_tqdm=False))
    free, engine = llm.engine.block_manager.num_free_blocks, llm.engine
    stream = llm.stream([a], params)
    next(stream)

    def step(*args, **kwargs):
        del engine.step  # the real one again
        stream.close()
        assert (
            engine.num_running + engine.num_waiting == 2
        )  # nothing aborted under the running step: a and b
        return engine.step(*args, **kwargs)

    engine.step = step
    assert tokens(within(60, llm.generate, [b], params, False)) == [expected]
    assert not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks == free
