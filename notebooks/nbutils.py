"""Small plotting and measuring helpers shared by the notebooks (never engine code).

The kernel runs in notebooks/, so `import nbutils` finds this file; the repo root (for
`stages`, `tools`, `benchmarks`) must already be on sys.path. Every notebook's first cell
(its output carries timings/versions, so it is marked NBVAL_IGNORE_OUTPUT)::

    import sys, pathlib; sys.path.insert(0, str(pathlib.Path.cwd().parent))  # the repo root
    import torch
    import nbutils, stages
    from tools.tiny_model import cached_model
    st = stages.load("03_paged")
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny models gain little from more threads, and lose 10-100x when the CPU is busy
    model = cached_model("tiny-qwen3", arch="qwen3")  # the same build as benchmarks/run.py --shape tiny-qwen3

Then::

    nbutils.plot_sampler(Sampler)                        # Gumbel-max frequencies vs softmax(logits / T)
    nbutils.plot_stats(llm.stats, ["num_tokens"])        # any per-step stats key (or function) vs step
    nbutils.plot_step_times({"01": stats01}, x=...)      # milliseconds per step, raw and smoothed
    nbutils.plot_kv_usage(llm.stats)                     # reserved vs used KV memory per step
    records = nbutils.benchmark(["01_naive", "02_kvcache"])  # live run of benchmarks/run.py
    nbutils.plot_ladder("04_prefix_cache")              # the recorded GPU ladder, up to this rung
    workload, records = nbutils.recorded_pair(["03_paged", "04_prefix_cache"], ["shared-prefix", "nanovllm"])

    # sampling through a stage's engine against the model's own softmax (first and second token):
    reference = nbutils.model_distributions(nbutils.COURSE_MODEL, prompt_ids, (0.5, 1.0, 1.5))
    samples = nbutils.engine_samples(st, nbutils.COURSE_MODEL, prompt_ids, (0.5, 1.0, 1.5), n=300, seed=3)
    worst = nbutils.plot_engine_samples(samples, reference, labels=tokenizer.decode)  # deviations in standard errors
    check = nbutils.sampling_check(st, prompt_ids, seed=4)  # the same, without the figure: check["worst"] < 5

`COURSE_MODEL` is the trained course model (models/course-llama), used wherever text matters;
`STORY` is how its stories start. Diagrams of the engine's structures are in figures.py,
conceptual diagrams in diagrams.py, the course's map (the "you are here" strip) in course_map.py,
the stages' code on screen in codeview.py, and the exercises in exercises/.

Benchmark records (live, or recorded in benchmarks/results/) are read and plotted with
benchmarks.results (`load_results`, `table`, `plot_throughput`), not here.

A "stats" argument is `llm.stats`: a list of per-step dicts. Wherever a stats key is
expected, a function of one record also works (e.g. `lambda r: r["num_tokens"] - r["recomputed_tokens"]`).
Plot helpers draw into `ax` (a new figure if None) and return it; end the cell with `plt.show()`.

Importing this module also silences tqdm's "IProgress not found" warning (ipywidgets is not a
dependency; the stages import tqdm.auto), so import it before loading a stage.
"""

import json
import pathlib
import statistics
import warnings
from collections.abc import Callable, Mapping, Sequence

import matplotlib.pyplot as plt
import torch

warnings.filterwarnings("ignore", message="IProgress not found")  # printed once per kernel, with a local path

COURSE_MODEL = pathlib.Path(__file__).resolve().parent.parent / "models" / "course-llama"  # trained: real text
STORY = "Once upon a time, in a small village by the sea,"  # how the course model's stories start

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
    ax = _ax(ax, figsize=(9, 3.5))
    xs, res, use = column(stats, "step"), column(stats, reserved), column(stats, used)
    if capacity is not None:
        ax.plot(xs, column(stats, capacity), "k--", lw=1, label="allocated at start-up")
    ax.step(xs, res, where="post", label="reserved by running sequences")
    ax.step(xs, use, where="post", label="used (K/V written)")
    ax.fill_between(xs, use, res, step="post", alpha=0.2, color="tab:red", label="wasted")
    ax.set(title=title, xlabel="step", ylabel=unit)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")  # outside: the plot is full
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


def benchmark(engines, workload="tiny-cpu", *, shape="tiny-qwen3", device="cpu", options=None, params=None) -> list[dict]:
    """Time engines with the benchmark runner (benchmarks/run.py), in this process, and return
    its JSON records (schema: benchmarks/README.md; read them with benchmarks.results:
    `table(records)`, `plot_throughput(records)`). options: engine options, params: workload
    parameters, both {name: value}. The runner's progress lines are swallowed unless it fails."""
    import contextlib
    import io

    from benchmarks import run

    argv = [a for e in engines for a in ("--engine", e)]
    argv += ["--workload", workload, "--shape", shape, "--device", device, "--out", "-"]
    argv += [a for k, v in (options or {}).items() for a in ("--option", f"{k}={json.dumps(v)}")]
    argv += [a for k, v in (params or {}).items() for a in ("--param", f"{k}={json.dumps(v)}")]
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run.main(argv)
    except SystemExit as exc:  # a usage error: the runner has explained it on stderr
        raise RuntimeError(err.getvalue()) from exc
    if code:
        raise RuntimeError(err.getvalue())
    records = json.loads(out.getvalue())
    return records if isinstance(records, list) else [records]


# ---- sampling through a stage's engine, against the model's softmax ----


def model_distributions(model_dir, prompt_ids: list[int], temperatures, *, cover: float = 0.995) -> dict:
    """Hugging Face transformers' float32 model as the reference: for each temperature T, the
    probabilities of the first generated token, softmax(logits / T), and of the second token
    with the first one sampled: sum over t of p(t) * softmax(logits(prompt + t) / T). First
    tokens are taken in order of probability until they `cover` that much of the mass at the
    highest T, and the sum is renormalised over them: the first tokens left out (less than
    1 - cover of the mass) move no second-token probability by more than 1 - cover."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        first = hf(torch.tensor([prompt_ids])).logits[0, -1].float()  # (vocab,)
        flattest = torch.softmax(first / max(temperatures), dim=-1)
        order = flattest.argsort(descending=True)
        keep = order[: int((flattest[order].cumsum(0) < cover).sum()) + 1]  # (k,) the likely first tokens
        batch = torch.tensor([prompt_ids + [t] for t in keep.tolist()])  # (k, prompt + 1)
        second = hf(batch).logits[:, -1].float()  # (k, vocab)
    out = {}
    for t in temperatures:
        p1 = torch.softmax(first / t, dim=-1)  # (vocab,)
        weights = p1[keep] / p1[keep].sum()  # (k,)
        p2 = (weights.unsqueeze(1) * torch.softmax(second / t, dim=-1)).sum(0)  # (vocab,)
        out[t] = {"first": p1, "second": p2}
    return out


def engine_samples(stage, model_dir, prompt_ids: list[int], temperatures, *, n: int = 1000, **options) -> dict:
    """Run `n` copies of the prompt per temperature through the stage's own LLM, in one generate
    call (2 tokens each, ignore_eos), and count the first and second tokens. Returns
    {"counts": {T: {"first": (vocab,), "second": (vocab,)}}, "stats": llm.stats}."""
    params = [stage.SamplingParams(temperature=t, max_tokens=2, ignore_eos=True) for t in temperatures for _ in range(n)]
    with stage.LLM(model_dir, **({"device": "cpu"} | options)) as llm:
        outs = llm.generate([list(prompt_ids)] * len(params), params, use_tqdm=False)
        stats, vocab = llm.stats, llm.model_config.vocab_size
    counts = {}
    for i, t in enumerate(temperatures):
        ids = torch.tensor([o["token_ids"] for o in outs[i * n : (i + 1) * n]])  # (n, 2)
        counts[t] = {k: torch.bincount(ids[:, j], minlength=vocab) for j, k in enumerate(("first", "second"))}
    return {"counts": counts, "stats": stats, "n": n}


def sample_deviations(samples: dict, reference: dict) -> dict:
    """Per (temperature, "first" or "second" token): the largest deviation of the engine's
    frequencies from the reference probabilities, in standard errors sqrt(p (1 - p) / n), over
    the tokens the draws should see at least 5 times (n * p >= 5)."""
    n, worst = samples["n"], {}
    for t, counts in samples["counts"].items():
        for which in ("first", "second"):
            p, freq = reference[t][which], counts[which].float() / n
            ok = n * p >= 5
            worst[t, which] = ((freq - p).abs() / (p * (1 - p) / n).sqrt())[ok].max().item()
    return worst


def sampling_check(stage, prompt_ids: list[int], temperatures=(0.5, 1.0, 1.5), *, n: int = 300, **options) -> dict:
    """The one-line check of a later notebook (the figure is in 01_naive.ipynb): `n` draws per
    temperature of the first two tokens through the stage's LLM.generate, against the course
    model's own softmax (Hugging Face transformers). Returns {"worst": max deviation in standard
    errors, "stats": the engine's per-step records}."""
    reference = model_distributions(COURSE_MODEL, prompt_ids, temperatures)
    samples = engine_samples(stage, COURSE_MODEL, prompt_ids, temperatures, n=n, **options)
    return {"worst": max(sample_deviations(samples, reference).values()), "stats": samples["stats"], "n": n}


def plot_engine_samples(samples: dict, reference: dict, *, top: int = 8, labels=None, axes=None, title=None) -> dict:
    """Bars: the frequencies of the `top` most likely tokens (and all the others together) among
    the engine's samples; markers: the reference probabilities. One column per temperature, one
    row for the first token and one for the second; labels(token_id) names a token on the axis
    (e.g. the tokenizer's decode). Returns, per (temperature, position), the
    largest deviation in standard errors, sqrt(p (1 - p) / n), over the tokens with n*p >= 5."""
    temperatures, n = list(samples["counts"]), samples["n"]
    if axes is None:
        fig, axes = plt.subplots(2, len(temperatures), figsize=(3.7 * len(temperatures), 5.6), squeeze=False)
        if title:
            fig.suptitle(title, fontsize=10)
    for col, t in enumerate(temperatures):
        for row, which in enumerate(("first", "second")):
            ax = axes[row][col]
            p, freq = reference[t][which], samples["counts"][t][which].float() / n
            tokens = p.argsort(descending=True)[:top]
            xs = list(range(top + 1))
            ax.bar(xs, [*freq[tokens].tolist(), 1 - freq[tokens].sum().item()], color="tab:blue", alpha=0.6, label="engine's samples")
            ax.plot(xs, [*p[tokens].tolist(), 1 - p[tokens].sum().item()], "o", color="tab:red", label="model's softmax")
            names = [labels(i) if labels else str(i) for i in tokens.tolist()]
            ax.set_xticks(xs, names + ["rest"], fontsize=7, rotation=45)
            ax.set_title(f"{which} token, T = {t}", fontsize=9)
    worst = sample_deviations(samples, reference)
    axes[0][0].set_ylabel("probability")
    axes[1][0].set_ylabel("probability")
    axes[0][0].legend(fontsize=7)
    plt.tight_layout()
    return worst


# ---- recorded GPU results for a stage and its predecessor ----


def recorded_pair(engines: Sequence[str], workloads: Sequence[str]) -> tuple[str | None, list[dict]]:
    """The recorded runs (benchmarks/results/) of `engines` on the first of `workloads` that has
    any, one per engine (the last file wins), in the order of `engines`: (workload, records)."""
    from benchmarks.results import load_results

    records = load_results()
    for workload in workloads:
        found = {r["engine"]: r for r in records if r["workload"]["name"] == workload and r["engine"] in engines}
        if found:
            return workload, [found[e] for e in engines if e in found]
    return None, []


# ---- the recorded ladder: throughput of every rung on a GPU, up to the current notebook ----

RUNGS = ["01_naive", "02_kvcache", "03_paged", "04_prefix_cache", "05_chunked_prefill", "06_cudagraph",
         "07_tensor_parallel", "final"]
LADDER_RECORDS = {  # panel: the recorded runs it reads (benchmarks/results/), one per engine
    "headline": "nanovllm_qwen3-0.6b_*_h200.json",
    "small": "small-nanovllm_qwen3-0.6b_*_h200.json",
}


def recorded_ladder() -> dict[str, dict[str, dict]]:
    """{panel: {engine: record}} from the files of LADDER_RECORDS (the last file wins)."""
    from benchmarks.results import load_results

    return {panel: {r["engine"]: r for r in load_results(pattern)} for panel, pattern in LADDER_RECORDS.items()}


def conditions(record: dict) -> str:
    """The conditions of a recorded run, in words: workload, model shape, dtype, device."""
    w = record["workload"]["params"]
    return (f"{record['workload']['name']} workload: {w['num_seqs']} sequences, prompts of {w['min_input_len']}-"
            f"{w['max_input_len']} tokens, {w['min_output_len']}-{w['max_output_len']} new tokens, T={w['temperature']}\n"
            f"{record['model']['shape']} shape (random weights), {record['dtype']}, "
            f"{record.get('device_count', 1)} {record['device_name']}")


def plot_ladder(upto: str, axes=None) -> dict[str, dict[str, float]]:
    """The ladder so far: recorded output tokens/s of every rung up to `upto` (a stage name or
    "final"), one panel per workload; rungs ahead are left empty, rungs without a record on a
    workload say so. Returns {panel: {engine: tokens/s}} of what is drawn."""
    if upto not in RUNGS:
        raise ValueError(f"unknown rung {upto!r}: one of {', '.join(RUNGS)}")
    ladder, last = recorded_ladder(), RUNGS.index(upto)
    if axes is None:
        _, axes = plt.subplots(1, len(ladder), figsize=(13, 3.9))
    shown = {}
    for ax, (panel, records) in zip(axes, ladder.items()):
        shown[panel] = {}
        top = max(r["output_tokens_per_s"] for r in records.values())
        for i, rung in enumerate(RUNGS):
            label = rung.split("_")[0]
            if i > last:
                ax.bar(i, top, color="none", edgecolor="0.85", ls="--")
                ax.text(i, top * 0.03, "ahead", ha="center", fontsize=7, color="0.6", rotation=90)
            elif rung in records:
                tps = records[rung]["output_tokens_per_s"]
                shown[panel][rung] = tps
                ax.bar(i, tps, color="tab:orange" if i == last else "tab:blue")
                ax.text(i, tps, f"{tps:,.0f}", ha="center", va="bottom", fontsize=7.5)
            else:
                ax.text(i, top * 0.03, "no record", ha="center", fontsize=7, color="0.4", rotation=90)
        ax.set_xticks(range(len(RUNGS)), [r.split("_", 1)[0] for r in RUNGS])
        ax.set_xlim(-0.6, len(RUNGS) - 0.4)
        ax.set_ylim(0, top * 1.15)
        ax.set_ylabel("output tokens / s")
        ax.set_title(conditions(next(iter(records.values()))), fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    plt.tight_layout()
    return shown
