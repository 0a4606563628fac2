"""The performance tables of the READMEs and the index of benchmarks/results/, generated from
the records, so that no number in them is typed by hand and none can go stale.

    python -m benchmarks.tables            # rewrite the tables and benchmarks/results/README.md
    python -m benchmarks.tables --check    # exit 1 if any of them differs from what the records say

A README table sits between `<!-- table: NAME -->` and `<!-- end table -->`; NAME is a key of
TABLES. The index lists every file under benchmarks/results/: what it holds (read from the
record where it is one of benchmarks/run.py's) and the command that makes it (the record's own
`command` where it has one, else the part of benchmarks/gpu_suite.sh that writes it).
"""

import argparse
import fnmatch
import functools
import json
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python benchmarks/tables.py` too

from benchmarks.limits import decode_step_limits, workload_limit  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
INDEX = RESULTS / "README.md"
READMES = [ROOT / "README.md", ROOT / "nanovllm_final" / "README.md"]
BLOCK = re.compile(r"(<!-- table: ([\w-]+) -->\n)(.*?)(<!-- end table -->)", re.S)
SUITE = "bash benchmarks/gpu_suite.sh"
LADDER = ["03", "04", "05", "06", "07", "final"]
ENGINE_NAMES = {
    "03": "03_paged",
    "04": "04_prefix_cache",
    "05": "05_chunked_prefill",
    "06": "06_cudagraph",
    "07": "07_tensor_parallel",
    "final": "nanovllm_final",
}


def load(rel: str) -> dict | list:
    return json.loads((RESULTS / rel).read_text())


def link(rel: str, prefix: str) -> str:
    """A link to a record, from a README whose path to the repository root is `prefix`."""
    return f"[`{rel}`]({prefix}benchmarks/results/{rel})"


def tok_s(record: dict) -> str:
    return f"{record['output_tokens_per_s']:,.0f}"


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


# ---- the READMEs' tables ----


def ladder_table(prefix: str) -> str:
    rows = []
    for engine in LADDER:
        rel = f"nanovllm_qwen3-0.6b_{engine}_h200.json"
        r = load(rel)
        tp = " (TP=1)" if engine == "07" else ""
        rows.append(
            [f"`{ENGINE_NAMES[engine]}`{tp}", f"{r['seconds']:.1f}", tok_s(r), link(rel, prefix)]
        )
    return markdown(["engine", "seconds", "output tokens/s", "record"], rows)


def small_table(prefix: str) -> str:
    rows = []
    for rel in [
        "small-nanovllm_qwen3-0.6b_02_03_h200.json",
        "small-nanovllm_qwen3-0.6b_final_h200.json",
    ]:
        for r in (lambda d: d if isinstance(d, list) else [d])(load(rel)):
            rows.append([f"`{r['engine']}`", f"{r['seconds']:.2f}", tok_s(r), link(rel, prefix)])
    return markdown(["engine", "seconds", "output tokens/s", "record"], rows)


def kernel_ms(record: dict, name: str) -> float:
    """GPU ms per decode step of one kernel, from a record's --breakdown profile."""
    return next(
        k["ms_per_step"] for k in record["breakdown"]["top_kernels"]["decode"] if k["name"] == name
    )


def limit_cells(record: dict | None) -> list[str]:
    """The workload's limit on the GPU (benchmarks/limits.py) and the record's share of it."""
    if record is None:
        return [MISSING, MISSING]
    limit = workload_limit(
        record
    )  # recomputed: the formula may have changed since the record was made
    return [
        f"{limit['output_tokens_per_s']:,.0f} tok/s",
        f"{record['output_tokens_per_s'] / limit['output_tokens_per_s']:.0%}",
    ]


def _final_rows(tag: str) -> list[tuple[str, str, Callable[[object], tuple[str, dict | None]]]]:
    """(what, record file, record -> (measured, record whose workload limit is shown or None)) of the final table."""

    def ckpt_06(records):
        stage06, ckpt = records  # one process, 06 first
        ratio = ckpt["output_tokens_per_s"] / stage06["output_tokens_per_s"]
        return (
            f"{tok_s(ckpt)} tok/s, decode step {ckpt['stats']['decode_step_ms_mean']:.2f} ms; stage 06 {tok_s(stage06)} "
            f"tok/s: **{ratio:.1f}×**"
        ), ckpt

    def fp8(r):
        attention = "_paged_decode_kernel"
        return (
            f"{tok_s(r)} tok/s, decode step {r['stats']['decode_step_ms_mean']:.2f} ms (paged decode attention "
            f"{kernel_ms(r, attention):.2f} ms of it)"
            if "breakdown" in r
            else f"{tok_s(r)} tok/s"
        ), r

    def overlap_pair(r):
        on = RESULTS / f"nanovllm-checkpoint-sampling_qwen3-0.6b_final_{tag}.json"
        return f"{tok_s(r)} tok/s" + (
            f", on: {tok_s(json.loads(on.read_text()))} tok/s" if on.is_file() else ""
        ), r

    def eight_b(r):
        peak = r["peak_memory"]
        return (
            f"{tok_s(r)} tok/s, {r['stats']['preemptions']} preemptions, peak {peak['allocated_bytes'] / 1e9:.0f} of "
            f"{peak['device_total_bytes'] / 1e9:.0f} GB allocated"
        ), r

    def hf(records):
        final, ref = records
        return f"{tok_s(final)} vs {tok_s(ref)} tok/s: **{final['vs_hf']:.1f}×**", None

    return [
        (
            "Qwen3-0.6B shape, temperature only",
            f"nanovllm_qwen3-0.6b_final_{tag}.json",
            lambda r: (
                f"{tok_s(r)} output tok/s ({r['seconds']:.2f} s); decode step {r['stats']['decode_step_ms_mean']:.2f} ms, "
                f"prefill step {r['stats']['prefill_step_ms_mean']:.0f} ms (means)",
                r,
            ),
        ),
        (
            "same, with the checkpoint's top-k 20 / top-p 0.95 (the engine's default), after stage 06 in the same process",
            f"nanovllm-checkpoint-sampling_qwen3-0.6b_06_final_{tag}.json",
            ckpt_06,
        ),
        (
            'same, `kv_cache_dtype="fp8"`',
            f"nanovllm-checkpoint-sampling-fp8-kv_qwen3-0.6b_final_{tag}.json",
            fp8,
        ),
        (
            "same sampling, `overlap_scheduling=False` against on (a pair of runs on one machine)",
            f"variants/nanovllm-checkpoint-sampling_qwen3-0.6b_final_no_overlap_{tag}.json",
            overlap_pair,
        ),
        (
            "Llama-3.2-1B shape, temperature only",
            f"nanovllm_llama-3.2-1b_final_{tag}.json",
            lambda r: (f"{tok_s(r)} tok/s", r),
        ),
        (
            "Qwen3-8B shape, the whole workload on one GPU",
            f"nanovllm_qwen3-8b_final_{tag}.json",
            eight_b,
        ),
        (
            "decode step with CUDA graphs, 32-token prompts",
            f"decode_latency_qwen3-0.6b_final_{tag}.json",
            lambda r: (
                ", ".join(f"batch {row['batch']}: {row['graph_ms']:.2f} ms" for row in r["rows"]),
                None,
            ),
        ),
        (
            "Qwen3-30B-A3B shape (MoE, fused experts), the whole workload on one GPU",
            f"nanovllm_qwen3-30b-a3b_final_{tag}.json",
            lambda r: (
                f"{tok_s(r)} tok/s; decode step {r['stats']['decode_step_ms_mean']:.1f} ms (mean)",
                r,
            ),
        ),
        (
            "Qwen3-30B-A3B shape, batch-1 decode step with CUDA graphs",
            f"decode_latency_qwen3-30b-a3b_final_{tag}.json",
            lambda r: (f"{r['rows'][0]['graph_ms']:.2f} ms", None),
        ),
        *[(None, f"serve_qwen3-0.6b_c{c}_{tag}.json", serve_row) for c in (64, 256)],
        (
            "64 of the requests (≤512 in, ≤256 out), against Hugging Face transformers' continuous batching in one process",
            f"hf_vs_final_qwen3-0.6b_{tag}.json",
            hf,
        ),
    ]


def final_table(prefix: str, tag: str) -> str:
    """The final engine's measurements on one device (`tag` in the records' names); a row whose
    record that device does not have is left out."""
    rows = []
    for what, rel, cells in _final_rows(tag):
        if not (RESULTS / rel).is_file():
            continue
        record = load(rel)
        if what is None:  # a server row says what it measured itself
            what, measured = serve_row(record)
            limit_of = None
        else:
            measured, limit_of = cells(record)
        rows.append([what, measured, *limit_cells(limit_of), link(rel, prefix)])
    if not rows:
        return f"No records of this device yet (`bash benchmarks/gpu_suite.sh --tag {tag} checkpoint latency`).\n"
    return markdown(["what", "measured", "limit of the workload", "share", "record"], rows)


def serve_row(serve: dict) -> tuple[str, str]:
    offline = serve["offline"]
    point = serve_point(serve)
    at_batch = (
        ""
        if point["decode_step_at_batch_ms"] is None
        else (
            f", {point['decode_step_at_batch_ms']:.1f} ms at the server's batch of {point['at_batch']['batch']}"
        )
    )
    return (
        f"OpenAI server, {serve['concurrency']} concurrent streaming clients, {serve['num_requests']} requests "
        f"(`max_num_seqs={serve['engine_options']['max_num_seqs']}`), then the offline engine on the same requests",
        f"{serve['output_tokens_per_s']:,.0f} tok/s, **{offline['served_over_offline']:.0%}** of offline's "
        f"{offline['output_tokens_per_s']:,.0f}; TTFT p50 {serve['ttft_s']['p50'] * 1e3:.0f} ms, TPOT p50 "
        f"{serve['tpot_s']['p50'] * 1e3:.1f} ms (offline decode step {offline['stats']['decode_step_ms_mean']:.1f} ms, "
        f"mean of all{at_batch})",
    )


SERVE_RECORDS = "serve_*_h200.json"
MISSING = "—"


def serve_point(record: dict) -> dict:
    """One benchmarks/serve_bench.py record's numbers for a table or a plot against concurrency
    (milliseconds, tokens/s); None where the record lacks the field (records written before it
    existed)."""

    def get(*keys):
        value = record
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    def ms(value):
        return None if value is None else value * 1e3

    concurrency, max_num_seqs = record.get("concurrency"), get("engine_options", "max_num_seqs")
    max_num_seqs = None if max_num_seqs is None else int(max_num_seqs)
    closed_loop = (
        record.get("request_rate") is None and concurrency is not None and max_num_seqs is not None
    )
    return {
        "concurrency": concurrency,
        "max_num_seqs": max_num_seqs,
        "server_batch": min(concurrency, max_num_seqs)
        if closed_loop
        else None,  # sequences the server runs at once
        "num_requests": record.get("num_requests"),
        "served_tok_s": record.get("output_tokens_per_s"),
        "offline_tok_s": get("offline", "output_tokens_per_s"),
        "served_over_offline": get("offline", "served_over_offline"),
        **{
            f"{metric}_{q}_ms": ms(get(f"{metric}_s", q))
            for metric in ("ttft", "tpot")
            for q in ("p50", "p90")
        },
        "decode_step_all_ms": get(
            "offline", "stats", "decode_step_ms_mean"
        ),  # every decode step, every batch size
        "decode_step_at_batch_ms": get("offline", "decode_step_at_batch", "ms_mean"),
        "at_batch": get("offline", "decode_step_at_batch"),
        "tpot_p50_over_decode_step": get("offline", "tpot_p50_over_decode_step"),
    }


def serve_points(
    pattern: str = SERVE_RECORDS, directory: Path | None = None
) -> list[tuple[str, dict]]:
    """(file name, serve_point) of every serve record matching `pattern`, by concurrency."""
    paths = sorted((directory or RESULTS).glob(pattern))
    points = [(path.name, serve_point(json.loads(path.read_text()))) for path in paths]
    return sorted(points, key=lambda item: (item[1]["concurrency"] or 0, item[0]))


def number(value: float | None, spec: str) -> str:
    """`value` formatted, or MISSING where a record does not have it."""
    return MISSING if value is None else format(value, spec)


def serve_table(prefix: str) -> str:
    """The served sweep: one row per serve record, by concurrency; "—" for a field a record lacks."""
    rows = []
    for rel, p in serve_points():
        at = p["at_batch"]
        step = number(p["decode_step_at_batch_ms"], ".2f")
        if at is not None and not at["num_seqs_min"] == at["num_seqs_max"] == at["batch"]:
            step += f" (steps of {at['num_seqs_min']}–{at['num_seqs_max']} sequences)"
        rows.append(
            [
                number(p["concurrency"], "d"),
                number(p["max_num_seqs"], "d"),
                number(p["num_requests"], "d"),
                number(p["served_tok_s"], ",.0f"),
                number(p["offline_tok_s"], ",.0f"),
                number(p["served_over_offline"], ".0%"),
                f"{number(p['ttft_p50_ms'], '.0f')} / {number(p['ttft_p90_ms'], '.0f')}",
                f"{number(p['tpot_p50_ms'], '.2f')} / {number(p['tpot_p90_ms'], '.2f')}",
                number(p["decode_step_all_ms"], ".2f"),
                number(p["server_batch"], "d"),
                step,
                number(p["tpot_p50_over_decode_step"], ".2f"),
                link(rel, prefix),
            ]
        )
    return markdown(
        [
            "clients",
            "`max_num_seqs`",
            "requests",
            "served tok/s",
            "offline tok/s",
            "served / offline",
            "TTFT p50 / p90 (ms)",
            "TPOT p50 / p90 (ms)",
            "offline decode step, all (ms)",
            "server's batch",
            "offline decode step at that batch (ms)",
            "TPOT p50 / that step",
            "record",
        ],
        rows,
    )


def tp_table(prefix: str) -> str:
    rel = "tp_speedup_h200x2.json"
    rows = [
        [
            f"{row['shape']} ({row['num_parameters'] / 1e9:.1f}B)",
            f"{row['tp1_output_tokens_per_s']:,.0f}",
            f"{row['tp2_output_tokens_per_s']:,.0f}",
            f"{row['speedup']:.2f}×",
            ", ".join(link(f, prefix) for f in row["files"]),
        ]
        for row in load(rel)["rows"]
    ]
    return markdown(
        ["shape", "TP=1 output tok/s", "TP=2 output tok/s", "TP=2 / TP=1", "records"], rows
    )


def kv_quality_table(prefix: str) -> str:
    """benchmarks/kv_cache_quality.py's records: each model and fp8 scale choice against "auto"."""
    rows = []
    for path in sorted(RESULTS.glob("kv_cache_quality_*.json")):
        record = json.loads(path.read_text())
        for m in record["models"]:
            blocks = m["blocks_per_gib"]
            for name, v in m["variants"].items():
                device = record["device"] + (
                    f", fp8 {record['fp8_products']}" if "fp8_products" in record else ""
                )
                rows.append(
                    [
                        device,
                        f"{m['model']}, {m['dtype']}",
                        name.removeprefix("fp8, "),
                        f"{v['prefix_agreement']:.0%}",
                        f"{v['exact_match_share']:.0%}",
                        number(v["mean_abs_delta_logprob"], ".4f"),
                        number(v["max_abs_delta_logprob"], ".3f"),
                        f"{blocks['bfloat16']:,} → {blocks['fp8']:,}",
                        link(path.name, prefix),
                    ]
                )
    return markdown(
        [
            "device",
            "model, compute dtype",
            "fp8 scales",
            "greedy tokens equal before the first difference",
            "completions equal",
            "mean abs Δ logprob",
            "max abs Δ logprob",
            "blocks per GiB, bf16 → fp8",
            "record",
        ],
        rows,
    )


DECODE_BATCHES = [(1, 16), (17, 64), (65, 128), (129, 192), (193, 256)]


def decode_batches_table(prefix: str) -> str:
    """The mean decode step of a record by batch size (its steps' own batches), against the mean of
    the workload's limit steps of those batches (benchmarks/limits.py decode_step_limits)."""
    records = [
        (
            "Qwen3-0.6B shape, checkpoint sampling",
            "nanovllm-checkpoint-sampling_qwen3-0.6b_final_h200.json",
        ),
        ("same, fp8 KV cache", "nanovllm-checkpoint-sampling-fp8-kv_qwen3-0.6b_final_h200.json"),
        ("Llama-3.2-1B shape, temperature only", "nanovllm_llama-3.2-1b_final_h200.json"),
    ]
    rows = []
    for what, rel in records:
        record = load(rel)
        measured, limits = record["stats"]["decode_steps_by_num_seqs"], decode_step_limits(record)
        cells = []
        for lo, hi in DECODE_BATCHES:
            steps = [
                (v["steps"], v["ms_mean"])
                for batch, v in measured.items()
                if lo <= int(batch) <= hi
            ]
            at_limit = [seconds for batch, seconds in limits if lo <= batch <= hi]
            mean_ms = sum(n * ms for n, ms in steps) / sum(n for n, _ in steps)
            limit_ms = sum(at_limit) / len(at_limit) * 1e3
            cells.append(f"{mean_ms:.2f} / {limit_ms:.2f} ms (+{mean_ms - limit_ms:.2f})")
        rows.append([what, *cells, link(rel, prefix)])
    return markdown(
        ["decode steps of", *[f"batch {lo}–{hi}" for lo, hi in DECODE_BATCHES], "record"], rows
    )


SPEC_COURSE = ("stories", "spec_decode_course-llama"), ("repeat", "spec_decode_repeat_course-llama")


def spec_decode_course_table(prefix: str, tag: str) -> str:
    """benchmarks/spec_decode.py on the course model on one device: per workload, batch and
    proposer, the speedup over plain decoding and the tokens per verification at each k; plain
    decoding's tok/s."""
    rows = []
    for workload, name in SPEC_COURSE:
        rel = f"{name}_{tag}.json"
        record = load(rel)
        record = record[0] if isinstance(record, list) else record
        ks = sorted({r["k"] for r in record["rows"]})
        for batch in sorted({r["batch"] for r in record["rows"]}):
            at = [r for r in record["rows"] if r["batch"] == batch]
            plain = max(max(r["plain_tok_s"], r["plain_tok_s_no_overlap"]) for r in at)
            for method in ("draft_model", "ngram", "none"):
                cells = {r["k"]: r for r in at if r["method"] == method}
                rows.append(
                    [workload, str(batch), method, f"{plain:,.0f}"]
                    + [
                        f"{cells[k]['speedup']:.2f}× ({cells[k]['mean_acceptance_length'] or 0:.2f})"
                        if k in cells
                        else "—"
                        for k in ks
                    ]
                    + [link(rel, prefix)]
                )
    header = ["prompts", "batch", "proposer", "plain tok/s (best row)"] + [
        f"k = {k}: speedup (tokens / verify)" for k in ks
    ]
    return markdown(header + ["record"], rows)


SPEC_GPU_SHAPES = ("qwen3-8b", "qwen3-0.6b")
SPEC_GPU_COLUMNS = (
    ("replay", 1.0, "all accepted"),
    ("replay", 0.5, "half accepted"),
    ("replay", 0.0, "all rejected"),
    ("none", None, "nothing proposed"),
    ("ngram", None, "n-gram lookup"),
)


def spec_decode_gpu_table(prefix: str, tag: str) -> str:
    """benchmarks/spec_decode.py on random-weight shapes: per shape, batch and k, the speedup over
    the faster of plain decoding with and without overlap, per proposal kind, and a verify step's
    time over a decode step's (all proposals accepted)."""
    rows = []
    for shape in SPEC_GPU_SHAPES:
        rel = f"spec_decode_{shape}_{tag}.json"
        if not (RESULTS / rel).exists():
            continue  # a shape not recorded on this device
        record = load(rel)
        for batch in sorted({r["batch"] for r in record["rows"]}):
            for k in sorted({r["k"] for r in record["rows"]}):
                at = {
                    (r["method"], r["replay_accept"]): r
                    for r in record["rows"]
                    if r["batch"] == batch and r["k"] == k
                }
                cells = [
                    f"{at[m, a]['speedup']:.2f}×" if (m, a) in at else MISSING
                    for m, a, _ in SPEC_GPU_COLUMNS
                ]
                full = at.get(("replay", 1.0), {}).get("verify_over_decode")
                rows.append(
                    [f"{shape}, {batch}", str(k), *cells, number(full, ".2f"), link(rel, prefix)]
                )
    header = ["shape, batch", "k", *[name for _, _, name in SPEC_GPU_COLUMNS]]
    return markdown(header + ["verify / decode step", "record"], rows)


DEVICES = (
    "h200",
    "h100",
)  # the single-GPU machines whose records have a final table: final-h200, final-h100
TABLES: dict[str, Callable[[str], str]] = {
    "ladder": ladder_table,
    "small": small_table,
    **{f"final-{tag}": functools.partial(final_table, tag=tag) for tag in DEVICES},
    "decode-batches": decode_batches_table,
    "tp": tp_table,
    "serve": serve_table,
    "kv-quality": kv_quality_table,
    "spec-decode-cpu": functools.partial(spec_decode_course_table, tag="cpu"),
    "spec-decode-course-h100": functools.partial(spec_decode_course_table, tag="h100"),
    **{f"spec-decode-{tag}": functools.partial(spec_decode_gpu_table, tag=tag) for tag in DEVICES},
}


def fill(text: str, prefix: str = "") -> str:
    """`text` with every table block regenerated (links relative to `prefix`, the README's
    path to the repository root); an unknown table name is an error."""

    def replace(match: re.Match) -> str:
        name = match[2]
        if name not in TABLES:
            raise ValueError(f"unknown table {name!r}; known: {', '.join(TABLES)}")
        return match[1] + TABLES[name](prefix) + match[4]

    return BLOCK.sub(replace, text)


# ---- the index of benchmarks/results/ ----

SPEC_DECODE = (
    "speculative decoding: output tok/s per batch, k and proposer (n-gram, a draft model, none, the "
    "benchmark-only replay proposer at a set acceptance) against plain decoding with and without overlap "
    "scheduling, tokens per verification, a verify step's median time against a decode step's; greedy "
    "tokens compared with plain decoding"
)

# (file-name pattern, the command or suite part that writes it, what it holds); first match wins.
# Records of benchmarks/run.py need no entry: they say what they measured and how they were made.
FILES = [
    (
        "gpu_tests_final_*.log",
        f"{SUITE} final-tests",
        "pytest log: the final engine's GPU tests, its fp8 KV cache and its fused and MoE "
        "Triton kernels on CUDA",
    ),
    (
        "gpu_tests_*.log",
        f"{SUITE} tests",
        "pytest log: the Triton kernels and tests/test_gpu.py on CUDA (07 and final)",
    ),
    (
        "tp_gpu_tests_07_*.log",
        f"{SUITE} tp-tests tp-message tp",
        "log: tests/test_gpu_tp.py for stage 07 on two GPUs, then the tp-message and tp parts",
    ),
    (
        "tp_gpu_tests_*.log",
        f"{SUITE} tp-tests",
        "pytest log: tests/test_gpu_tp.py for the final engine on two GPUs",
    ),
    (
        "runner_rows_*.log",
        "the benchmarks.run commands it lists (`=== ...`)",
        "the runner's printed rows: 03–06 one after another in one process, final; 01 and final on the small workload",
    ),
    (
        "kernel_bench_*.json",
        f"{SUITE} kernels",
        "paged decode and prefill attention kernels against torch's SDPA",
    ),
    (
        "final_kernels_*.json",
        f"{SUITE} final-kernels",
        "the final engine's fused kernels against the layers' PyTorch code; prefill attention tile choices against torch's varlen_attn",
    ),
    (
        "sampler_candidates_*.json",
        f"{SUITE} sampler",
        "each row's 20 largest logits (the sampler's candidates under top-k): the "
        "grouped pass as PyTorch ops against its two fused kernels and torch.topk, Qwen3's and Llama-3's vocabularies, 1 to 256 rows",
    ),
    (
        "sampler_draws_*.json",
        f"{SUITE} sampler",
        "the Sampler's draw as the engine calls it, temperature only and with top-k 20 / "
        "top-p 0.95: the fused draw (noise hashed in registers) against its PyTorch code on the GPU, Qwen3's and Llama-3's "
        "vocabularies, 1 to 256 rows",
    ),
    (
        "decode_latency_*.json",
        f"{SUITE} latency",
        "median decode-step latency with and without CUDA graphs, 32-token prompts, per batch size",
    ),
    (
        "dense_gemv_decode_latency_*.json",
        f"{SUITE} latency",
        "median graph decode-step latency per batch size with the dense layers' matrix-vector path up to 0 (cuBLAS only), 2 and 4 rows",
    ),
    (
        "host_overhead_cpu.json",
        "python -m benchmarks.host_overhead --engine 03 --engine 04 --engine 05 --out benchmarks/results/host_overhead_cpu.json",
        "each stage's engine loop with a stub model on one CPU core: the host's time per step",
    ),
    (
        "host_overhead_prefix-hits_final_cpu.json",
        "python -m benchmarks.host_overhead --engine final --num-blocks 65536 --passes 2 "
        "--repeat 2 --out benchmarks/results/host_overhead_prefix-hits_final_cpu.json",
        "the final engine's generate with the device's work stubbed, twice on one engine with the 0.6B shape's whole H200 pool: "
        "the second pass's prompts are prefix-cache hits on freed blocks",
    ),
    (
        "host_overhead_final_cpu.json",
        "python -m benchmarks.host_overhead --engine final --repeat 5 --out benchmarks/results/host_overhead_final_cpu.json",
        "the final engine's generate with the device's work stubbed (a tiny model's runner and sampler): the host's time per step, "
        "which an overlapped step cannot go below",
    ),
    (
        "host_overhead_verify_final_cpu.json",
        "python -m benchmarks.host_overhead --engine final --speculative 4 --num-seqs 1 --repeat 5 "
        "--out benchmarks/results/host_overhead_verify_final_cpu.json",
        "the final engine's generate with the device's work stubbed, greedy at batch 1 without overlap: the host's time per "
        "decode step against per verify step of 4 proposals (every one accepted), in turns",
    ),
    (
        "tp_message_cost_cpu.json",
        "python -m benchmarks.tp_message_cost --out benchmarks/results/tp_message_cost_cpu.json",
        "host cost of the per-step message rank 0 sends each worker",
    ),
    (
        "tp_message_cost_*.json",
        f"{SUITE} tp-message",
        "host cost of the per-step message rank 0 sends each worker",
    ),
    (
        "tp_speedup_*.json",
        "python -m benchmarks.tp_speedup --out benchmarks/results/tp_speedup_h200x2.json",
        "TP=2 against TP=1 per model shape, from the tp_*_tp1/tp2 records (the last step of the suite's tp part)",
    ),
    (
        "profile_steps_*.json",
        "python -m benchmarks.profile_steps --engine final --shape S --variant fused --num-seqs N "
        "--prompt-len L --max-tokens T --top K --out benchmarks/results/profile_steps_S_NxL_final_h200.json",
        "torch.profiler over the final engine's steps at one batch size and context (S, N, L and T are the record's shape, num_seqs, "
        "prompt_len and max_tokens, K the length of its kernel lists): per step wall, GPU busy and idle time, and the top kernels "
        "of its prefill and decode steps",
    ),
    (
        "decode_attention_*.json",
        f"{SUITE} decode-attention",
        "the final engine's paged decode attention on a real run's context mix "
        "(bf16 cache, or fp8 where the name says so): tiles, launch order (batch order, longest first) and split-K factors, with the bandwidth reached",
    ),
    (
        "fp8_attention_*.json",
        f"{SUITE} fp8-attention",
        "attention over an fp8 KV cache on Qwen3-0.6B's heads: e4m3 "
        "tensor-core products (P·V in e4m3 or with V widened; q's scale per head or per tensor) against widening the tiles: "
        "errors against the widening kernel and the exact reference, decode time and bandwidth on a real run's context mix, "
        "prefill TFLOP/s",
    ),
    (
        "decode_tiles_*.json",
        f"{SUITE} decode-attention",
        "the final engine's decode kernel as a decode step calls it (the new "
        "K/V stored, q/k norms and RoPE applied) on a real run's context mix, per tile choice, checked against the PyTorch path: "
        "what the decode_attention choices of kernels/configs/ were picked by (bf16 cache, or fp8 where the name says so; Qwen3-0.6B's or Llama-3.2-1B's heads; "
        "blocks where the engine's block manager puts them, or at random places where the name or a note says so)",
    ),
    (
        "gemv_tiles_*.json",
        f"{SUITE} gemv",
        "a decode step's dense projections at one and two rows, with as many distinct weights as the "
        "model has layers: the matrix-vector kernels for each tile choice against cuBLAS",
    ),
    (
        "gemv_rows_*.json",
        "python -m nanovllm_final.tune --only gemv --out benchmarks/results/gemv_rows_h100.json",
        "the tuner's output for the gemv section alone (the other sections kept as the device's file has them): "
        "per projection kind (linear, gate_up, down): the row loop's and the tensor-core product's tiles, their "
        "times against cuBLAS by rows, and the rows each takes (rows, dot_rows); the engine reads its config file",
    ),
    (
        "draft_agreement_course-llama_cpu.json",
        "python -m benchmarks.draft_agreement --out benchmarks/results/draft_agreement_course-llama_cpu.json",
        "the course model's draft (models/course-llama-draft) teacher-forced on the course model's greedy text (held-out "
        "story prompts, CPU, float32): per-token agreement a, and tokens per verify step for k = 1..8, from (1 - a^(k+1)) / (1 - a) "
        "and replayed on the match vector",
    ),
    (
        "spec_decode_course-llama_cpu.json",
        "python -m benchmarks.spec_decode --model models/course-llama --draft "
        "models/course-llama-draft --device cpu --workload stories --batches 1 8 64 --ks 2 4 6 --accept --repeat 9 "
        "--max-tokens 128 --out benchmarks/results/spec_decode_course-llama_cpu.json",
        SPEC_DECODE
        + "; the course model with its draft and with n-gram lookup, on openings of held-out stories",
    ),
    (
        "spec_decode_repeat_course-llama_cpu.json",
        "python -m benchmarks.spec_decode --model models/course-llama --draft "
        "models/course-llama-draft --device cpu --workload repeat --batches 1 8 64 --ks 2 4 6 --accept --repeat 9 "
        "--max-tokens 128 --out benchmarks/results/spec_decode_repeat_course-llama_cpu.json",
        SPEC_DECODE
        + "; the course model with its draft and with n-gram lookup, on requests to repeat a quoted passage",
    ),
    (
        "spec_decode_course-llama_h100.json",
        "python -m benchmarks.spec_decode --model models/course-llama --draft "
        "models/course-llama-draft --device cuda --workload stories --batches 1 8 64 --ks 2 4 6 --accept --repeat 3 "
        "--max-tokens 128 --out benchmarks/results/spec_decode_course-llama_h100.json",
        SPEC_DECODE
        + "; the course model with its draft and with n-gram lookup, on openings of held-out stories, on one GPU",
    ),
    (
        "spec_decode_repeat_course-llama_h100.json",
        "python -m benchmarks.spec_decode --model models/course-llama --draft "
        "models/course-llama-draft --device cuda --workload repeat --batches 1 8 64 --ks 2 4 6 --accept --repeat 3 "
        "--max-tokens 128 --out benchmarks/results/spec_decode_repeat_course-llama_h100.json",
        SPEC_DECODE
        + "; the course model with its draft and with n-gram lookup, on requests to repeat a quoted passage, on one GPU",
    ),
    (
        "variants/spec_decode_course-llama_xeon_cpu.json",
        "python -m benchmarks.spec_decode --model models/course-llama --draft models/course-llama-draft "
        "--device cpu --workload stories --batches 1 8 --ks 2 4 6 --accept --repeat 3 --max-tokens 128 "
        "--out benchmarks/results/variants/spec_decode_course-llama_xeon_cpu.json",
        SPEC_DECODE
        + "; the course model with its draft and with n-gram lookup, on openings of held-out stories, on a 2-core Intel "
        "Xeon (the CPU's products on MKL, the engine's choice there)",
    ),
    (
        "variants/spec_decode_course-llama_onednn_xeon_cpu.json",
        "NANOVLLM_CPU_ONEDNN=1 python -m benchmarks.spec_decode --model models/course-llama --draft "
        "models/course-llama-draft --device cpu --workload stories --batches 1 8 --ks 2 4 6 --accept --repeat 3 "
        "--max-tokens 128 --out benchmarks/results/variants/spec_decode_course-llama_onednn_xeon_cpu.json",
        SPEC_DECODE
        + "; the same on the same Intel Xeon, right after, with the products of two or more rows on oneDNN (the "
        "engine's choice on AMD CPUs)",
    ),
    (
        "spec_decode_batch-1_k-4_repeat-9_*.json",
        "python -m benchmarks.spec_decode --shape qwen3-0.6b --batches 1 --ks 4 --accept 1.0 --repeat 9 "
        "--out benchmarks/results/variants/spec_decode_batch-1_k-4_repeat-9_qwen3-0.6b_DEVICE.json",
        "batch 1, k = 4 of the speculative decoding record with nine timed runs of each engine in turn (the "
        "median kept): n-gram lookup, nothing proposed and the replay proposer at acceptance 1 against plain "
        "decoding, and a verify step's median time against a decode step's",
    ),
    (
        "spec_decode_*.json",
        "python -m benchmarks.spec_decode --shape S --batches 1 8 --ks 1 2 3 4 5 6 7 8 "
        "--accept 1.0 0.5 0.0 --out benchmarks/results/spec_decode_S_h200.json (S: the record's model)",
        SPEC_DECODE,
    ),
    (
        "verify_profile_gemv-unsplit_*.json",
        "python -m benchmarks.verify_profile --shape qwen3-0.6b --batch 1 --k 4 --repeat 9 "
        "--out benchmarks/results/variants/verify_profile_gemv-unsplit_qwen3-0.6b_DEVICE.json, with the "
        "device's file's earlier gemv section, tuned without split tilings (its records' kernel_config)",
        "the verify_profile record's steps without the tuner's split tilings (the tensor-core product's K "
        "split over several programs), timed in turns with the record's runs on the same machine",
    ),
    (
        "verify_profile_gemv-linear-loop-5_*.json",
        "NANOVLLM_KERNEL_CONFIG=FILE python -m benchmarks.verify_profile --shape qwen3-0.6b --batch 1 --k 4 "
        "--repeat 9 --out benchmarks/results/variants/verify_profile_gemv-linear-loop-5_qwen3-0.6b_DEVICE.json "
        "(FILE: the device's file with linear's rows at 5; its records' kernel_config)",
        "the verify_profile record's steps with qkv and o on the row loop at a verify step's 5 rows instead "
        "of cuBLAS",
    ),
    (
        "verify_profile_*.json",
        "python -m benchmarks.verify_profile --shape qwen3-0.6b --batch 1 --k 4 "
        "--out benchmarks/results/verify_profile_qwen3-0.6b_DEVICE.json",
        "a verify step of k = 4 (every proposal accepted) against a decode step, both without overlap "
        "scheduling: step times, GPU busy time, host time before the GPU's first activity, the GPU's "
        "idle gaps by the activities around them (a CUDA graph's launch among them), top kernels, the "
        "host time of one CUDA-graph replay",
    ),
    (
        "kv_cache_quality_cpu.json",
        "python -m benchmarks.kv_cache_quality --out benchmarks/results/kv_cache_quality_cpu.json",
        "kv_cache_dtype='fp8' against 'auto': greedy agreement, teacher-forced mean abs Δ logprob, KV blocks per GiB "
        "(course model, the qwen3-0.6b shape with 4 layers)",
    ),
    (
        "kv_cache_quality_fp8-products_*.json",
        "NANOVLLM_FP8_DOT=1 python -m benchmarks.kv_cache_quality --device cuda "
        "--random-layers 0 --out benchmarks/results/kv_cache_quality_fp8-products_DEVICE.json",
        "kv_cache_dtype='fp8' against 'auto' on the GPU with attention's fp8 tensor-core products: greedy agreement, "
        "teacher-forced mean abs Δ logprob (course model, the qwen3-0.6b shape)",
    ),
    (
        "kv_cache_quality_*.json",
        f"{SUITE} kv-quality",
        "kv_cache_dtype='fp8' against 'auto' on the GPU: greedy agreement, "
        "teacher-forced mean abs Δ logprob, KV blocks per GiB (course model, the qwen3-0.6b shape)",
    ),
    (
        "grammar_engines_compile_mask_cpu.json",
        "python benchmarks/grammar_engines.py --out benchmarks/results/grammar_engines_compile_mask_cpu.json",
        "xgrammar against llguidance: schema compile time and one row's mask-fill time over the 20 shared schemas "
        "(benchmarks/structured_schemas.py), course and tiny Qwen3 tokenizers",
    ),
    (
        "structured_step_time_*_cpu.json",
        "python -m benchmarks.structured_bench --shape tiny-qwen3 --batch 32 --device cpu "
        "--max-tokens 48 --out benchmarks/results/structured_step_time_tiny-qwen3_cpu.json",
        "decode step time with every row under a JSON schema against none, overlap scheduling on and off; schema compile "
        "percentiles (a tiny model on a shared CPU: the host's cost, noisy)",
    ),
    (
        "structured_step_time_fill-threads-*_repeats-5_*.json",
        "NANOVLLM_FILL_THREADS=T python -m benchmarks.structured_bench --shape qwen3-0.6b --batch 256 --repeats 5 "
        "--out benchmarks/results/variants/structured_step_time_fill-threads-T_repeats-5_qwen3-0.6b_DEVICE.json",
        "the batch-256 structured step record with five runs of each mode, the bitmask filled on the engine's "
        "thread (T = 0), then on a FillPool of 4 threads (T = 4), on one machine",
    ),
    (
        "structured_step_time_fill-threads-*.json",
        "NANOVLLM_FILL_THREADS=T python -m benchmarks.structured_bench --shape qwen3-0.6b --batch 256 --repeats 3 "
        "--out benchmarks/results/variants/structured_step_time_fill-threads-T_qwen3-0.6b_DEVICE_N.json",
        "the batch-256 structured step record with the bitmask filled on a FillPool of T threads (0: on the engine's "
        "thread), T = 4, 1, 0 in turn on one machine, three times over (N): how far apart the settings and the "
        "repeats are",
    ),
    (
        "structured_step_time_repeats-9_*.json",
        "python -m benchmarks.structured_bench --shape qwen3-0.6b --batch 256 --repeats 9 "
        "--out benchmarks/results/variants/structured_step_time_repeats-9_qwen3-0.6b_DEVICE.json",
        "the batch-256 structured step record with nine runs of each mode, alternated, on one machine: every "
        "run's step time is in the record, so the spread between runs shows beside the medians",
    ),
    (
        "structured_step_time_*.json",
        "python -m benchmarks.structured_bench --shape qwen3-0.6b --batch 256 --repeats 3 "
        "--out benchmarks/results/structured_step_time_qwen3-0.6b_DEVICE.json",
        "decode step time at batch 256 with every row under a JSON schema against none (the median of three runs of "
        "each, alternated), overlap scheduling on and off; schema compile percentiles (the factory's small tokenizer); "
        "the constrained step's pieces (advance, fill, upload, apply)",
    ),
    (
        "structured_mask_pieces_full-vocab-matchers_*_cpu.json",
        "python -m benchmarks.structured_bench --pieces-only 151936 "
        "--batch 256 --device cpu --full-vocab-matchers --out benchmarks/results/"
        "structured_mask_pieces_full-vocab-matchers_qwen3-0.6b-vocab_cpu.json",
        "a constrained step's pieces at batch 256 (matchers' advance, bitmask fill, upload, apply, PyTorch apply) with the "
        "matchers and bitmask over the whole 151,936-id vocabulary, the tiny tokenizer's 500 ids in it",
    ),
    (
        "structured_mask_pieces_*_cpu.json",
        "python -m benchmarks.structured_bench --pieces-only 151936 --batch 256 --device cpu "
        "--out benchmarks/results/structured_mask_pieces_qwen3-0.6b-vocab_cpu.json",
        "a constrained step's pieces at batch 256 (matchers' advance, bitmask fill, upload, apply, PyTorch apply), the matchers "
        "and bitmask over the tokenizer's ids, the logits over 151,936",
    ),
    (
        "structured_mask_pieces_*.json",
        "python -m benchmarks.structured_bench --pieces-only 151936 --batch 256 --device cuda "
        "[--full-vocab-matchers] --out benchmarks/results/structured_mask_pieces_[full-vocab-matchers_]qwen3-0.6b-vocab_DEVICE.json",
        "a constrained step's pieces at batch 256 on the GPU (matchers' advance, bitmask fill, upload, the Triton apply, the "
        "PyTorch apply); with full-vocab-matchers in the name, the matchers and bitmask over the whole 151,936 ids",
    ),
    (
        "moe_layer_*.json",
        f"{SUITE} moe",
        "one MoE layer of a shape: the fused grouped-GEMM kernels (eager and graph-replayed, per tile choice) against the expert loop",
    ),
    (
        "prompt_logprobs_memory_*.json",
        "python -m benchmarks.prompt_logprobs_memory --shape qwen3-0.6b --max-model-len 8192",
        "one prompt of max_model_len - 1 tokens scored with prompt_logprobs against the same prompt without: peak device memory and "
        "time, beside the bytes of its full prompt x vocabulary logits",
    ),
    (
        "serve_*.json",
        f"{SUITE} serve",
        "the OpenAI-compatible server under concurrent streaming clients: throughput, TTFT / TPOT / "
        "end-to-end percentiles; the offline engine on the same requests: served / offline, its decode steps (the mean of all, and at the "
        "server's batch in newer records) and TPOT p50 over the latter",
    ),
]
RUN_PARTS = [  # the suite part that writes each kind of benchmarks/run.py record
    ("tp_*", "tp"),
    ("variants/*-config_*", "throughput"),
    ("variants/*no_overlap*", "checkpoint"),
    ("variants/*breakdown*", "breakdown"),
    ("variants/nanovllm-short*", "short"),
    ("variants/*fp8-products-vs-widening*", "fp8-pair"),
    ("variants/nanovllm-checkpoint-sampling*", "checkpoint"),
    ("variants/nanovllm_qwen3-30b-a3b*", "moe"),
    ("variants/nanovllm_llama-3.2-1b*", "throughput"),
    ("small-*", "small"),
    ("shared-prefix*", "shared-prefix"),
    ("hf_vs_*", "hf"),
    ("nanovllm-checkpoint-sampling*", "checkpoint"),
    ("nanovllm_*", "throughput"),
]


def clean_command(command: str, rel: str) -> str:
    """A record's command line as one runs it from the repository root: `python`, `--out`
    naming the file where it now lies, and no `--server-log` (a log the results do not keep)."""
    words = shlex.split(command)
    # NAME=value words first: the environment it ran with
    at = next((i for i, word in enumerate(words) if "=" not in word), len(words))
    if at < len(words) and Path(words[at]).name.startswith("python"):
        words[at] = "python"
    if "--out" in words:
        words[words.index("--out") + 1] = f"benchmarks/results/{rel}"
    if "--server-log" in words:
        i = words.index("--server-log")
        del words[i : i + 2]
    return shlex.join(words)


def run_records(data: object) -> list[dict]:
    from benchmarks.results import is_run_record

    records = data if isinstance(data, list) else [data]
    return [r for r in records if is_run_record(r)]


def run_summary(records: list[dict]) -> str:
    """What a file of run.py records measured: engines, workload, shape, sampling, options, device."""
    first = records[0]
    workload = first["workload"]
    params = ", ".join(
        f"{k}={v}"
        for k, v in workload.get("params", {}).items()
        if k in ("num_seqs", "max_input_len", "max_output_len", "prefix_len")
    )
    sampling = ", ".join(f"{k}={v}" for k, v in (workload.get("sampling") or {}).items())
    options = {
        k: v for k, v in (first.get("engine_options") or {}).items() if k not in ("device", "dtype")
    }
    engines = " → ".join(
        f"{r['engine']} {r['output_tokens_per_s']:,.0f}"
        if "output_tokens_per_s" in r
        else f"{r['engine']} (failed)"
        for r in records
    )
    shape = first["model"].get("shape") or first["model"].get("path")
    extra = "".join(
        f"; {label} {value}"
        for label, value in (
            ("sampling", sampling),
            ("options", ", ".join(f"{k}={v}" for k, v in options.items())),
        )
        if value
    )
    breakdown = "; per-step breakdown" if any("breakdown" in r for r in records) else ""
    return f"`{workload['name']}` ({params}), {shape}, {first['device_name']}{extra}{breakdown}: output tok/s {engines}"


def describe(rel: str) -> tuple[str, str]:
    """(what the file holds, the command that makes it)."""
    path = RESULTS / rel
    data = json.loads(path.read_text()) if rel.endswith(".json") else None
    records = run_records(data) if data is not None else []
    if records:
        part = next(p for pattern, p in RUN_PARTS if fnmatch.fnmatch(rel, pattern))
        commands = sorted({clean_command(r["command"], rel) for r in records if r.get("command")})
        what = run_summary(records)
        return what, " ".join(f"`{c}`" for c in commands) + f" (`{SUITE} {part}`)"
    for pattern, command, what in FILES:
        if fnmatch.fnmatch(Path(rel).name, pattern):
            if isinstance(data, dict) and data.get("command"):
                command = (
                    f"`{clean_command(data['command'], rel)}` (`{command}`)"
                    if command.startswith(SUITE)
                    else command
                )
            elif not command.startswith("the "):
                command = f"`{command}`"
            return what, command
    raise ValueError(
        f"benchmarks/results/{rel}: no entry in benchmarks/tables.py FILES says what it is and which command makes it"
    )


def result_files() -> list[str]:
    return sorted(
        p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file() and p != INDEX
    )


def index() -> str:
    rows = [[f"[`{rel}`]({rel})", *reversed(describe(rel))] for rel in result_files()]
    return (
        "# Recorded results\n\n"
        "Every file here, what it holds and the command that makes it (run from the repository root;\n"
        "`bash benchmarks/gpu_suite.sh --help` lists the suite's parts). Records of `benchmarks/run.py`\n"
        "(schema: `benchmarks/README.md`) also carry their own command, versions and device; a record's\n"
        "`notes` field says what its fields do not (the host it ran on, the code it measured). Files in\n"
        "`variants/` are kept out of the notebooks' globs over this folder. Generated by\n"
        "`python -m benchmarks.tables`; `tests/test_benchmarks.py` fails when it is out of date.\n\n"
        + markdown(["file", "command", "what"], rows)
    )


# ---- main ----


def outputs() -> dict[Path, str]:
    """Every generated file, with the text it should have."""
    prefixes = {readme: "../" * (len(readme.relative_to(ROOT).parts) - 1) for readme in READMES}
    return {INDEX: index()} | {
        readme: fill(readme.read_text(encoding="utf-8"), prefixes[readme])
        for readme in READMES
        if readme.is_file()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="change nothing; exit 1 if a generated file is out of date",
    )
    args = parser.parse_args(argv)
    stale = [
        path
        for path, text in outputs().items()
        if not path.is_file() or path.read_text(encoding="utf-8") != text
    ]
    if args.check:
        for path in stale:
            print(f"out of date: {path.relative_to(ROOT)} (run `python -m benchmarks.tables`)")
        return 1 if stale else 0
    for path, text in outputs().items():
        if path in stale:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
