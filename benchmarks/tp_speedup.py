"""Where tensor parallelism pays off: TP=2 vs TP=1 throughput per model size, from the
runner's records (`bash benchmarks/gpu_suite.sh --shapes "..." tp` writes them).

    python -m benchmarks.tp_speedup                # reads benchmarks/results/tp_*_tp{1,2}_h200x2.json
    python -m benchmarks.tp_speedup --tag h200x2 --out benchmarks/results/tp_speedup_h200x2.json

One row per model shape, smallest first: parameters, both throughputs (output tokens/s of
the whole workload), the speed-up TP=2 / TP=1, and the error of a run that failed (then
its throughput is null). A notebook plots `num_parameters` against `speedup`:

    rows = json.load(open("benchmarks/results/tp_speedup_h200x2.json"))["rows"]
"""

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def rows(tag: str, results: Path = RESULTS) -> list[dict]:
    found = {}
    for path in sorted(results.glob(f"tp_*_tp1_{tag}.json")):
        shape = path.name[len("tp_") : -len(f"_tp1_{tag}.json")]
        runs = {tp: load(results / f"tp_{shape}_tp{tp}_{tag}.json") for tp in (1, 2)}
        model = next(r["model"] for r in runs.values() if r)
        speed = {tp: (r or {}).get("output_tokens_per_s") for tp, r in runs.items()}
        found[shape] = {
            "shape": shape,
            "num_parameters": model["num_parameters"],
            "hidden_size": model["hidden_size"],
            "num_hidden_layers": model["num_hidden_layers"],
            "tp1_output_tokens_per_s": speed[1],
            "tp2_output_tokens_per_s": speed[2],
            "speedup": speed[2] / speed[1] if speed[1] and speed[2] else None,
            "tp1_error": (runs[1] or {}).get("error", None if runs[1] else "not run"),
            "tp2_error": (runs[2] or {}).get("error", None if runs[2] else "not run"),
            "files": [f"tp_{shape}_tp{tp}_{tag}.json" for tp in (1, 2)],
        }
    return sorted(found.values(), key=lambda row: row["num_parameters"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tag", default="h200x2", help="the machine tag in the file names")
    parser.add_argument(
        "--results",
        type=Path,
        default=RESULTS,
        help="the folder holding the records (default: %(default)s)",
    )
    parser.add_argument("--out", help="write the JSON here")
    parser.add_argument(
        "--note", help="a remark stored with the rows (e.g. which code the runs used)"
    )
    args = parser.parse_args()
    table = rows(args.tag, args.results)
    for row in table:
        speedup = f"{row['speedup']:.2f}x" if row["speedup"] else "-"
        tp1 = (
            f"{row['tp1_output_tokens_per_s']:,.0f}"
            if row["tp1_output_tokens_per_s"]
            else row["tp1_error"]
        )
        tp2 = (
            f"{row['tp2_output_tokens_per_s']:,.0f}"
            if row["tp2_output_tokens_per_s"]
            else row["tp2_error"]
        )
        print(
            f"{row['shape']:14s} {row['num_parameters'] / 1e9:5.2f}B  TP=1 {tp1:>10s}  TP=2 {tp2:>10s}  {speedup}"
        )
    if args.out:
        record = {
            "benchmark": "tp_speedup",
            "tag": args.tag,
            "source": "benchmarks/gpu_suite.sh tp",
            "note": args.note,
            "rows": table,
        }
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
