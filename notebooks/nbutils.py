"""Small plotting and measuring helpers shared by the notebooks (never engine code).

Every notebook starts with the repo root on sys.path (its first cell does that; this
module cannot, because it is only importable once the kernel runs in notebooks/), then::

    import nbutils
    nbutils.plot_sampler(Sampler)                        # Gumbel-max frequencies vs softmax(logits / T)
    nbutils.plot_stats(llm.stats, ["num_tokens"])        # any per-step stats key (or function) vs step
    nbutils.plot_step_times({"01": stats01}, x=...)      # milliseconds per step, raw and smoothed
    nbutils.plot_kv_usage(llm.stats)                     # reserved vs used KV memory per step
    r = nbutils.throughput(st, path, prompts, params)    # live tokens/s of one stage
    nbutils.plot_throughput({"01": r1, "02": r2})        # bar chart of tokens/s
    nbutils.plot_benchmark_results(nbutils.load_benchmark_results())  # recorded GPU runs

A "stats" argument is `llm.stats`: a list of per-step dicts. Wherever a stats key is
expected, a function of one record also works (e.g. `lambda r: r["num_tokens"] - r["recomputed_tokens"]`).
Plot helpers draw into `ax` (a new figure if None) and return it; end the cell with `plt.show()`.
"""

import json
import pathlib
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import matplotlib.pyplot as plt
import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"
SAMPLER_LOGITS = (2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2)  # the 8-token vector tests/test_sampler.py uses

Key = str | Callable[[dict], float]


def column(stats: Sequence[dict], key: Key) -> list:
    """One value per step: `record[key]`, or `key(record)` when key is a function."""
    return [key(r) if callable(key) else r[key] for r in stats]


def _ax(ax, figsize=(7, 3.5)):
    return ax if ax is not None else plt.subplots(figsize=figsize)[1]


def _series(series: Sequence[str] | Mapping[str, Key]) -> dict[str, Key]:
    return dict(series) if isinstance(series, Mapping) else {k: k for k in series}


def plot_stats(stats, series, x: Key = "step", *, cumulative=False, ax=None, title=None, xlabel=None, ylabel=None, **plot_kw):
    """Plot stats columns against x. series: list of keys, or {label: key or function}.
    cumulative=True plots running sums (total work so far instead of work per step)."""
    ax = _ax(ax)
    xs = column(stats, x)
    for label, key in _series(series).items():
        ys = column(stats, key)
        if cumulative:
            ys = [sum(ys[: i + 1]) for i in range(len(ys))]
        ax.plot(xs, ys, label=label, **plot_kw)
    ax.set(title=title, xlabel=xlabel or (x if isinstance(x, str) else None), ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    return ax


def _rolling_median(values: list[float], window: int) -> list[float]:
    half = window // 2
    return [statistics.median(values[max(0, i - half): i + half + 1]) for i in range(len(values))]


def plot_step_times(runs: Mapping[str, Sequence[dict]], x: Key = "step", *, smooth=15, ax=None, title=None, xlabel=None):
    """Milliseconds per step for each {label: stats}: raw points, plus a rolling median
    (window `smooth`) that shows the trend through the timer noise."""
    ax = _ax(ax)
    for label, stats in runs.items():
        xs, ms = column(stats, x), [s * 1e3 for s in column(stats, "seconds")]
        (line,) = ax.plot(xs, _rolling_median(ms, smooth), label=f"{label} (median of {smooth})")
        ax.plot(xs, ms, ".", color=line.get_color(), alpha=0.25, markersize=3)
    ax.set(title=title, xlabel=xlabel or (x if isinstance(x, str) else "step"), ylabel="ms per step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    return ax


def plot_kv_usage(stats, reserved: Key = "kv_slots_reserved", used: Key = "kv_slots_used", *,
                  capacity: Key | None = "kv_slots_allocated", unit="KV slots", ax=None, title=None):
    """Reserved vs used KV-cache memory per step; the shaded gap is reserved but empty.
    Pass functions for engines that count blocks (e.g. `lambda r: r["blocks_used"] * 16`)."""
    ax = _ax(ax)
    xs, res, use = column(stats, "step"), column(stats, reserved), column(stats, used)
    if capacity is not None:
        ax.plot(xs, column(stats, capacity), "k--", lw=1, label="allocated at start-up")
    ax.step(xs, res, where="post", label="reserved by running sequences")
    ax.step(xs, use, where="post", label="used (K/V written)")
    ax.fill_between(xs, use, res, step="post", alpha=0.2, color="tab:red", label="wasted")
    ax.set(title=title, xlabel="step", ylabel=unit)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize="small")
    return ax


def kv_summary(stats, reserved: Key = "kv_slots_reserved", used: Key = "kv_slots_used") -> dict:
    """Peak reserved, peak used and the mean of used/reserved over the steps that reserve anything."""
    res, use = column(stats, reserved), column(stats, used)
    ratios = [u / r for u, r in zip(use, res) if r]
    return {"peak_reserved": max(res), "peak_used": max(use), "mean_utilisation": sum(ratios) / len(ratios)}


def plot_sampler(sampler_cls, temperatures=(0.5, 1.0, 2.0), logits=SAMPLER_LOGITS, *, num_samples=100_000, seed=0, axes=None):
    """Draw `num_samples` tokens per temperature from a stage's Sampler class (seeded, CPU)
    and plot the sampled frequencies (bars) against softmax(logits / T) (markers).
    Returns {temperature: max |frequency - probability|}."""
    logits = torch.tensor(logits, dtype=torch.float32)  # (vocab,)
    if axes is None:
        axes = plt.subplots(1, len(temperatures), figsize=(3.6 * len(temperatures), 3.2), sharey=True)[1]
    sampler = sampler_cls(seed=seed, device=torch.device("cpu"))
    errors, tokens = {}, range(len(logits))
    for ax, t in zip(axes, temperatures):
        draws = sampler(logits.expand(num_samples, -1), torch.full((num_samples,), float(t)))  # (num_samples,)
        freq = torch.bincount(draws, minlength=len(logits)).float() / num_samples
        probs = torch.softmax(logits / t, dim=-1)
        errors[t] = (freq - probs).abs().max().item()
        ax.bar(tokens, freq, color="tab:blue", alpha=0.6, label="sampled")
        ax.plot(tokens, probs, "o", color="tab:red", label="softmax(logits / T)")
        ax.set(title=f"T = {t}", xlabel="token id", xticks=list(tokens))
    axes[0].set_ylabel("probability")
    axes[0].legend(fontsize="small")
    return errors


def throughput(stage, model_path, prompts, sampling_params, *, warmup=True, **engine_options) -> dict:
    """Run one workload through a stage with its public API and time it (CPU by default).
    A one-token warm-up generate runs first unless warmup=False. Returns
    {"tokens": completion tokens, "seconds": wall time, "tokens_per_s": ...}."""
    engine_options.setdefault("device", "cpu")
    with stage.LLM(model_path, **engine_options) as llm:
        if warmup:
            llm.generate(prompts[:1], stage.SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate(prompts, sampling_params, use_tqdm=False)
        seconds = time.perf_counter() - start
    tokens = sum(len(o["token_ids"]) for o in outs)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def plot_throughput(results: Mapping[str, dict | float], *, ax=None, title="throughput", unit="tokens/s"):
    """Bar chart of {label: tokens/s, or a throughput() result}, each bar labelled with its value."""
    ax = _ax(ax, figsize=(5, 3.2))
    values = [r["tokens_per_s"] if isinstance(r, Mapping) else r for r in results.values()]
    bars = ax.bar(list(results), values, color=[f"C{i}" for i in range(len(values))])
    ax.bar_label(bars, fmt="%.0f")
    ax.set(title=title, ylabel=unit)
    ax.margins(y=0.15)
    return ax


THROUGHPUT_KEYS = ("tokens_per_s", "tokens_per_second", "throughput")


def load_benchmark_results(pattern="*.json", results_dir=RESULTS_DIR) -> list[dict]:
    """Throughput records from benchmarks/results/*.json (a file holds one record or a list).
    Records without a tokens/s field (e.g. kernel timings) are skipped. Sorted by file name."""
    records = []
    for path in sorted(pathlib.Path(results_dir).glob(pattern)):
        data = json.loads(path.read_text())
        for rec in data if isinstance(data, list) else [data]:
            if isinstance(rec, dict) and any(k in rec for k in THROUGHPUT_KEYS):
                records.append({**rec, "file": path.name})
    return records


def plot_benchmark_results(records: Sequence[dict], *, ax=None, title="recorded benchmark runs"):
    """Horizontal bars of tokens/s, one per record, labelled "stage or engine | device | workload"."""
    ax = _ax(ax, figsize=(7, 0.4 * len(records) + 1.2))
    labels, values = [], []
    for rec in records:
        name = rec.get("stage") or rec.get("engine") or rec["file"]
        device = rec.get("device_name") or rec.get("device") or "?"
        labels.append(" | ".join(str(p) for p in (name, device, rec.get("workload")) if p))
        values.append(next(rec[k] for k in THROUGHPUT_KEYS if k in rec))
    bars = ax.barh(labels, values)
    ax.bar_label(bars, fmt="%.0f")
    ax.invert_yaxis()
    ax.set(title=title, xlabel="tokens/s")
    ax.margins(x=0.15)
    return ax
