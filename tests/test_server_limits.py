"""Requests that could starve the others, an engine that hangs, and the smaller promises: big
batches and chat bodies are refused within 1 s while a normal request beside them keeps its
latency and /health keeps answering; a stopped engine (SIGSTOP) is found by the watchdog,
its requests get 503s and the server exits with code 1; a request past --request-timeout
gets a 504. On 127.0.0.1, every wait bounded in time; bodies are scaled down from the
megabytes a real client can send, with the limits scaled with them."""

import json
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from server_harness import NAME, ROOT, RawRequest, ServerProcess, alive, engine_pid, get, post

pytestmark = pytest.mark.xdist_group("processes")
LARGE = 65536  # --large-request-bytes: bodies above it are parsed on threads of their own
# a normal request beside the large bodies keeps twice its usual latency, or 1 s: decoding the
# bodies' JSON takes ~50 ms of CPU per MB, which it competes for (CI has 2 cores)
SHARED_CPU_S = 1.0
NORMAL = {
    "model": NAME,
    "prompt": "lighthouse harbour bread",
    "max_tokens": 8,
    "ignore_eos": True,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir("qwen3")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    # --model DIR, as `generate` takes it
    srv = ServerProcess(
        model,
        tmp_path_factory.mktemp("limits") / "server.log",
        "--max-request-bytes",
        str(4 << 20),
        "--large-request-bytes",
        str(LARGE),
        "--max-pending-requests",
        "64",
        entry=("-m", "nanovllm_final.server", "--model"),
    )
    yield srv
    assert srv.stop() == 0, srv.output()


def timed(fn) -> tuple[float, object]:
    start = time.monotonic()
    result = fn()
    return time.monotonic() - start, result


def beside(
    server, bodies: list[tuple[str, bytes]]
) -> tuple[list[tuple[float, tuple]], float, float]:
    """Send `bodies` (path, body) at once, and a normal request and /health polls beside them: each body's
    (seconds, (status, answer)), the normal request's seconds and the slowest /health."""
    answers: list = [None] * len(bodies)

    def send(i: int) -> None:
        answers[i] = timed(lambda: post(server.base + bodies[i][0], bodies[i][1], timeout=120))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    time.sleep(0.05)
    normal, (status, _) = timed(lambda: post(server.base + "/v1/completions", NORMAL))
    assert status == 200
    slowest = 0.0
    while any(t.is_alive() for t in threads):
        slowest = max(slowest, timed(lambda: get(server.base + "/health", timeout=30))[0])
        time.sleep(0.02)
    for t in threads:
        t.join()
    return answers, normal, slowest


def usual_latency(server) -> float:
    return sorted(
        timed(lambda: post(server.base + "/v1/completions", NORMAL))[0] for _ in range(3)
    )[1]


def test_a_huge_batch_is_refused_from_its_shape(server):
    """Four bodies of 150,000 one-character prompts: each a 400 naming `prompt` within 1 s (before
    any tokenizing), while a normal request keeps its latency and /health answers."""
    usual = usual_latency(server)
    body = json.dumps({"model": NAME, "prompt": ["a"] * 150_000, "max_tokens": 1}).encode()
    assert LARGE < len(body) < 4 << 20
    answers, normal, health = beside(server, [("/v1/completions", body)] * 4)
    for seconds, (status, answer) in answers:
        assert (
            status == 400
            and answer["error"]["param"] == "prompt"
            and "150000 prompts" in answer["error"]["message"]
        )
        assert seconds < 1.0, seconds
    assert normal < max(2 * usual, SHARED_CPU_S), (normal, usual)
    assert health < 1.0


def test_bodies_that_block_the_event_loop_are_parsed_off_it(server):
    """Bodies of 30,000 chat messages and of 100,000 token-id prompts, four at a time: refused
    within 1 s each; /health never waits 1 s; a normal request keeps its latency."""
    usual = usual_latency(server)
    rss = rss_mb(server.proc.pid)
    chat = json.dumps(
        {"model": NAME, "messages": [{"role": "user", "content": "a"}] * 30_000}
    ).encode()
    ids = json.dumps({"model": NAME, "prompt": [[5]] * 100_000}).encode()
    chat, ids = ("/v1/chat/completions", chat), ("/v1/completions", ids)
    answers, normal, health = beside(server, [chat, ids, chat, ids])
    for seconds, (status, answer) in answers:
        assert status == 400 and seconds < 1.0, (seconds, answer)
    assert health < 1.0 and normal < max(2 * usual, SHARED_CPU_S), (health, normal, usual)
    assert rss_mb(server.proc.pid) - rss < 250, "the API process kept what the bodies decoded to"


def rss_mb(pid: int) -> float:
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    return (
        int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])
        / 1024
    )


def test_large_bodies_waiting_are_bounded(server):
    """More large bodies than the large-body threads and their queue (2 + 8) take: the rest get a
    503 at once, so the memory large bodies hold is bounded."""
    body = json.dumps({"model": NAME, "prompt": ["word " * 4000] * 60, "max_tokens": 1}).encode()
    answers: list = []
    threads = [
        threading.Thread(
            target=lambda: answers.append(post(server.base + "/v1/completions", body, timeout=120))
        )
        for _ in range(16)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    codes = sorted(status for status, _ in answers)
    assert len(codes) == 16 and 503 in codes and set(codes) <= {200, 400, 503}, codes
    assert all(a["error"]["code"] == "overloaded" for s, a in answers if s == 503)


def test_a_client_leaving_a_plain_request_logs_no_traceback(server):
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            data = json.dumps({**NORMAL, "max_tokens": 500}).encode()
            sock.sendall(
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n".encode()
                + data
            )
            time.sleep(0.3)
    assert post(server.base + "/v1/completions", NORMAL)[0] == 200
    time.sleep(0.5)
    assert "InvalidStateError" not in server.output() and "Traceback" not in server.output(), (
        server.output()
    )


def test_an_unknown_model_is_404(server):
    status, answer = post(server.base + "/v1/completions", {**NORMAL, "model": "gpt-nothing"})
    assert status == 404 and answer["error"] == {
        "message": answer["error"]["message"],
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }, answer


def test_int8_kv_cache_is_a_clean_error(model):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanovllm_final",
            "serve",
            str(model),
            "--port",
            "0",
            "--device",
            "cpu",
            "--kv-cache-dtype",
            "int8",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "kv_cache_dtype" in out.stderr, out.stderr
    assert "Problem" not in out.stderr and "Traceback" not in out.stderr, out.stderr


# ---- an engine that hangs ----


def test_a_stopped_engine_trips_the_watchdog(model, tmp_path):
    """SIGSTOP the engine core with a stream and a plain request waiting: within the watchdog's
    limit (2 s) plus a little, both get a 503 (engine_hung), and the server exits with code 1."""
    srv = ServerProcess(model, tmp_path / "watchdog.log", "--watchdog-timeout", "2")
    try:
        engine = engine_pid(srv.proc.pid)
        stream = RawRequest(
            srv.port, {"model": NAME, "prompt": "salt", "max_tokens": 1000, "ignore_eos": True}
        )
        stream.read_until(1)
        subprocess.run(["kill", "-STOP", str(engine)], check=True)
        stopped = time.monotonic()
        answers: list = []
        plain = threading.Thread(
            target=lambda: answers.append(post(srv.base + "/v1/completions", NORMAL, timeout=30))
        )
        plain.start()
        stream.read_all(timeout=10)
        assert stream.events()[-1]["error"]["code"] == "engine_hung", stream.received[-300:]
        assert stream.received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        plain.join(10)
        assert (
            answers and answers[0][0] == 503 and answers[0][1]["error"]["code"] == "engine_hung"
        ), answers
        assert time.monotonic() - stopped < 6
        assert srv.proc.wait(20) == 1, srv.output()
        assert "exiting with code 1" in srv.output() and not alive(engine)
    finally:
        srv.stop(signal.SIGKILL, timeout=10)


def test_a_request_past_its_deadline_gets_504(model, tmp_path):
    """--request-timeout 1 with the engine stopped (the watchdog off): a 504 after 1 s; once the
    engine goes on, requests are served again."""
    srv = ServerProcess(
        model, tmp_path / "deadline.log", "--request-timeout", "1", "--watchdog-timeout", "0"
    )
    try:
        engine = engine_pid(srv.proc.pid)
        subprocess.run(["kill", "-STOP", str(engine)], check=True)
        seconds, (status, answer) = timed(
            lambda: post(srv.base + "/v1/completions", NORMAL, timeout=30)
        )
        subprocess.run(["kill", "-CONT", str(engine)], check=True)
        assert status == 504 and answer["error"]["code"] == "timeout" and 0.9 < seconds < 3, (
            seconds,
            answer,
        )
        assert post(srv.base + "/v1/completions", NORMAL)[0] == 200
        assert srv.stop() == 0, srv.output()
    finally:
        srv.stop(signal.SIGKILL, timeout=10)
