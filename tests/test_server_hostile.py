"""The server against clients that do not play fair, and against an engine that dies: bad
bytes and types are 400s naming the field, bodies and n are bounded, slow or silent
connections are closed, a client that stops reading is cut off, a dead engine answers every
waiting request within 5 s and the server then exits with code 1, and signals always end
the server with code 0. On 127.0.0.1,
every wait bounded in time."""

import json
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from server_harness import (
    NAME,
    ROOT,
    RawRequest,
    ServerProcess,
    alive,
    descendants,
    engine_pid,
    get,
    post,
)

pytestmark = pytest.mark.xdist_group("processes")
MAX_PENDING = 16
MAX_BODY = 65536
MAX_NUM_SEQS = 8
MAX_CONNECTIONS = 12
HOSTILE_ARGS = [
    "--max-connections",
    str(MAX_CONNECTIONS),
    "--max-num-seqs",
    str(MAX_NUM_SEQS),
    "--max-pending-requests",
    str(MAX_PENDING),
    "--max-request-bytes",
    str(MAX_BODY),
    "--header-timeout",
    "1",
    "--body-timeout",
    "1",
    "--max-stream-backlog",
    "8",
]
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir("qwen3")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    srv = ServerProcess(model, tmp_path_factory.mktemp("hostile") / "server.log", *HOSTILE_ARGS)
    yield srv
    srv.stop(signal.SIGKILL, timeout=10)  # test_repeated_signals_exit_zero stops it first


def raw_post(port: int, path: str, body: bytes) -> tuple[int, dict]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + body
        )
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, rest = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(rest)


BAD = [
    ("completions", b'{"prompt": "\\ud800 lone", "max_tokens": 2}', None),  # a lone surrogate
    ("completions", b"[" * 20000 + b"]" * 20000, None),  # nested too deeply for a parser's stack
    (
        "completions",
        b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
        None,
    ),  # an int of 5000 digits
    ("completions", b'{"prompt": "hi", "temperature": NaN}', None),
    ("completions", b'{"prompt": "hi", "top_p": Infinity}', None),
    ("completions", {"prompt": [True, False]}, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 5.0}, "max_tokens"),
    ("completions", {"prompt": "hi", "ignore_eos": "yes"}, "ignore_eos"),
    ("completions", {"prompt": "hi", "temperature": True}, "temperature"),
    ("completions", {"prompt": "hi", "stop": ""}, "stop"),
    ("completions", {"prompt": "hi", "stop": ["x" * 513]}, "stop"),
    ("completions", {"prompt": "hi", "stop": [str(i) for i in range(17)]}, "stop"),
    ("completions", {"prompt": "hi", "n": MAX_NUM_SEQS + 1}, "n"),  # more than one batch
    (
        "completions",
        {"prompt": ["a", "b", "c"], "n": MAX_PENDING // 3 + 1},
        "n",
    ),  # more sequences than the server takes
    ("completions", {"prompt": "hi", "max_tokens": 10**100}, "max_tokens"),
    ("chat/completions", {"messages": CHAT, "chat_template": "{{ 'x' }}"}, "chat_template"),
    (
        "chat/completions",
        {
            "messages": CHAT,
            "chat_template_kwargs": {
                "chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
            },
        },
        "chat_template_kwargs",
    ),
    (
        "chat/completions",
        {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}},
        "chat_template_kwargs",
    ),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("chat/completions", {"messages": CHAT, "stream": "yes"}, "stream"),
    (
        "chat/completions",
        {"messages": CHAT, "tool_choice": "required"},
        "tool_choice",
    ),  # no tools to call
    (
        "chat/completions",
        {"messages": CHAT, "functions": [{"name": "f", "parameters": {}}]},
        "functions",
    ),
]


@pytest.mark.parametrize("endpoint, body, param", BAD, ids=range(len(BAD)))
def test_hostile_bodies_get_400_naming_the_field(server, endpoint, body, param):
    data = body if isinstance(body, bytes) else json.dumps({"model": NAME, **body}).encode()
    start = time.monotonic()
    status, answer = raw_post(server.port, f"/v1/{endpoint}", data)
    assert status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"], answer
    if param is not None:
        assert answer["error"]["param"] == param, answer
    assert time.monotonic() - start < 5
    assert get(server.base + "/health", timeout=2)[0] == 200


def test_bodies_are_bounded(server):
    rejected = "nanovllm_requests_rejected_total{reason=bad_request}"
    before = server.metrics().get(rejected, 0)
    start = time.monotonic()
    # a Content-Length past the limit is refused before any body is read
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {100 * MAX_BODY}\r\n\r\n".encode()
        )
        answer = b""
        while b"request_too_large" not in answer and (chunk := sock.recv(4096)):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer, answer
    # a chunked body is counted as it comes: the server stops reading past the limit
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        answer = b""
        try:
            for _ in range(100):  # up to 100 x the limit
                sock.sendall(b"%x\r\n%s\r\n" % (MAX_BODY, b"a" * MAX_BODY))
                if select.select([sock], [], [], 0.05)[0]:
                    break
            answer = sock.recv(4096)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server closed with our bytes unread: its answer may be lost in the reset
        assert answer == b"" or answer.startswith(b"HTTP/1.1 413"), answer
    assert server.metrics()[rejected] == before + 2
    assert time.monotonic() - start < 5
    assert (
        post(
            server.base + "/v1/completions",
            {"model": NAME, "prompt": "still fine", "max_tokens": 2},
        )[0]
        == 200
    )


def closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> bytes:
    """Wait for the server to close `sock` (sending `trickle` one byte per 0.2 s meanwhile);
    returns what it sent before closing."""
    deadline, received = time.monotonic() + seconds, b""
    sock.settimeout(0.2)
    for i in range(10**6):
        assert time.monotonic() < deadline, f"the connection is still open after {seconds} s"
        if i < len(trickle):
            sock.sendall(trickle[i : i + 1])
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk
    return received


def test_silent_and_slow_connections_are_closed(server):
    """Header timeout 1 s and body timeout 1 s: idle, slowloris and slow-body connections go."""
    with socket.create_connection(("127.0.0.1", server.port)) as idle:
        closed_within(idle, 5)
    with socket.create_connection(("127.0.0.1", server.port)) as loris:
        closed_within(
            loris,
            5,
            trickle=b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 100,
        )
    with socket.create_connection(("127.0.0.1", server.port)) as slow_body:
        slow_body.sendall(
            b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"prompt"'
        )
        answer = closed_within(slow_body, 5)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    with socket.create_connection(
        ("127.0.0.1", server.port)
    ) as keep_alive:  # a served connection, then idle
        keep_alive.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert closed_within(keep_alive, 8).startswith(b"HTTP/1.1 200")
    assert get(server.base + "/health", timeout=2)[0] == 200


def test_a_flood_of_connections_keeps_health_and_answers_json(server):
    """Past --max-connections: idle connections (a flood of silent ones) are closed to make
    room, so /health and a completion are answered at once; while every connection is busy
    (bodies on their way), a request gets OpenAI's error object with a 503 and /health a 200."""
    body = {"model": NAME, "prompt": "hi", "max_tokens": 2}
    idle = [
        socket.create_connection(("127.0.0.1", server.port)) for _ in range(MAX_CONNECTIONS * 3)
    ]
    try:
        time.sleep(0.3)  # accepted by the server
        start = time.monotonic()
        assert get(server.base + "/health", timeout=5)[0] == 200
        assert post(server.base + "/v1/completions", body, timeout=5)[0] == 200
        assert time.monotonic() - start < 1.0
    finally:
        for sock in idle:
            sock.close()
    busy = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in (
            busy
        ):  # headers and part of the body: a request in progress (for the body timeout, 1 s)
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
            )
        time.sleep(0.2)
        status, answer = post(server.base + "/v1/completions", body, timeout=5)
        assert status == 503 and answer["error"]["code"] == "too_many_connections", answer
        assert get(server.base + "/health", timeout=5)[0] == 200
    finally:
        for sock in busy:
            sock.close()
    deadline = time.monotonic() + 10
    while post(server.base + "/v1/completions", body, timeout=5)[0] != 200:
        assert time.monotonic() < deadline, "the busy connections were not cleared"
        time.sleep(0.2)


def test_a_client_that_stops_reading_is_cut_off(server):
    """A stream whose client reads nothing piles up; past the backlog it is aborted and its
    blocks freed, while another client is served."""
    before = server.wait_idle(baseline_blocks=server.metrics()["nanovllm_kv_cache_blocks_used"])
    body = {
        "model": NAME,
        "prompt": "apples",
        "max_tokens": 1000,
        "ignore_eos": True,
        "temperature": 1.0,
        "n": 4,
        "logprobs": 5,
    }
    stuck = RawRequest(server.port, body, rcvbuf=2048)
    try:
        assert (
            post(
                server.base + "/v1/completions",
                {"model": NAME, "prompt": "meanwhile", "max_tokens": 4},
            )[0]
            == 200
        )
        cut = "nanovllm_requests_rejected_total{reason=slow_reader}"
        deadline = time.monotonic() + 60
        while server.metrics().get(cut, 0) == before.get(cut, 0):
            assert time.monotonic() < deadline, "the stuck client was not cut off"
            time.sleep(0.2)
        after = server.wait_idle(before["nanovllm_kv_cache_blocks_used"])
        aborted = "nanovllm_request_success_total{finished_reason=abort}"
        assert after[aborted] == before.get(aborted, 0) + 1
        stuck.read_all(
            timeout=10
        )  # the client reads on: its stream ends with an error event, then [DONE]
        assert stuck.events()[-1]["error"]["code"] == "slow_reader", stuck.received[-300:]
        assert stuck.received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), stuck.received[-100:]
    finally:
        stuck.close()


def test_in_flight_counts_sequences(server):
    baseline = server.metrics()["nanovllm_kv_cache_blocks_used"]
    body = {
        "model": NAME,
        "prompt": "numbers",
        "max_tokens": 1000,
        "ignore_eos": True,
        "temperature": 1.0,
        "n": MAX_PENDING // 2,
    }
    full = [RawRequest(server.port, body)]
    try:
        full[0].read_until(1)
        full.append(RawRequest(server.port, body))  # waits in the engine: max_num_seqs runs at once
        deadline = time.monotonic() + 10
        while server.metrics()["nanovllm_server_requests_in_flight"] < MAX_PENDING:
            assert time.monotonic() < deadline, server.metrics()
            time.sleep(0.05)
        assert server.metrics()["nanovllm_num_requests_waiting"] == MAX_PENDING // 2
        status, answer = post(
            server.base + "/v1/completions", {"model": NAME, "prompt": "one more", "max_tokens": 2}
        )
        assert status == 503 and answer["error"]["code"] == "overloaded", answer
    finally:
        for f in full:
            f.close()
    server.wait_idle(baseline)


def test_bad_ports_are_clear_errors(model):
    out = subprocess.run(
        [sys.executable, "-m", "nanovllm_final.server", str(model), "--port", "70000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        out.returncode == 2
        and "--port" in out.stderr
        and "70000" in out.stderr
        and "Traceback" not in out.stderr
    ), out.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "nanovllm_final.server",
                str(model),
                "--port",
                str(port),
                "--device",
                "cpu",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert (
        out.returncode == 2
        and f"cannot listen on 127.0.0.1:{port}" in out.stderr
        and "Traceback" not in out.stderr
    ), out.stderr


def test_repeated_signals_exit_zero(server):
    """SIGTERM during a stream, then SIGTERM and SIGINT again and again while it cleans up: code 0."""
    stream = RawRequest(
        server.port,
        {"model": NAME, "prompt": "salt", "max_tokens": 1000, "ignore_eos": True, "temperature": 0},
    )
    stream.read_until(1)
    deadline = time.monotonic() + 60
    for i in range(10**6):
        if server.proc.poll() is not None:
            break
        assert time.monotonic() < deadline, server.output()
        server.proc.send_signal(signal.SIGINT if i % 3 == 2 else signal.SIGTERM)
        time.sleep(0.1)
    stream.close()
    assert server.proc.wait(10) == 0, server.output()


# ---- an engine that dies ----


@pytest.fixture(scope="module")
def nan_model(model, tmp_path_factory):
    """The tiny model with a NaN final norm: every logit, and every logprob, is NaN."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("nan") / "model"
    shutil.copytree(model, path)
    weights = load_file(path / "model.safetensors")
    weights["model.norm.weight"].fill_(float("nan"))
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def fragile(nan_model, tmp_path_factory):
    srv = ServerProcess(
        nan_model, tmp_path_factory.mktemp("fragile") / "server.log", "--max-pending-requests", "64"
    )
    yield srv
    srv.stop(signal.SIGKILL, timeout=10)  # the engine's death ended it already


def test_nan_logprobs_stream_as_valid_json(fragile):
    stream = RawRequest(
        fragile.port,
        {"model": NAME, "prompt": "water", "max_tokens": 4, "temperature": 0, "logprobs": 2},
    )
    stream.read_all()
    events = stream.events()  # a strict parser: NaN would fail here
    stream.close()
    assert events and all("choices" in e for e in events), events
    entries = [
        lp
        for e in events
        for c in e["choices"]
        if c["logprobs"]
        for lp in c["logprobs"]["token_logprobs"]
    ]
    assert entries and all(lp is None for lp in entries)  # NaN, written as null


def end_with_engine_dead(streams: list[RawRequest], cause: str, timeout: float) -> None:
    """Each stream ends (within `timeout`) with an engine_dead error event naming `cause`, then [DONE]."""
    for s in streams:
        s.read_all(timeout=timeout)
        last = s.events()[-1]
        assert last["error"]["code"] == "engine_dead" and cause in last["error"]["message"], last
        assert s.received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), s.received[-100:]
        s.close()


def test_a_dead_engine_answers_every_waiting_request_within_5s(fragile):
    """Streams, plain requests and requests sent just before: all answered within 5 s of the
    engine process's death, with a 503 (or a stream's error event) that names the cause."""
    long = {
        "model": NAME,
        "prompt": "bread",
        "max_tokens": 1000,
        "ignore_eos": True,
        "temperature": 0,
    }
    streams = [RawRequest(fragile.port, long) for _ in range(4)]
    for s in streams:
        s.read_until(1)
    answers: list[tuple[float, int, dict]] = []

    def plain() -> None:
        status, answer = post(fragile.base + "/v1/completions", long, timeout=30)
        answers.append((time.monotonic(), status, answer))

    threads = [threading.Thread(target=plain) for _ in range(12)]
    for t in threads[:6]:
        t.start()
    time.sleep(0.3)  # these run; the next ones are on their way as the engine dies
    for t in threads[6:]:
        t.start()
    engine = engine_pid(fragile.proc.pid)
    subprocess.run(["kill", "-9", str(engine)], check=True)
    killed = time.monotonic()
    end_with_engine_dead(streams, "exited", timeout=5)
    for t in threads:
        t.join(max(0.1, killed + 5 - time.monotonic()))
    assert len(answers) == len(threads), (
        f"{len(threads) - len(answers)} requests not answered within 5 s"
    )
    for when, status, answer in answers:
        assert status == 503 and answer["error"]["code"] == "engine_dead", answer
        assert when - killed < 5
    assert_exits_with_1(fragile, "exited")


def assert_exits_with_1(srv: ServerProcess, cause: str) -> None:
    """After the engine's death the server exits by itself with code 1, saying why (a supervisor restarts it)."""
    try:
        code = srv.proc.wait(15)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"the server did not exit after its engine died:\n{srv.output()}"
        ) from None
    assert code == 1 and "exiting with code 1" in srv.output() and cause in srv.output(), (
        code,
        srv.output(),
    )


def test_a_failed_step_answers_every_waiting_request_with_its_cause(model, tmp_path):
    """The engine's step raises (tests/server_poisoned.py) while streams run and more requests
    are on their way: every one is answered within 5 s with a 503 that says what failed, and
    the server exits with code 1."""
    srv = ServerProcess(
        model,
        tmp_path / "poisoned.log",
        "--max-pending-requests",
        "64",
        entry=(str(ROOT / "tests" / "server_poisoned.py"),),
    )
    try:
        long = {
            "model": NAME,
            "prompt": "bread",
            "max_tokens": 1000,
            "ignore_eos": True,
            "temperature": 0,
        }
        streams = [RawRequest(srv.port, long) for _ in range(3)]
        for s in streams:
            s.read_until(1)
        answers: list[tuple[int, dict]] = []
        bodies = (
            [long] * 8 + [{**long, "prompt": [7, 7, 7, 7, 5]}] + [long] * 8
        )  # the poison, with requests before and after
        threads = [
            threading.Thread(
                target=lambda b=b: answers.append(post(srv.base + "/v1/completions", b, timeout=30))
            )
            for b in bodies
        ]
        for t in threads:
            t.start()
        start = time.monotonic()
        end_with_engine_dead(streams, "injected fault", timeout=30)
        failed = time.monotonic()
        for t in threads:
            t.join(max(0.1, failed + 5 - time.monotonic()))
        assert len(answers) == len(bodies), (
            f"{len(bodies) - len(answers)} requests not answered within 5 s of the failure"
        )
        for status, answer in answers:
            assert status == 503 and "injected fault" in answer["error"]["message"], answer
        assert time.monotonic() - start < 30
        assert_exits_with_1(srv, "injected fault")
    finally:
        srv.stop(signal.SIGKILL, timeout=10)


def test_sigterm_while_the_engine_loads_leaves_no_process(model, tmp_path):
    """SIGTERM as soon as the engine process exists (it is building the engine, or just has):
    the server exits promptly (130 while loading, 0 once serving) and leaves no process behind."""
    log = open(tmp_path / "loading.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nanovllm_final.server",
            str(model),
            "--port",
            "0",
            "--device",
            "cpu",
            "--tensor-parallel-size",
            "2",
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (
                tmp_path / "loading.log"
            ).read_text()
            try:
                engine = engine_pid(proc.pid)
                break
            except AssertionError:
                time.sleep(0.05)
        below = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(45) in (0, 130), (tmp_path / "loading.log").read_text()
        deadline = time.monotonic() + 15
        while any(alive(pid) for pid in below | {engine}) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in below | {engine} if alive(pid)]
    finally:
        proc.kill()
        proc.wait(10)
        log.close()
