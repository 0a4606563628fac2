"""The OpenAI-compatible server (nanovllm_final.server), driven as a user would: a real
server process on 127.0.0.1 and a free port, the official `openai` client, raw sockets
for disconnects, prometheus_client's parser for /metrics. Outputs are compared with
`LLM.generate` on the same tiny model. Every wait below is bounded in time."""

import http.client
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nanovllm_final import LLM, SamplingParams

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 1024
MAX_PENDING = 33  # the 32-client test fits; the overload test fills it
ENGINE_ARGS = ["--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN), "--num-kvcache-blocks", "2048"]
WORDS = "lighthouse harbour bread flour water salt engine numbers music market apples onions basket token cache memory".split()
START_TIMEOUT_S = 180
NAME = "tiny-qwen3"


# ---- a server process ----

class ServerProcess:
    def __init__(self, model: pathlib.Path, log_path: pathlib.Path, *extra: str):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "wb")
        args = [sys.executable, "-m", "nanovllm_final.server", str(model), "--port", str(self.port),
                "--served-model-name", NAME, "--shutdown-timeout", "1", *ENGINE_ARGS, *extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.proc.poll() is None, f"the server exited with {self.proc.returncode}:\n{self.output()}"
            assert time.monotonic() < deadline, f"the server did not start in {START_TIMEOUT_S} s:\n{self.output()}"
            try:
                if get(self.base + "/health", timeout=1)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key="none", max_retries=0, timeout=60)

    def metrics(self) -> dict[str, float]:
        """Every sample as {"name{label=value}": value}."""
        status, text = get(self.base + "/metrics")
        assert status == 200
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return samples

    def wait_idle(self, baseline_blocks: float, timeout: float = 15.0) -> dict[str, float]:
        """Poll /metrics until nothing is in flight and the KV blocks are back to `baseline_blocks`."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["nanovllm_server_requests_in_flight"] == 0 and m["nanovllm_num_requests_running"] == 0 \
                    and m["nanovllm_kv_cache_blocks_used"] == baseline_blocks:
                return m
            assert time.monotonic() < deadline, f"the server did not go idle in {timeout} s: {m}"
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                raise AssertionError(f"the server did not stop within {timeout} s of {signal.Signals(sig).name}:\n{self.output()}")
        self.log.close()
        return self.proc.returncode


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def post(url: str, body: bytes | dict, timeout: float = 30.0) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


class RawRequest:
    """A completion request over a bare socket, so that the test can hang up mid-request."""

    def __init__(self, port: int, body: dict):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        data = json.dumps({"stream": True, **body}).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        self.sock.sendall(head.encode() + data)
        self.received = b""

    def read_until(self, count: int, marker: bytes = b"data: {", timeout: float = 30.0) -> bytes:
        deadline = time.monotonic() + timeout
        while self.received.count(marker) < count:
            assert time.monotonic() < deadline, f"no {count} x {marker!r} within {timeout} s: {self.received[-500:]!r}"
            chunk = self.sock.recv(65536)
            assert chunk, f"the server closed the stream: {self.received[-500:]!r}"
            self.received += chunk
        return self.received

    def close(self) -> None:
        self.sock.close()


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, from /proc."""
    parents = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (OSError, IndexError):
        return False


def prompts(count: int, seed: int) -> list[str]:
    return [" ".join(WORDS[(seed + i * 7 + j * 3) % len(WORDS)] for j in range(3 + i % 5)) for i in range(count)]


# ---- fixtures: one server and one reference engine for the module ----

@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir("qwen3")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    srv = ServerProcess(model, tmp_path_factory.mktemp("server") / "server.log", "--max-pending-requests", str(MAX_PENDING))
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
    assert got.usage.prompt_tokens == len(reference.tokenizer.encode(prompt, add_special_tokens=False))
    assert got.choices[0].finish_reason in ("stop", "length")

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Bake bread."}]
    want = generate(reference, reference.encode_chat(messages), temperature=0, max_tokens=12)
    got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want["text"]
    assert got.usage.prompt_tokens == len(reference.encode_chat(messages))
    assert got.usage.completion_tokens == len(want["token_ids"])


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=1234)], ids=["greedy", "seed"])
def test_streamed_equals_not_streamed(server, sampling):
    client = server.client()
    args = dict(model=NAME, max_tokens=16, **sampling)
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
    stream = client.chat.completions.create(messages=messages, stream=True, stream_options={"include_usage": True}, **args)
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
    got = client.completions.create(model=NAME, prompt="Mix the flour", max_tokens=8, temperature=0.8, seed=7, n=3, logprobs=2)
    assert sorted(c.index for c in got.choices) == [0, 1, 2]
    for c in got.choices:
        lp = c.logprobs
        assert 1 <= len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) <= 8
        assert all(v <= 0 for v in lp.token_logprobs)
        assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert got.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in got.choices)
    texts, finishes = {i: "" for i in range(3)}, {i: [] for i in range(3)}
    for chunk in client.completions.create(model=NAME, prompt="Mix the flour", max_tokens=8, temperature=0.8, seed=7, n=3,
                                           logprobs=2, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            finishes[c.index] += [c.finish_reason] if c.finish_reason else []
    assert texts == {c.index: c.text for c in got.choices}  # seeded: the same n completions, streamed
    assert finishes == {c.index: [c.finish_reason] for c in got.choices}  # one end per completion

    want = generate(reference, "The keeper", temperature=0, max_tokens=16)["text"]
    cut = want.strip().split(" ")[1] if len(want.strip().split(" ")) > 1 else None
    if cut:  # a stop string from the greedy output: the completion ends before it
        got = client.completions.create(model=NAME, prompt="The keeper", max_tokens=16, temperature=0, stop=[cut])
        assert got.choices[0].finish_reason == "stop"
        assert got.choices[0].text == want[: want.index(cut)]

    got = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens
    assert all(len(item.top_logprobs) == 3 and item.logprob <= 0 for item in content)


def test_32_concurrent_streams(server, reference):
    texts = prompts(32, seed=1)
    want = [out["text"] for out in reference.generate(texts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)]
    client = server.client()
    got: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            text = ""
            for chunk in client.completions.create(model=NAME, prompt=texts[i], max_tokens=8, temperature=0, stream=True):
                text += chunk.choices[0].text if chunk.choices else ""
            got[i] = text
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert sorted(got) == list(range(32))
    assert [got[i] for i in range(32)] == want


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
def test_disconnect_aborts_and_frees_blocks(server, stream):
    before = server.wait_idle(baseline_blocks=server.metrics()["nanovllm_kv_cache_blocks_used"])
    body = {"model": NAME, "prompt": "salt and time", "max_tokens": 1000, "ignore_eos": True, "temperature": 0, "stream": stream}
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
    baseline = server.metrics()["nanovllm_kv_cache_blocks_used"]
    body = {"model": NAME, "prompt": "numbers", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
    streams = [RawRequest(server.port, body) for _ in range(MAX_PENDING)]
    try:
        for s in streams:
            s.read_until(1)
        assert server.metrics()["nanovllm_server_requests_in_flight"] == MAX_PENDING
        status, answer = post(server.base + "/v1/completions", {"model": NAME, "prompt": "one more", "max_tokens": 4})
        assert status == 503
        assert answer["error"]["code"] == "overloaded"
    finally:
        for s in streams:
            s.close()
    server.wait_idle(baseline)
    assert post(server.base + "/v1/completions", {"model": NAME, "prompt": "again", "max_tokens": 4})[0] == 200


BAD_REQUESTS = [
    ("completions", b"{not json", None),
    ("completions", b"[1, 2]", None),
    ("completions", {"model": "no-such-model", "prompt": "hi"}, "model"),
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
    ("completions", {"model": NAME, "prompt": "hi", "echo": True}, "echo"),
    ("chat/completions", {"model": NAME, "messages": []}, "messages"),
    ("chat/completions", {"model": NAME, "messages": [{"content": "no role"}]}, "messages"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "frequency_penalty": -5}, "frequency_penalty"),
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
    long_prompt = " ".join(WORDS * 4)  # several full KV blocks: the second request finds them cached
    first = server.client().completions.create(model=NAME, prompt=long_prompt, max_tokens=6, temperature=0)
    second = server.client().completions.create(model=NAME, prompt=long_prompt + " twice", max_tokens=6, temperature=0)
    assert first.usage.prompt_tokens > 32
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    status, text = get(server.base + "/metrics")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in [("nanovllm_num_requests_running", "gauge"), ("nanovllm_num_requests_waiting", "gauge"),
                       ("nanovllm_kv_cache_usage_perc", "gauge"), ("nanovllm_prefix_cache_hit_rate", "gauge"),
                       ("nanovllm_num_preemptions", "counter"), ("nanovllm_generation_tokens", "counter"),
                       ("nanovllm_prompt_tokens", "counter"),
                       ("nanovllm_time_to_first_token_seconds", "histogram"), ("nanovllm_time_per_output_token_seconds", "histogram")]:
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
        stream = RawRequest(srv.port, {"model": NAME, "prompt": "bread", "max_tokens": 1000, "ignore_eos": True, "temperature": 0})
        stream.read_until(1)
        srv.proc.send_signal(signal.SIGTERM)
        data = stream.read_until(1, marker=b"data: [DONE]", timeout=30).decode()
        stream.close()
        events = [json.loads(line[len("data: "):]) for line in data.splitlines() if line.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] in ("abort", "length")
        assert srv.stop(timeout=30) == 0, srv.output()
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if alive(pid)], f"left behind: {children}"
    finally:
        srv.stop(signal.SIGKILL, timeout=10)
