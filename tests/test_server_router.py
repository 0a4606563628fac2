"""Two CPU replicas of the course model behind sglang-router (the `router` extra), on
127.0.0.1: the router's answers equal a direct request's, requests that share a prefix stick
to one replica (cache-aware routing) and find it cached there, a replica killed mid-run loses
no request the router can retry, and benchmarks/serve_bench.py --url runs against the router.
vllm-router, where installed, keeps the groups on one replica too."""

import json
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from server_harness import NAME, ROOT, ServerProcess, _free_port, get, post

pytest.importorskip(
    "sglang_router", reason="the router extra: pip install 'nanovllm-staged[router]'"
)
pytestmark = pytest.mark.xdist_group("processes")
MODEL = ROOT / "models" / "course-llama"
REQUESTS = "nanovllm_request_success_total"


SGLANG = [
    sys.executable,
    "-m",
    "sglang_router.launch_router",
    "--log-level",
    "warn",
    "--health-check-interval-secs",
    "1",
    "--retry-initial-backoff-ms",
    "50",
]


class Router:
    def __init__(self, command: list[str], workers: list[ServerProcess], log_path: pathlib.Path):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "wb")
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [
                *command,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--worker-urls",
                *[w.base for w in workers],
                "--policy",
                "cache_aware",
                "--prometheus-port",
                str(_free_port()),
            ],  # (each its own, not the default 29000)
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, f"the router did not start:\n{self.output()}"
            try:
                probe = {"model": NAME, "prompt": "hi", "max_tokens": 1}
                if post(self.base + "/v1/completions", probe, timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.3)

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    workers = [ServerProcess(MODEL, root / f"worker{i}.log") for i in range(2)]
    yield workers
    for w in workers:
        w.stop(signal.SIGKILL, timeout=10)


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory):
    r = Router(SGLANG, replicas, tmp_path_factory.mktemp("router") / "router.log")
    yield r
    r.stop()


def served(worker: ServerProcess) -> float:
    return sum(v for k, v in worker.metrics().items() if k.startswith(REQUESTS))


def test_router_endpoints_answer_in_the_routers_shapes(replicas):
    base = replicas[0].base
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        status, text = get(base + path)
        info = json.loads(text)
        assert (
            status == 200
            and info["served_model_name"] == NAME
            and info["max_context_length"] == 1024
        ), info
    status, load = get(base + "/get_load")
    assert status == 200 and json.loads(load)[0].keys() >= {
        "dp_rank",
        "num_reqs",
        "num_waiting_reqs",
        "num_tokens",
    }
    status, tokens = post(
        base + "/tokenize", {"model": NAME, "prompt": "bread and salt", "add_special_tokens": False}
    )
    assert status == 200 and tokens["count"] == len(tokens["tokens"]) > 0
    assert post(base + "/detokenize", {"tokens": tokens["tokens"]}) == (
        200,
        {"prompt": "bread and salt"},
    )
    status, rendered = post(
        base + "/v1/completions/render", {"model": NAME, "prompt": "bread and salt"}
    )
    assert status == 200 and rendered[0]["token_ids"] == tokens["tokens"]
    status, chat = post(
        base + "/v1/chat/completions/render",
        {"model": NAME, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert status == 200 and chat["token_ids"], chat


def test_the_router_knows_the_model(router):
    """The router read the model's name from the replicas' /get_model_info (not "unknown")."""
    status, models = get(router.base + "/v1/models")
    assert status == 200 and NAME in models, models


def test_the_router_answers_as_a_replica_does(replicas, router):
    for body, path in (
        (
            {"prompt": "the lighthouse keeper", "max_tokens": 12, "temperature": 0},
            "/v1/completions",
        ),
        (
            {
                "messages": [{"role": "user", "content": "bread"}],
                "max_tokens": 12,
                "temperature": 0,
            },
            "/v1/chat/completions",
        ),
    ):
        direct = post(replicas[0].base + path, {"model": NAME, **body})
        routed = post(router.base + path, {"model": NAME, **body})
        assert direct[0] == routed[0] == 200
        key = "text" if path == "/v1/completions" else "message"
        assert routed[1]["choices"][0][key] == direct[1]["choices"][0][key]


def test_prefix_groups_stick_to_one_replica(replicas, router):
    """Four groups of requests, each sharing a long prefix: every request of a group is served
    by the replica that served its first, which finds the prefix in its cache."""
    assert_groups_stick(replicas, router, range(4))


def assert_groups_stick(replicas: list[ServerProcess], router: Router, groups) -> None:
    for g in groups:
        prefix = f"group {g}: " + " ".join(f"word{g}{i}" for i in range(60))
        before = [served(w) for w in replicas]
        for i in range(4):
            status, answer = post(
                router.base + "/v1/completions",
                {"model": NAME, "prompt": f"{prefix} question {i}", "max_tokens": 2},
            )
            assert status == 200 and (
                i == 0 or answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 200
            ), answer
        gained = [served(w) - b for w, b in zip(replicas, before)]
        assert sorted(gained) == [0, 4], f"group {g} was split over the replicas: {gained}"


def test_serve_bench_runs_against_the_router(router, tmp_path):
    from benchmarks import serve_bench

    out = tmp_path / "bench.json"
    code = serve_bench.main(
        [
            "--url",
            router.base,
            "--model-name",
            NAME,
            "--vocab-size",
            "2048",
            "--text-prompts",
            str(MODEL),
            "--workload",
            "tiny-cpu",
            "--num-seqs",
            "8",
            "--concurrency",
            "4",
            "--max-output-len",
            "6",
            "--out",
            str(out),
        ]
    )
    assert code in (0, None)
    record = json.loads(out.read_text())
    assert record["completed"] == 8 and record["failed"] == 0 and record["output_tokens"] > 0, (
        record
    )


def test_vllm_router_routes_by_the_rendered_prompt(replicas, tmp_path):
    """vllm-router's cache-aware policy renders each prompt on a replica (/v1/completions/render)
    and keeps a group on one replica too."""
    binary = shutil.which("vllm-router") or pathlib.Path(sys.executable).with_name("vllm-router")
    if not pathlib.Path(binary).exists():
        pytest.skip("vllm-router is not installed (pip install vllm-router)")
    vllm = Router([str(binary)], replicas, tmp_path / "vllm-router.log")
    try:
        assert_groups_stick(replicas, vllm, range(10, 13))
    finally:
        vllm.stop()


def test_a_replica_killed_mid_run_loses_no_request(replicas, router):
    """Twelve plain requests in flight, then one replica is killed (SIGKILL): the router retries
    what failed on the other one, and every request is answered 200."""
    answers: list[int] = []
    body = {
        "model": NAME,
        "prompt": "bread salt water",
        "max_tokens": 64,
        "ignore_eos": True,
        "temperature": 0,
    }
    threads = [
        threading.Thread(
            target=lambda: answers.append(
                post(router.base + "/v1/completions", body, timeout=120)[0]
            )
        )
        for _ in range(12)
    ]
    for t in threads:
        t.start()
    time.sleep(0.5)
    replicas[1].proc.send_signal(signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert answers == [200] * 12, f"{answers}\n{router.output()}"
