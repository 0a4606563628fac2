"""Drive the OpenAI-compatible server with streaming clients; report throughput, TTFT / TPOT /
end-to-end latency percentiles and goodput as JSON, beside the offline engine on the same
requests.

    # start a server on a random-weight Qwen3-0.6B shape, 256 requests, 64 clients, and the
    # offline engine on the same requests (the ratio is printed):
    python -m benchmarks.serve_bench --shape qwen3-0.6b --num-seqs 256 --concurrency 64 --offline \\
        --engine-option max_num_seqs=64 --out benchmarks/results/serve_qwen3-0.6b_h200.json
    # Poisson arrivals at 8 requests/s (as vLLM's benchmark_serving --request-rate), goodput
    # under a 200 ms TTFT and 20 ms TPOT objective:
    python -m benchmarks.serve_bench --shape qwen3-0.6b --request-rate 8 --goodput ttft:200 tpot:20
    # a real checkpoint, engine options for both the server and the offline run:
    python -m benchmarks.serve_bench --model ~/models/Qwen3-0.6B --engine-option max_num_seqs=128 --offline
    # an already running server:
    python -m benchmarks.serve_bench --url http://127.0.0.1:8000 --model-name Qwen3-0.6B --vocab-size 151936
    # replicas behind sglang-router, which takes text prompts only (no /metrics there: no server stats):
    python -m benchmarks.serve_bench --url http://127.0.0.1:30000 --model-name Qwen3-0.6B --vocab-size 151936 \\
        --text-prompts ~/models/Qwen3-0.6B

The workload is one of benchmarks/workloads.py's (token-id prompts, `ignore_eos`, so every
request generates exactly its max_tokens). Closed loop (no --request-rate): `--concurrency`
clients send requests one after another until the workload is used up. Open loop
(--request-rate R): request i is sent at its Poisson arrival time (exponential gaps of mean
1/R s, seeded), with at most `--concurrency` in flight if given. Per request: TTFT is the
time from sending the request to its first streamed token, TPOT the time from the first to
the last token divided by the tokens after the first, e2e the whole request. Throughput is
generated tokens / wall time of the whole run (first request sent to last one done);
goodput counts only the requests that met every objective of --goodput (vLLM's definition).

--offline: once the server has stopped (it frees the device), `benchmarks.run` times the
final engine's `LLM.generate` on the same prompts and sampling parameters with the same
engine options, in a child process; the record gets its tok/s and the ratio served/offline.
In the closed loop the server runs min(concurrency, max_num_seqs) sequences at a time, so
the record also gets the offline run's mean decode step at that batch (the decode steps
whose num_seqs is that batch; when fewer than MIN_STEPS_AT_BATCH of them ran, the nearest
batches around it, and the record says which) and TPOT p50 over it: how much longer a
served token takes than an offline decode step of the same batch. The mean over all the
offline run's decode steps, every batch size, stays in offline.stats.decode_step_ms_mean.
Both ratios are printed beside TARGETS.

The client side is standard library only (http.client and threads), so it runs where
the server's Python runs; the server needs the `serve` extra (FastAPI, uvicorn)."""

import argparse
import datetime
import http.client
import json
import math
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # also for `python benchmarks/serve_bench.py`

from benchmarks import workloads  # noqa: E402 - standard library only

PERCENTILES = (50, 90, 99)
MIN_STEPS_AT_BATCH = (
    20  # fewer decode steps at exactly the server's batch: widen to the batches around it
)
TARGETS = {
    "served_over_offline": (">=", 0.90),
    "tpot_p50_over_decode_step": ("<=", 1.25),
}  # what the server must reach


def model_arguments(p: argparse.ArgumentParser) -> argparse._MutuallyExclusiveGroup:
    """--model or --shape: what the server serves."""
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="a Hugging Face model directory to serve")
    where.add_argument(
        "--shape",
        help="a random-weight shape built by tools.tiny_model (tiny-qwen3, qwen3-0.6b, ...)",
    )
    return where


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serve_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = model_arguments(p)
    where.add_argument("--url", help="benchmark this running server instead of starting one")
    p.add_argument(
        "--model-name", help="the `model` field to send (default: what /v1/models lists)"
    )
    p.add_argument(
        "--vocab-size", type=int, help="with --url: the vocabulary for the token-id prompts"
    )
    p.add_argument(
        "--text-prompts",
        metavar="TOKENIZER",
        help="send each prompt as text, its token ids decoded by this "
        "tokenizer (a model directory), for a router that takes only text (sglang-router)",
    )
    p.add_argument(
        "--device",
        default=None,
        help="engine option device (default: the server's: cuda if available)",
    )
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="an extra `nanovllm serve` argument, e.g. --server-arg=--max-num-seqs=128",
    )
    p.add_argument("--workload", default="nanovllm", choices=tuple(workloads.WORKLOADS))
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--max-input-len", type=int, default=None)
    p.add_argument("--max-output-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="closed loop: clients sending requests one after another (default 64); "
        "with --request-rate: the most requests in flight (default: no limit)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (default: inf, the closed loop of --concurrency clients)",
    )
    p.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="METRIC:MS",
        help="service-level objectives for goodput, e.g. ttft:200 tpot:20 e2e:5000 (milliseconds)",
    )
    p.add_argument(
        "--engine-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine option for the server (as --key value) and the offline run, e.g. max_num_seqs=64",
    )
    p.add_argument(
        "--offline",
        action="store_true",
        help="also time the offline engine on the same requests (see above)",
    )
    p.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds one request may take"
    )
    p.add_argument(
        "--start-timeout", type=float, default=900.0, help="seconds the server may take to start"
    )
    p.add_argument("--out", help="write the JSON record here (it is always printed)")
    p.add_argument(
        "--server-log",
        help="the server's output goes here (default: a file next to --out, else stderr)",
    )
    return p.parse_args(argv)


# ---- the server ----


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_for_shape(shape: str, device: str | None) -> Path:
    """Build (once) the random-weight model of this shape, in a child process: torch stays out of this one."""
    code = (
        "import sys, torch; from benchmarks.run import model_for_shape; "
        f"print(model_for_shape({shape!r}, {device!r} or ('cuda' if torch.cuda.is_available() else 'cpu')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


def start_server(
    model: Path, args: argparse.Namespace, max_pending: int, log, cwd: Path = ROOT
) -> tuple[subprocess.Popen, str]:
    """`nanovllm_final.server` as found from `cwd` (another copy: a directory holding its package)."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "nanovllm_final.server",
        str(model),
        "--port",
        str(port),
        "--max-pending-requests",
        str(max_pending),
        "--log-level",
        "warning",
        *args.server_arg,
    ]
    for key, value in engine_options(args).items():
        cmd += [f"--{key.replace('_', '-')}", value]
    if args.device:
        cmd += ["--device", args.device]
    print("server:", shlex.join(cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(
                f"error: the server exited with code {proc.returncode} while starting (see its log)"
            )
        try:
            if http_get(base + "/health", timeout=2)[0] == 200:
                return proc, base
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"error: the server did not start within {args.start_timeout:g} s")


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)


def http_get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def scrape(base: str) -> dict[str, float]:
    """The unlabelled samples of /metrics, plus labelled ones as name{labels}; none where there
    is no /metrics (a router)."""
    samples = {}
    try:
        text = http_get(base + "/metrics")[1]
    except urllib.error.HTTPError:  # a router in front of servers keeps its own metrics elsewhere
        return samples
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def histogram_mean(delta, name: str) -> float | None:
    """The mean of a /metrics histogram over the run, from the changes of its _sum and _count."""
    count = delta(name + "_count")
    return delta(name + "_sum") / count if count else None


# ---- the clients ----


def one_request(base: str, body: dict, timeout: float) -> dict:
    """One streaming completion; returns its timings and token counts."""
    url = urllib.parse.urlparse(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        start = time.perf_counter()
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {resp.read()[:300]!r}"}
        first = last = None
        usage, finish = None, None
        while True:
            line = resp.readline()
            if not line:
                return {"error": "the stream ended without [DONE]"}
            if not line.startswith(b"data: "):
                continue
            if line.startswith(b"data: [DONE]"):
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            now = time.perf_counter()
            if chunk.get("choices"):
                first = first or now
                last = now
                finish = chunk["choices"][0]["finish_reason"] or finish
            usage = chunk.get("usage") or usage
        end = time.perf_counter()
        tokens = usage["completion_tokens"] if usage else 0
        return {
            "ttft_s": first - start if first else None,
            "tpot_s": (last - first) / (tokens - 1) if first and tokens > 1 else None,
            "e2e_s": end - start,
            "prompt_tokens": usage["prompt_tokens"] if usage else 0,
            "output_tokens": tokens,
            "finish_reason": finish,
        }
    except (OSError, http.client.HTTPException, ValueError) as err:
        return {"error": f"{type(err).__name__}: {err}"}
    finally:
        conn.close()


def run_clients(
    base: str, bodies: list[dict], concurrency: int, timeout: float
) -> tuple[list[dict], float]:
    results: list[dict | None] = [None] * len(bodies)
    next_index = iter(range(len(bodies)))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            results[i] = one_request(base, bodies[i], timeout)

    threads = [
        threading.Thread(target=client, daemon=True) for _ in range(min(concurrency, len(bodies)))
    ]
    start = time.perf_counter()
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout * len(bodies) / max(1, len(threads)) + 60
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    wall = time.perf_counter() - start
    return [r or {"error": "not finished in time"} for r in results], wall


def run_open_loop(
    base: str,
    bodies: list[dict],
    rate: float,
    max_concurrency: int | None,
    timeout: float,
    seed: int,
) -> tuple[list[dict], float]:
    """Send request i at its Poisson arrival time (at most max_concurrency in flight)."""
    rng, t, arrivals = random.Random(seed), 0.0, []
    for _ in bodies:
        t += rng.expovariate(rate)
        arrivals.append(t)
    results: list[dict | None] = [None] * len(bodies)
    slots = threading.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    def client(i: int) -> None:
        time.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        if slots is None:
            results[i] = one_request(base, bodies[i], timeout)
            return
        with slots:
            results[i] = one_request(base, bodies[i], timeout)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(bodies))]
    for th in threads:
        th.start()
    deadline = (
        time.monotonic()
        + arrivals[-1]
        + timeout * (1 + len(bodies) / (max_concurrency or len(bodies)))
        + 60
    )
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    wall = time.perf_counter() - start
    return [r or {"error": "not finished in time"} for r in results], wall


def parse_goodput(specs: list[str]) -> dict[str, float]:
    """["ttft:200", "tpot:20"] -> {"ttft_s": 0.2, "tpot_s": 0.02}."""
    objectives = {}
    for spec in specs:
        name, _, ms = spec.partition(":")
        if name not in ("ttft", "tpot", "e2e"):
            raise SystemExit(f"error: --goodput {spec!r}: the metric must be ttft, tpot or e2e")
        try:
            objectives[f"{name}_s"] = float(ms) / 1000
        except ValueError:
            raise SystemExit(
                f"error: --goodput {spec!r}: give milliseconds, e.g. {name}:200"
            ) from None
    return objectives


def goodput(done: list[dict], objectives: dict[str, float], wall: float) -> dict | None:
    """Requests (and their output tokens) per second that met every objective."""
    if not objectives:
        return None
    good = [
        r
        for r in done
        if all(r[name] is None or r[name] <= limit for name, limit in objectives.items())
    ]
    return {
        "objectives_s": objectives,
        "good_requests": len(good),
        "requests_per_s": len(good) / wall,
        "output_tokens_per_s": sum(r["output_tokens"] for r in good) / wall,
    }


def engine_options(args: argparse.Namespace) -> dict[str, str]:
    options = {}
    for pair in args.engine_option:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"error: --engine-option {pair!r}: expected KEY=VALUE")
        options[key.replace("-", "_")] = value
    return options


def run_offline(model_dir: Path, args: argparse.Namespace, overrides: dict) -> dict:
    """benchmarks.run on the same workload and engine options, in a child process (torch stays out of this one)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "offline.json"
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--engine",
            "final",
            "--workload",
            args.workload,
            "--model",
            str(model_dir),
            "--out",
            str(out),
        ]
        for name, value in overrides.items():
            cmd += [f"--{name.replace('_', '-')}", str(value)]
        if args.device:
            cmd += ["--device", args.device]
        for key, value in engine_options(args).items():
            cmd += ["--option", f"{key}={value}"]
        print("offline:", shlex.join(cmd), file=sys.stderr)
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        record = json.loads(out.read_text())
    record = record[0] if isinstance(record, list) else record
    return {
        "command": shlex.join(cmd),
        "output_tokens": record["output_tokens"],
        "seconds": record["seconds"],
        "output_tokens_per_s": record["output_tokens_per_s"],
        "stats": record.get("stats"),
    }


def server_batch(args: argparse.Namespace) -> int | None:
    """The sequences the server runs at once in the closed loop: min(concurrency, max_num_seqs);
    None for Poisson arrivals (the batch follows the arrivals) or with no max_num_seqs given."""
    if not math.isinf(args.request_rate):
        return None
    limit = engine_options(args).get("max_num_seqs")
    concurrency = args.concurrency or 64
    return min(concurrency, int(limit)) if limit is not None else None


def decode_step_at_batch(
    stats: dict | None, batch: int, min_steps: int = MIN_STEPS_AT_BATCH
) -> dict | None:
    """The mean decode step of benchmarks.run's per-batch stats (`decode_steps_by_num_seqs`) at
    `batch` sequences: the steps of exactly that batch, or, when fewer than min_steps ran at it,
    those within the narrowest window batch ± w that holds min_steps (all of them if none does).
    None when the stats do not have per-batch decode steps."""
    by_batch = (stats or {}).get("decode_steps_by_num_seqs")
    if not by_batch:
        return None
    rows = {int(n): row for n, row in by_batch.items()}
    widest = max(abs(n - batch) for n in rows)
    for width in range(widest + 1):
        near = [(n, row) for n, row in rows.items() if abs(n - batch) <= width]
        steps = sum(row["steps"] for _, row in near)
        if steps >= min_steps or width == widest:
            break
    if not steps:
        return None
    ms = sum(row["ms_mean"] * row["steps"] for _, row in near) / steps
    seqs = [n for n, _ in near]
    return {
        "batch": batch,
        "num_seqs_min": min(seqs),
        "num_seqs_max": max(seqs),
        "steps": steps,
        "ms_mean": ms,
    }


def target_met(name: str, value: float | None) -> bool | None:
    if value is None:
        return None
    op, limit = TARGETS[name]
    return value >= limit if op == ">=" else value <= limit


def verdict(name: str, offline: dict) -> str:
    op, limit = TARGETS[name]
    met = target_met(name, offline.get(name))
    shown = f"{limit:.0%}" if name == "served_over_offline" else f"{limit:.2f}"
    return f"target {op} {shown}: " + {True: "met", False: "MISSED", None: "not measured"}[met]


def summary(values: list[float]) -> dict:
    if not values:
        return {}
    values = sorted(values)

    def pct(q: float) -> float:  # linear interpolation between closest ranks
        k = (len(values) - 1) * q / 100
        lo, hi = int(k), min(int(k) + 1, len(values) - 1)
        return values[lo] + (values[hi] - values[lo]) * (k - lo)

    return {
        "mean": sum(values) / len(values),
        **{f"p{q}": pct(q) for q in PERCENTILES},
        "max": values[-1],
    }


# ---- main ----


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    objectives = parse_goodput(args.goodput)
    if not args.request_rate > 0:
        raise SystemExit(f"error: --request-rate must be > 0, got {args.request_rate}")
    proc, log = None, None
    if args.url:
        base = args.url.rstrip("/")
        if not args.vocab_size:
            raise SystemExit(
                "error: --url needs --vocab-size (the token-id prompts must fit the model)"
            )
        vocab_size, model_dir = args.vocab_size, None
    else:
        model_dir = (
            Path(args.model).expanduser()
            if args.model
            else model_for_shape(args.shape, args.device)
        )
        vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    overrides = {"num_seqs": args.num_seqs, "seed": args.seed}
    for name in ("max_input_len", "max_output_len"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    prompts, params = workloads.make_workload(args.workload, vocab_size, **overrides)

    if not args.url:
        log_path = args.server_log or (
            str(Path(args.out).with_suffix(".server.log")) if args.out else None
        )
        log = open(log_path, "w") if log_path else sys.stderr
        proc, base = start_server(model_dir, args, max_pending=len(prompts) + 8, log=log)
    try:
        name = args.model_name or json.loads(http_get(base + "/v1/models")[1])["data"][0]["id"]
        if (
            args.text_prompts
        ):  # routers that read only text prompts (sglang-router): the same ids, decoded
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.text_prompts)
            prompts = [tokenizer.decode(p) for p in prompts]
        bodies = [
            {"model": name, "prompt": p, "stream": True, **sp} for p, sp in zip(prompts, params)
        ]
        warmup = [
            {"model": name, "prompt": p[:16], "max_tokens": 8, "stream": True, "ignore_eos": True}
            for p in prompts[:2]
        ]
        run_clients(base, warmup, 2, args.request_timeout)
        before = scrape(base)
        if math.isinf(args.request_rate):
            results, wall = run_clients(base, bodies, args.concurrency or 64, args.request_timeout)
        else:
            results, wall = run_open_loop(
                base, bodies, args.request_rate, args.concurrency, args.request_timeout, args.seed
            )
        after = scrape(base)
    finally:
        exit_code = stop_server(proc) if proc else None
        if log not in (None, sys.stderr):
            log.close()
    offline = run_offline(model_dir, args, overrides) if args.offline and model_dir else None

    done = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    output_tokens = sum(r["output_tokens"] for r in done)
    tpot = summary([r["tpot_s"] for r in done if r["tpot_s"] is not None])
    if offline:
        offline["served_over_offline"] = (output_tokens / wall) / offline["output_tokens_per_s"]
        batch = server_batch(args)
        at_batch = decode_step_at_batch(offline["stats"], batch) if batch else None
        offline["decode_step_at_batch"] = at_batch
        offline["tpot_p50_over_decode_step"] = (
            (tpot["p50"] * 1e3 / at_batch["ms_mean"]) if at_batch and tpot else None
        )
    prompt_tokens = sum(r["prompt_tokens"] for r in done)

    def delta(name: str) -> float | None:
        return after[name] - before.get(name, 0.0) if name in after else None

    record = {
        "benchmark": "serve",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(
            [
                sys.executable,
                "-m",
                "benchmarks.serve_bench",
                *(argv if argv is not None else sys.argv[1:]),
            ]
        ),
        "host": platform.node(),
        "model": str(model_dir) if model_dir else base,
        "shape": args.shape,
        "device_name": _device_name(),
        "workload": {"name": args.workload, **overrides},
        "concurrency": args.concurrency
        if args.concurrency or not math.isinf(args.request_rate)
        else 64,
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "num_requests": len(results),
        "completed": len(done),
        "failed": len(errors),
        "errors": errors[:5],
        "wall_s": wall,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / wall,
        "total_tokens_per_s": (output_tokens + prompt_tokens) / wall,
        "requests_per_s": len(done) / wall,
        "ttft_s": summary([r["ttft_s"] for r in done if r["ttft_s"] is not None]),
        "tpot_s": tpot,
        "e2e_s": summary([r["e2e_s"] for r in done]),
        "goodput": goodput(done, objectives, wall),
        "offline": offline,
        "server": {
            "preemptions": delta("nanovllm_num_preemptions_total"),
            "prefix_cache_hit_rate": after.get("nanovllm_prefix_cache_hit_rate"),
            "generation_tokens": delta("nanovllm_generation_tokens_total"),
            "kv_cache_blocks_total": after.get("nanovllm_kv_cache_blocks_total"),
            # the engine's own means (arrival in the engine to its first token; between its tokens):
            # what the clients measure beyond them is the API process's and the clients' time
            "engine_ttft_mean_s": histogram_mean(delta, "nanovllm_time_to_first_token_seconds"),
            "engine_tpot_mean_s": histogram_mean(delta, "nanovllm_time_per_output_token_seconds"),
            "exit_code": exit_code,
        },
        "server_args": args.server_arg,
        "engine_options": engine_options(args),
    }
    text = json.dumps(record, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(
        f"{len(done)}/{len(results)} requests, {output_tokens} tokens in {wall:.2f} s: "
        f"{record['output_tokens_per_s']:.1f} tok/s; TTFT p50 {record['ttft_s'].get('p50', float('nan')) * 1e3:.1f} ms, "
        f"TPOT p50 {record['tpot_s'].get('p50', float('nan')) * 1e3:.2f} ms",
        file=sys.stderr,
    )
    if record["goodput"]:
        print(
            f"goodput: {record['goodput']['good_requests']}/{len(done)} requests met {args.goodput}: "
            f"{record['goodput']['requests_per_s']:.2f} req/s, {record['goodput']['output_tokens_per_s']:.1f} tok/s",
            file=sys.stderr,
        )
    if offline:
        print(
            f"offline engine on the same requests: {offline['output_tokens_per_s']:.1f} tok/s; "
            f"served / offline = {offline['served_over_offline']:.1%} ({verdict('served_over_offline', offline)})",
            file=sys.stderr,
        )
        mean_all = (offline["stats"] or {}).get("decode_step_ms_mean")
        if mean_all is not None:
            print(
                f"offline decode step, mean of all its decode steps (every batch size): {mean_all:.2f} ms",
                file=sys.stderr,
            )
        at = offline["decode_step_at_batch"]
        if at:
            seqs = (
                str(at["num_seqs_min"])
                if at["num_seqs_min"] == at["num_seqs_max"]
                else f"{at['num_seqs_min']}-{at['num_seqs_max']}"
            )
            print(
                f"offline decode step at the server's batch {at['batch']} (its {at['steps']} decode steps of {seqs} sequences): "
                f"{at['ms_mean']:.2f} ms; TPOT p50 / that step = {offline['tpot_p50_over_decode_step'] or math.nan:.2f} "
                f"({verdict('tpot_p50_over_decode_step', offline)})",
                file=sys.stderr,
            )
        else:
            print(
                "offline decode step at the server's batch: not computed (needs the closed loop, --engine-option "
                "max_num_seqs and benchmarks.run's decode_steps_by_num_seqs)",
                file=sys.stderr,
            )
    return 1 if errors else 0


def _device_name() -> str:
    """The GPU's name from nvidia-smi, else the CPU's (no torch in this process)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    sys.exit(main())
