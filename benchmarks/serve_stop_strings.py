"""Served TPOT with and without stop strings. A request with stop strings has its text decoded
in the engine process, where they are matched, and the API process takes that text; one
without is decoded in the API process only. This measures what stop strings cost a served
token, on this copy of the engine and (--baseline) on another, in turn on the same device.

Each copy gets one server (benchmarks/serve_bench.py starts it) and the same workload twice,
closed loop of streaming clients: without stop strings, then with stop strings that never
occur (`NEVER`), so that both runs generate the same tokens (ignore_eos: every request its
max_tokens) and differ only in the text decoding. Prints a table and writes a JSON record.

    # this copy and the engine of another commit (a directory holding its nanovllm_final):
    mkdir -p .base && git archive COMMIT nanovllm_final | tar -x -C .base
    python -m benchmarks.serve_stop_strings --shape qwen3-0.6b --num-seqs 256 --concurrency 64 \\
        --engine-option max_num_seqs=64 --baseline .base
    # on CPU, the tiny model (what the test runs):
    python -m benchmarks.serve_stop_strings --shape tiny-qwen3 --device cpu --workload tiny-cpu \\
        --num-seqs 8"""

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # also for `python benchmarks/serve_stop_strings.py`

from benchmarks import serve_bench, workloads  # noqa: E402 - standard library only

NEVER = [
    "\u2603never\u2603",
    "\u2603\u2603",
]  # two stop strings no generated text holds (checked: no run ends on "stop")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serve_stop_strings",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve_bench.model_arguments(p)
    p.add_argument(
        "--baseline",
        type=Path,
        help="a directory holding another copy of nanovllm_final, measured too",
    )
    p.add_argument(
        "--device", default=None, help="engine option device (default: cuda if available)"
    )
    p.add_argument("--workload", default="nanovllm", choices=tuple(workloads.WORKLOADS))
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--max-input-len", type=int, default=None)
    p.add_argument("--max-output-len", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument(
        "--out",
        help="the JSON record (default: results/serve_stop_strings_<model>_<device>.json)",
    )
    args = p.parse_args(argv)
    args.server_arg = []  # what serve_bench.start_server reads
    return args


def measure(code: Path, model_dir: Path, args: argparse.Namespace, bodies: list[dict]) -> dict:
    """One server of the engine under `code`; the workload without, then with, stop strings."""
    log_path = Path(tempfile.gettempdir()) / f"serve_stop_strings.{code.name or 'root'}.server.log"
    print(f"server log: {log_path}", file=sys.stderr)
    with open(log_path, "w") as log:
        proc, base = serve_bench.start_server(
            model_dir, args, max_pending=len(bodies) + 8, log=log, cwd=code
        )
        try:
            warmup = [{**b, "prompt": b["prompt"][:16], "max_tokens": 8} for b in bodies[:2]]
            serve_bench.run_clients(base, warmup, 2, args.request_timeout)
            runs = {}
            for label, stop in (("no stop strings", None), ("stop strings", NEVER)):
                batch = [{**b, **({"stop": stop} if stop else {})} for b in bodies]
                results, wall = serve_bench.run_clients(
                    base, batch, args.concurrency, args.request_timeout
                )
                runs[label] = summarize(results, wall)
        finally:
            serve_bench.stop_server(proc)
    return runs


def summarize(results: list[dict], wall: float) -> dict:
    done = [r for r in results if "error" not in r]
    tokens = sum(r["output_tokens"] for r in done)
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "stopped": sum(r["finish_reason"] == "stop" for r in done),
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "wall_s": wall,
        "tpot_s": serve_bench.summary([r["tpot_s"] for r in done if r["tpot_s"] is not None]),
        "ttft_s": serve_bench.summary([r["ttft_s"] for r in done if r["ttft_s"] is not None]),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = (
        Path(args.model).expanduser()
        if args.model
        else serve_bench.model_for_shape(args.shape, args.device)
    )
    device = serve_bench._device_name()
    name = args.shape or model_dir.name
    args.out = args.out or str(
        ROOT
        / "benchmarks"
        / "results"
        / f"serve_stop_strings_{name}_{device.replace(' ', '-').lower()}.json"
    )
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    overrides = {"num_seqs": args.num_seqs, "seed": args.seed}
    overrides |= {
        k: getattr(args, k)
        for k in ("max_input_len", "max_output_len")
        if getattr(args, k) is not None
    }
    prompts, params = workloads.make_workload(args.workload, vocab_size, **overrides)
    bodies = [
        {"prompt": p, "stream": True, **sp} for p, sp in zip(prompts, params)
    ]  # no "model": the one served
    codes = {"this": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    record = {
        "benchmark": "serve_stop_strings",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(
            [
                sys.executable,
                "-m",
                "benchmarks.serve_stop_strings",
                *(argv if argv is not None else sys.argv[1:]),
            ]
        ),
        "device_name": device,
        "model": str(model_dir),
        "workload": {"name": args.workload, **overrides},
        "concurrency": args.concurrency,
        "engine_options": serve_bench.engine_options(args),
        "stop": NEVER,
        "runs": {label: measure(code, model_dir, args, bodies) for label, code in codes.items()},
    }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    columns = (
        "engine",
        "requests",
        "tok/s",
        "TPOT p50 ms",
        "TPOT p90 ms",
        "TTFT p50 ms",
        "stopped",
    )
    print("{:10} {:20} {:>9} {:>12} {:>12} {:>12} {:>8}".format(*columns))
    for label, runs in record["runs"].items():
        for kind, r in runs.items():
            ms = [
                r[k].get(q, float("nan")) * 1e3
                for k, q in (("tpot_s", "p50"), ("tpot_s", "p90"), ("ttft_s", "p50"))
            ]
            print(
                f"{label:10} {kind:20} {r['output_tokens_per_s']:9.1f} "
                f"{ms[0]:12.2f} {ms[1]:12.2f} {ms[2]:12.2f} {r['stopped']:8}"
            )
    print(f"written: {args.out}")
    runs = [r for runs in record["runs"].values() for r in runs.values()]
    return 1 if any(r["failed"] or r["stopped"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
