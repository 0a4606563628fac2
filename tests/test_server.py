"""The OpenAI-compatible server (nanovllm_final.server), driven as a user would: a real
server process on 127.0.0.1 and a free port, the official `openai` client, raw sockets
for disconnects, prometheus_client's parser for /metrics. Outputs are compared with
`LLM.generate` on the same tiny model. Every wait below is bounded in time."""

import asyncio
import json
import signal
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import (
    MAX_MODEL_LEN,
    NAME,
    WORDS,
    RawRequest,
    ServerProcess,
    alive,
    descendants,
    engine_pid,
    get,
    post,
    prompts,
    stream_text,
)

from nanovllm_final import LLM, SamplingParams

pytestmark = pytest.mark.xdist_group("processes")
MAX_PENDING = 200  # sequences: the 200-stream test fits, the overload test fills it


# ---- fixtures: one server and one reference engine for the module ----


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir("qwen3")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    srv = ServerProcess(
        model,
        tmp_path_factory.mktemp("server") / "server.log",
        "--max-pending-requests",
        str(MAX_PENDING),
    )
    yield srv
    code = srv.stop(signal.SIGINT)
    assert code == 0, f"SIGINT: exit code {code}\n{srv.output()}"


@pytest.fixture(scope="module")
def reference(model):
    llm = LLM(model, device="cpu", max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=2048)
    yield llm
    llm.shutdown()


def generate(llm: LLM, prompt, **params) -> dict:
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


# ---- the tests ----


def test_health_and_models(server):
    assert get(server.base + "/health")[0] == 200
    models = server.client().models.list()
    assert [m.id for m in models.data] == [NAME]


def test_completion_and_chat_match_generate(server, reference):
    client = server.client()
    prompt = "The old lighthouse"
    want = generate(reference, prompt, temperature=0, max_tokens=12)
    got = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    assert got.choices[0].text == want["text"]
    assert got.usage.completion_tokens == len(want["token_ids"])
    assert got.usage.prompt_tokens == len(
        reference.tokenizer.encode(prompt, add_special_tokens=False)
    )
    assert got.choices[0].finish_reason in ("stop", "length")

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Bake bread."},
    ]
    want = generate(reference, reference.encode_chat(messages), temperature=0, max_tokens=12)
    got = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=12, temperature=0
    )
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want["text"]
    assert got.usage.prompt_tokens == len(reference.encode_chat(messages))
    assert got.usage.completion_tokens == len(want["token_ids"])


@pytest.mark.parametrize(
    "sampling", [dict(temperature=0), dict(temperature=1.0, seed=1234)], ids=["greedy", "seed"]
)
def test_streamed_equals_not_streamed(server, sampling):
    client = server.client()
    # a client that reads late gets what arrived merged into one chunk: enough tokens that some arrive after the first read
    args = dict(model=NAME, max_tokens=64, **sampling)
    whole = client.completions.create(prompt="Ada Lovelace wrote", **args)
    text, reasons, usage, chunks = "", [], None, 0
    for chunk in client.completions.create(prompt="Ada Lovelace wrote", stream=True, **args):
        chunks += 1
        if chunk.choices:
            text += chunk.choices[0].text
            reasons.append(chunk.choices[0].finish_reason)
        usage = chunk.usage or usage
    assert chunks > 1  # it really streamed
    assert text == whole.choices[0].text
    assert reasons[-1] == whole.choices[0].finish_reason and not any(reasons[:-1])
    assert usage.completion_tokens == whole.usage.completion_tokens

    messages = [{"role": "user", "content": "Tell me about the market."}]
    whole = client.chat.completions.create(messages=messages, **args)
    text, roles, usage = "", [], None
    stream = client.chat.completions.create(
        messages=messages, stream=True, stream_options={"include_usage": True}, **args
    )
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            roles += [chunk.choices[0].delta.role] if chunk.choices[0].delta.role else []
        else:
            usage = chunk.usage  # include_usage: a last chunk with no choices
    assert roles == ["assistant"]
    assert text == whole.choices[0].message.content
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_logprobs_and_stop(server, reference):
    client = server.client()
    got = client.completions.create(
        model=NAME, prompt="Mix the flour", max_tokens=8, temperature=0.8, seed=7, n=3, logprobs=2
    )
    assert sorted(c.index for c in got.choices) == [0, 1, 2]
    for c in got.choices:
        lp = c.logprobs
        assert 1 <= len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) <= 8
        assert all(v <= 0 for v in lp.token_logprobs)
        # the top 2 and the chosen token, which OpenAI and vLLM list even outside the top k
        assert all(
            len(top) <= 3 and top[token] == value
            for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)
        )
    assert got.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in got.choices)
    texts, finishes = {i: "" for i in range(3)}, {i: [] for i in range(3)}
    for chunk in client.completions.create(
        model=NAME,
        prompt="Mix the flour",
        max_tokens=8,
        temperature=0.8,
        seed=7,
        n=3,
        logprobs=2,
        stream=True,
    ):
        for c in chunk.choices:
            texts[c.index] += c.text
            finishes[c.index] += [c.finish_reason] if c.finish_reason else []
    assert texts == {
        c.index: c.text for c in got.choices
    }  # seeded: the same n completions, streamed
    assert finishes == {c.index: [c.finish_reason] for c in got.choices}  # one end per completion

    want = generate(reference, "The keeper", temperature=0, max_tokens=16)["text"]
    cut = want.strip().split(" ")[1] if len(want.strip().split(" ")) > 1 else None
    if cut:  # a stop string from the greedy output: the completion ends before it
        got = client.completions.create(
            model=NAME, prompt="The keeper", max_tokens=16, temperature=0, stop=[cut]
        )
        assert got.choices[0].finish_reason == "stop"
        assert got.choices[0].text == want[: want.index(cut)]

    got = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens
    assert all(len(item.top_logprobs) == 3 and item.logprob <= 0 for item in content)


def first_stop(text: str) -> str:
    """A 2-character stop string from the middle of `text`, where it first occurs."""
    pairs = ((i, text[i : i + 2]) for i in range(3, len(text) - 2))
    return next(pair for i, pair in pairs if pair.strip() and text.find(pair) == i)


def test_stop_strings_cut_streamed_and_whole_alike(server, reference):
    """The text of a request with stop strings is decoded once, in the engine process; streamed
    or not, with echo or logprobs, the completion ends before the stop string, as offline."""
    client = server.client()
    stop = first_stop(generate(reference, "The keeper", temperature=0, max_tokens=24)["text"])
    want = generate(reference, "The keeper", temperature=0, max_tokens=24, stop=[stop])
    assert want["finish_reason"] == "stop"
    args = dict(
        model=NAME, prompt="The keeper", max_tokens=24, temperature=0, stop=[stop], logprobs=1
    )
    whole = client.completions.create(**args).choices[0]
    assert (whole.text, whole.finish_reason) == (want["text"], "stop")
    assert len(whole.logprobs.tokens) == len(want["token_ids"])
    assert "".join(whole.logprobs.tokens).startswith(want["text"])
    assert (
        client.completions.create(echo=True, **args).choices[0].text == "The keeper" + want["text"]
    )
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **args) if c.choices]
    assert "".join(c.text for c in chunks) == want["text"] and chunks[-1].finish_reason == "stop"
    assert sum(len(c.logprobs.tokens) for c in chunks) == len(want["token_ids"])

    messages = [{"role": "user", "content": "Tell me about the market."}]
    prompt = reference.encode_chat(messages)
    stop = first_stop(generate(reference, prompt, temperature=0, max_tokens=24)["text"])
    want = generate(reference, prompt, temperature=0, max_tokens=24, stop=[stop])["text"]
    args = dict(model=NAME, messages=messages, max_tokens=24, temperature=0, stop=stop)
    assert client.chat.completions.create(**args).choices[0].message.content == want
    streamed = [
        c.choices[0] for c in client.chat.completions.create(stream=True, **args) if c.choices
    ]
    assert (
        "".join(c.delta.content or "" for c in streamed) == want
        and streamed[-1].finish_reason == "stop"
    )


def test_200_concurrent_streams_match_offline_greedy_and_leave_nothing_behind(server, reference):
    """200 streams at once (one event loop of raw sockets), each the same text and token count as
    offline greedy; afterwards the engine holds no request and no KV block."""
    texts = prompts(200, seed=1)
    want = reference.generate(texts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)

    async def run_all():
        return await asyncio.gather(
            *(
                stream_text(
                    server.port,
                    {"model": NAME, "prompt": t, "max_tokens": 8, "temperature": 0},
                    timeout=90,
                )
                for t in texts
            )
        )

    got = asyncio.run(asyncio.wait_for(run_all(), 100))
    assert [text for text, _ in got] == [w["text"] for w in want]
    assert [usage["completion_tokens"] for _, usage in got] == [len(w["token_ids"]) for w in want]
    m = server.wait_idle(baseline_blocks=0)
    assert m["nanovllm_num_requests_running"] == 0 and m["nanovllm_num_requests_waiting"] == 0
    assert m["nanovllm_kv_cache_blocks_used"] == 0 and m["nanovllm_server_requests_in_flight"] == 0


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
def test_disconnect_aborts_and_frees_blocks(server, stream):
    before = server.wait_idle(baseline_blocks=server.metrics()["nanovllm_kv_cache_blocks_used"])
    body = {
        "model": NAME,
        "prompt": "salt and time",
        "max_tokens": 1000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }
    client = RawRequest(server.port, body)
    if stream:
        client.read_until(2)  # two chunks: it is generating
    deadline = time.monotonic() + 30
    while True:  # the engine holds KV blocks for it
        during = server.metrics()
        if during["nanovllm_kv_cache_blocks_used"] > before["nanovllm_kv_cache_blocks_used"]:
            break
        assert time.monotonic() < deadline, during
        time.sleep(0.05)
    assert during["nanovllm_server_requests_in_flight"] == 1
    client.close()
    after = server.wait_idle(before["nanovllm_kv_cache_blocks_used"])
    aborted = "nanovllm_request_success_total{finished_reason=abort}"
    assert after.get(aborted, 0) == before.get(aborted, 0) + 1


def test_overload_gets_503(server):
    """In-flight work is counted in sequences: four requests of n=50 fill the server."""
    baseline = server.metrics()["nanovllm_kv_cache_blocks_used"]
    body = {
        "model": NAME,
        "prompt": "numbers",
        "max_tokens": 1000,
        "ignore_eos": True,
        "temperature": 1.0,
        "n": MAX_PENDING // 4,
    }
    streams = [RawRequest(server.port, body) for _ in range(4)]
    try:
        for s in streams:
            s.read_until(1)
        assert server.metrics()["nanovllm_server_requests_in_flight"] == MAX_PENDING
        status, answer = post(
            server.base + "/v1/completions", {"model": NAME, "prompt": "one more", "max_tokens": 4}
        )
        assert status == 503
        assert answer["error"]["code"] == "overloaded"
    finally:
        for s in streams:
            s.close()
    server.wait_idle(baseline)
    assert (
        post(server.base + "/v1/completions", {"model": NAME, "prompt": "again", "max_tokens": 4})[
            0
        ]
        == 200
    )


BAD_REQUESTS = [
    ("completions", b"{not json", None),
    ("completions", b"[1, 2]", None),
    ("completions", {"model": NAME, "prompt": "word " * 2 * MAX_MODEL_LEN}, "prompt"),
    ("completions", {"model": NAME, "prompt": "hi", "max_tokens": 2 * MAX_MODEL_LEN}, "max_tokens"),
    ("completions", {"model": NAME, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"model": NAME, "prompt": "hi", "temperature": -1}, "temperature"),
    ("completions", {"model": NAME, "prompt": "hi", "temperature": "hot"}, "temperature"),
    ("completions", {"model": NAME, "prompt": "hi", "top_p": 1.5}, "top_p"),
    ("completions", {"model": NAME, "prompt": "hi", "n": 0}, "n"),
    ("completions", {"model": NAME, "prompt": "hi", "logprobs": 50}, "logprobs"),
    ("completions", {"model": NAME, "prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ("completions", {"model": NAME, "prompt": "hi", "min_p": 2}, "min_p"),
    ("completions", {"model": NAME, "prompt": "hi", "stop": 5}, "stop"),
    ("completions", {"model": NAME, "prompt": [1, 2, 10**6]}, "prompt"),
    ("completions", {"model": NAME, "prompt": ""}, "prompt"),
    ("completions", {"model": NAME}, "prompt"),
    ("completions", {"model": NAME, "prompt": "hi", "echo": True, "stream": True}, "echo"),
    ("chat/completions", {"model": NAME, "messages": []}, "messages"),
    ("chat/completions", {"model": NAME, "messages": [{"content": "no role"}]}, "messages"),
    (
        "chat/completions",
        {
            "model": NAME,
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 30,
        },
        "top_logprobs",
    ),
    (
        "chat/completions",
        {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "frequency_penalty": -5},
        "frequency_penalty",
    ),
]


def test_bad_requests_get_400_and_the_server_goes_on(server):
    rejected = "nanovllm_requests_rejected_total{reason=bad_request}"
    before = server.metrics().get(rejected, 0)
    for endpoint, body, param in BAD_REQUESTS:
        status, answer = post(f"{server.base}/v1/{endpoint}", body)
        assert status == 400, (body, answer)
        error = answer["error"]
        assert error["type"] == "invalid_request_error" and error["message"], (body, answer)
        if param is not None:
            assert error["param"] == param, (body, answer)
    assert server.metrics()[rejected] == before + len(BAD_REQUESTS)
    with pytest.raises(openai.BadRequestError):  # what the official client makes of it
        server.client().completions.create(model=NAME, prompt="hi", temperature=-1)
    assert get(server.base + "/health")[0] == 200
    got = server.client().completions.create(model=NAME, prompt="still here", max_tokens=4)
    assert got.usage.completion_tokens >= 1


def test_metrics_parse(server):
    long_prompt = " ".join(
        WORDS * 4
    )  # several full KV blocks: the second request finds them cached
    first = server.client().completions.create(
        model=NAME, prompt=long_prompt, max_tokens=6, temperature=0
    )
    second = server.client().completions.create(
        model=NAME, prompt=long_prompt + " twice", max_tokens=6, temperature=0
    )
    assert first.usage.prompt_tokens > 32
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    status, text = get(server.base + "/metrics")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in [
        ("nanovllm_num_requests_running", "gauge"),
        ("nanovllm_num_requests_waiting", "gauge"),
        ("nanovllm_kv_cache_usage_perc", "gauge"),
        ("nanovllm_prefix_cache_hit_rate", "gauge"),
        ("nanovllm_num_preemptions", "counter"),
        ("nanovllm_generation_tokens", "counter"),
        ("nanovllm_prompt_tokens", "counter"),
        ("nanovllm_time_to_first_token_seconds", "histogram"),
        ("nanovllm_time_per_output_token_seconds", "histogram"),
    ]:
        assert families[name].type == kind, name
    m = server.metrics()
    assert m["nanovllm_time_to_first_token_seconds_count"] >= 2
    assert m["nanovllm_time_per_output_token_seconds_count"] >= 2
    assert m["nanovllm_generation_tokens_total"] >= 12
    assert 0 <= m["nanovllm_kv_cache_usage_perc"] <= 1
    assert 0 < m["nanovllm_prefix_cache_hit_rate"] <= 1
    assert m["nanovllm_kv_cache_blocks_total"] == 2048


def test_sigterm_ends_streams_and_leaves_no_process(model, tmp_path):
    """Tensor parallelism over 2 CPU ranks (gloo): SIGTERM during a stream ends it with
    [DONE], the server exits 0, and the worker processes are gone."""
    srv = ServerProcess(model, tmp_path / "tp2.log", "--tensor-parallel-size", "2")
    try:
        children = descendants(srv.proc.pid)
        assert children, "a tensor-parallel server has worker processes"
        stream = RawRequest(
            srv.port,
            {
                "model": NAME,
                "prompt": "bread",
                "max_tokens": 1000,
                "ignore_eos": True,
                "temperature": 0,
            },
        )
        stream.read_until(1)
        srv.proc.send_signal(signal.SIGTERM)
        data = stream.read_until(1, marker=b"data: [DONE]", timeout=30).decode()
        stream.close()
        events = [
            json.loads(line[len("data: ") :])
            for line in data.splitlines()
            if line.startswith("data: {")
        ]
        assert events[-1]["choices"][0]["finish_reason"] in ("abort", "length")
        assert srv.stop(timeout=30) == 0, srv.output()
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if alive(pid)], f"left behind: {children}"
    finally:
        srv.stop(signal.SIGKILL, timeout=10)


def test_a_killed_server_takes_its_engine_and_workers_with_it(model, tmp_path):
    """SIGKILL of the API process (no cleanup runs there): the engine process sees its command
    pipe close and shuts down, its tensor-parallel workers with it."""
    srv = ServerProcess(model, tmp_path / "killed.log", "--tensor-parallel-size", "2")
    try:
        engine = engine_pid(srv.proc.pid)
        below = descendants(srv.proc.pid)
        assert len(below - {engine}) >= 1 and descendants(engine), (
            below
        )  # the engine and its worker
        stream = RawRequest(
            srv.port,
            {
                "model": NAME,
                "prompt": "bread",
                "max_tokens": 1000,
                "ignore_eos": True,
                "temperature": 0,
            },
        )
        stream.read_until(1)
        srv.proc.kill()
        srv.proc.wait(10)
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in below) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in below if alive(pid)], f"left behind: {below}"
        stream.close()
    finally:
        srv.stop(signal.SIGKILL, timeout=10)
