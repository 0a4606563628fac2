"""Read the runner's JSON results and show them: a text table and a throughput bar chart.

    from benchmarks.results import load_results, plot_throughput, table
    records = load_results("nanovllm_qwen3-0.6b_*_h200.json")
    print(table(records))
    plot_throughput(records)

Only throughput records (those written by benchmarks/run.py) are returned; other JSON
files in the folder, such as kernel_bench.py's, are skipped.

    python -m benchmarks.results join --out FILE A.json B.json ...   # runs of several processes, one file
"""

import argparse
import json
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def is_run_record(record: object) -> bool:
    """True for a record written by benchmarks/run.py (a successful or a failed run)."""
    return (
        isinstance(record, dict)
        and "engine" in record
        and "workload" in record
        and ("output_tokens_per_s" in record or "error" in record)
    )


def load_results(
    pattern: str = "*.json", directory: str | Path = RESULTS_DIR, *, include_failed: bool = False
) -> list[dict]:
    """Every run record in the files of `directory` matching `pattern`, in file-name order.

    A file may hold one record or a list of them. Each record gets a "file" key naming
    the file it came from. Failed runs (records with an "error") are left out unless
    include_failed=True.
    """
    records = []
    for path in sorted(Path(directory).glob(pattern)):
        data = json.loads(path.read_text())
        for record in data if isinstance(data, list) else [data]:
            if is_run_record(record) and (include_failed or "error" not in record):
                records.append(record | {"file": path.name})
    return records


# ---- text ----

HEADER = f"{'engine':<20} {'workload':<14} {'device':<24} {'seqs':>5} {'in tok':>8} {'out tok':>8} {'seconds':>8} {'out tok/s':>10} {'tot tok/s':>10}"


def summary_row(record: dict) -> str:
    """One line per run, aligned under HEADER."""
    head = f"{record['engine']:<20} {record['workload']['name']:<14} {record.get('device_name', '?')[:24]:<24}"
    if "error" in record:
        return f"{head} FAILED: {record['error']}"
    return (
        f"{head} {record['num_seqs']:>5} {record['input_tokens']:>8} {record['output_tokens']:>8} "
        f"{record['seconds']:>8.2f} {record['output_tokens_per_s']:>10.1f} {record['total_tokens_per_s']:>10.1f}"
    )


def table(records: list[dict]) -> str:
    return "\n".join([HEADER, *(summary_row(r) for r in records)])


# ---- plots ----


def bar_label(record: dict, varying: set[str]) -> str:
    """The engine's name, plus whatever else differs between the plotted records."""
    parts = [record["engine"]]
    if "workload" in varying:
        parts.append(record["workload"]["name"])
    if "device_name" in varying:
        parts.append(record.get("device_name", "?"))
    if "model" in varying:
        parts.append(record["model"].get("shape") or record["model"].get("architecture", "?"))
    return "\n".join(parts)


def plot_throughput(
    records: list[dict], ax=None, metric: str = "output_tokens_per_s", title: str | None = None
):
    """A bar per record of `metric` (output tokens/s by default), labelled by engine and by
    whatever else differs between records (workload, device, model). Returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(records) + 2), 3.5))
    if not records:
        ax.set_title(title or "no results")
        return ax
    keys = {
        "workload": lambda r: r["workload"]["name"],
        "device_name": lambda r: r.get("device_name"),
        "model": lambda r: r["model"].get("shape") or r["model"].get("architecture"),
    }
    varying = {name for name, key in keys.items() if len({key(r) for r in records}) > 1}
    labels = [bar_label(r, varying) for r in records]
    values = [r[metric] for r in records]
    bars = ax.bar(range(len(records)), values, color="tab:blue")
    ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=8, padding=2)
    ax.set_xticks(range(len(records)), labels, fontsize=8)
    ax.set_ylabel(metric.replace("_per_s", "/s").replace("_", " "))
    ax.margins(y=0.15)
    if title is None:
        common = [
            keys[k](records[0]) for k in ("workload", "model", "device_name") if k not in varying
        ]
        title = " | ".join(str(c) for c in common if c)
    ax.set_title(title, fontsize=10)
    return ax


def join(paths: list[str], out: str) -> None:
    """The run records of `paths`, in their order, written to `out` as one list."""
    records = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        records += data if isinstance(data, list) else [data]
    if not all(is_run_record(record) for record in records):
        raise SystemExit("error: join takes the records of benchmarks/run.py only")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(records, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description="benchmarks/run.py's records")
    commands = parser.add_subparsers(dest="command", required=True)
    joined = commands.add_parser("join", help="several runs' records in one file")
    joined.add_argument("--out", required=True)
    joined.add_argument("paths", nargs="+")
    args = parser.parse_args()
    join(args.paths, args.out)


if __name__ == "__main__":
    main()
