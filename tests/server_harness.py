"""A server process for the tests, and bounded-in-time clients for it: urllib for plain
requests, raw sockets for streams that hang up or stop reading, /proc for process trees."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
from prometheus_client.parser import text_string_to_metric_families

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 1024
ENGINE_ARGS = [
    "--device",
    "cpu",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--num-kvcache-blocks",
    "2048",
]
WORDS = "lighthouse harbour bread flour water salt engine numbers music market apples onions basket token cache memory".split()
START_TIMEOUT_S = 180
NAME = "tiny-qwen3"


# ---- a server process ----


class ServerProcess:
    def __init__(
        self,
        model: pathlib.Path,
        log_path: pathlib.Path,
        *extra: str,
        entry: tuple[str, ...] = ("-m", "nanovllm_final.server"),
    ):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "wb")
        args = [
            sys.executable,
            *entry,
            str(model),
            "--port",
            str(self.port),
            "--served-model-name",
            NAME,
            "--shutdown-timeout",
            "1",
            *ENGINE_ARGS,
            *extra,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.proc.poll() is None, (
                f"the server exited with {self.proc.returncode}:\n{self.output()}"
            )
            assert time.monotonic() < deadline, (
                f"the server did not start in {START_TIMEOUT_S} s:\n{self.output()}"
            )
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
            if (
                m["nanovllm_server_requests_in_flight"] == 0
                and m["nanovllm_num_requests_running"] == 0
                and m["nanovllm_kv_cache_blocks_used"] == baseline_blocks
            ):
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
                raise AssertionError(
                    f"the server did not stop within {timeout} s of {signal.Signals(sig).name}:\n{self.output()}"
                )
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
    """A completion request over a bare socket, so that the test can hang up mid-request
    (`rcvbuf`: a small receive buffer, for a client that stops reading)."""

    def __init__(
        self, port: int, body: dict, path: str = "/v1/completions", rcvbuf: int | None = None
    ):
        self.sock = socket.socket()
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(30)
        self.sock.connect(("127.0.0.1", port))
        data = json.dumps({"stream": True, **body}).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        self.sock.sendall(head.encode() + data)
        self.received = b""

    def read_all(self, timeout: float = 30.0) -> bytes:
        """Everything until the server closes the connection or ends the stream."""
        deadline = time.monotonic() + timeout
        while not (
            b"data: [DONE]\n\n" in self.received and self.received.endswith(b"\r\n0\r\n\r\n")
        ):  # the last chunk
            assert time.monotonic() < deadline, (
                f"the stream did not end within {timeout} s: {self.received[-500:]!r}"
            )
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            self.received += chunk
        return self.received

    def events(self) -> list[dict]:
        """The data events received so far, parsed as strict JSON (no NaN)."""
        return [
            json.loads(line[len(b"data: ") :], parse_constant=_no_constant)
            for line in self.received.split(b"\n")
            if line.startswith(b"data: {")
        ]

    def read_until(self, count: int, marker: bytes = b"data: {", timeout: float = 30.0) -> bytes:
        deadline = time.monotonic() + timeout
        while self.received.count(marker) < count:
            assert time.monotonic() < deadline, (
                f"no {count} x {marker!r} within {timeout} s: {self.received[-500:]!r}"
            )
            chunk = self.sock.recv(65536)
            assert chunk, f"the server closed the stream: {self.received[-500:]!r}"
            self.received += chunk
        return self.received

    def close(self) -> None:
        self.sock.close()


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


async def stream_text(port: int, body: dict, timeout: float = 60.0) -> tuple[str, dict | None]:
    """A streamed completion over asyncio streams: its joined text and its usage."""
    import asyncio

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps({"stream": True, **body}).encode()
    writer.write(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
        + data
    )
    raw = await asyncio.wait_for(reader.read(-1), timeout)
    writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), raw[:300]
    text, usage = "", None
    for line in rest.split(b"\n"):  # chunked framing lines interleave; data lines are whole
        if line.startswith(b"data: {"):
            event = json.loads(line[len(b"data: ") :])
            assert "error" not in event, event
            text += "".join(c["text"] for c in event["choices"])
            usage = event.get("usage") or usage
    assert rest.rstrip().endswith(b"0") and b"data: [DONE]" in rest, rest[-200:]
    return text, usage


def children(pid: int) -> set[int]:
    """The live processes whose parent is `pid`."""
    found = set()
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid and alive(
                    int(entry.name)
                ):
                    found.add(int(entry.name))
            except (OSError, ValueError, IndexError):
                pass
    return found


def engine_pid(server_pid: int) -> int:
    """The engine core: the server's child that multiprocessing spawned and that is not its resource tracker."""
    for pid in children(server_pid):
        cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"spawn_main" in cmdline:
            return pid
    raise AssertionError(f"no engine process below {server_pid}: {children(server_pid)}")


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
    return [
        " ".join(WORDS[(seed + i * 7 + j * 3) % len(WORDS)] for j in range(3 + i % 5))
        for i in range(count)
    ]
