"""Attention over an fp8 KV cache: e4m3 tensor-core products against widening the tiles.

    python benchmarks/fp8_attention_bench.py        # -> benchmarks/results/fp8_attention_<device>.json

The variants (kernels/attention.py): `widen` (each e4m3 K/V tile widened to fp16 in registers:
the path of devices without fp8 `tl.dot`, and the reference) and the fp8-dot path with P·V in
e4m3 (`p-fp8`) or with V widened to fp16 (`v-fp16`), q's scale per head per step (`q-head`)
or a static per-tensor 1.0 (`q-tensor`). Qwen3-0.6B's attention shape (16 query heads, 8 kv
heads, head_dim 128, blocks of 16), bf16 q, the cache's scales 1.0 (the engine's), random
values drawn in e4m3's range.

(a) correctness, decode and prefill, at the context lengths of nano-vllm's workload: each
    variant against the widening kernel and against the exact reference (the PyTorch path on
    the same e4m3 cache, fp32 math): max |error| and ||error|| / ||reference||; a variant
    passes where the latter stays under --max-rel-error.
(b) decode: the GPU time of CUDA-graph replays of the decode kernel at the workload's
    snapshots (decode_attention_bench.snapshot: batch 256 after 1 step, fewer later) in the
    engine's launch order and split choice, and the bandwidth reached: the fp8 K/V bytes the
    batch must read over that time, also as a share of this device's copy bandwidth
    (benchmarks/limits.measure_peaks). Tiles are swept for each variant at the first snapshot;
    its best serves the others. Prefill: one step of the workload's prompts (up to 16,384
    tokens) per variant at the device's prefill tile, in TFLOP/s.
(c) a table, and the JSON record (--out, default benchmarks/results/fp8_attention_<device>.json).

Without CUDA, part (a) runs in the Triton interpreter on a small case, and the script exits 2:
timings need a CUDA GPU.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of a kernel module

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_attention_bench import (  # noqa: E402
    BLOCK,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    paged_batch,
    snapshot,
)
from benchmarks.limits import measure_peaks  # noqa: E402
from nanovllm_final.kernels import attention as tri  # noqa: E402
from nanovllm_final.kernels import tuning  # noqa: E402
from nanovllm_final.kernels.timing import graph_time_ms  # noqa: E402
from nanovllm_final.layers import attention_torch as ref  # noqa: E402
from nanovllm_final.workloads import nanovllm  # noqa: E402

FP8 = torch.float8_e4m3fn
STEPS = (1, 300, 600, 750, 900, 1000)  # decode snapshots: steps into the workload's run
# BLOCK_N, num_warps, num_stages, BLOCK_H (None: _group_rows's, 64 for e4m3 products on Hopper at 4+ warps,
# else 16; 16 at 4 warps measures Hopper's e4m3 products widened by Triton against its warpgroup MMA)
TILES = [
    (64, 2, 2, None),
    (64, 4, 2, None),
    (128, 4, 2, None),
    (128, 8, 2, None),
    (32, 2, 3, None),
    (64, 4, 2, 16),
]
PREFILL_TOKENS = 16384  # a prefill step's token budget (the engine's max_num_batched_tokens)


def variants(device: torch.device) -> dict[str, dict]:
    """Each variant's keyword arguments to the attention kernels."""
    one = torch.ones(1, dtype=torch.float32, device=device)  # a static per-tensor q scale
    out = {"widen": {"fp8_dot": False}}
    for pv in ("p-fp8", "v-fp16"):
        for qs in ("q-head", "q-tensor"):
            out[f"{pv} {qs}"] = {
                "fp8_dot": True,
                "pv_fp8": pv == "p-fp8",
                "q_scale": one if qs == "q-tensor" else None,
            }
    return out


def device_tag(device: torch.device) -> str:
    """'h100' for "NVIDIA H100 80GB HBM3": the first word of the name with a digit in it."""
    if device.type != "cuda":
        return "cpu"
    words = torch.cuda.get_device_name(device).replace("NVIDIA", "").split()
    return next(
        (w for w in words if any(c.isdigit() for c in w)), words[0] if words else "gpu"
    ).lower()


def cache_case(contexts: list[int], q_lens: list[int], device: torch.device, seed: int = 0) -> dict:
    """paged_batch's shuffled paged e4m3 cache holding `contexts` (scales 1.0), and bf16 q for the
    last q_lens[i] positions of sequence i."""
    torch.manual_seed(seed)
    _, k_cache, v_cache, lens, tables = paged_batch(contexts, torch.bfloat16, FP8, device=device)
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    cu = torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32)
    ones = torch.ones(KV_HEADS, device=device)
    return {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "context_lens": lens,
        "block_tables": tables,
        "cu_seqlens_q": cu,
        "k_scale": ones,
        "v_scale": ones,
        "max_q": max(q_lens),
    }


def attend(case: dict, decode: bool, backend=tri, **kwargs) -> torch.Tensor:
    """The case's decode (each sequence's last query) or prefill attention through `backend`."""
    scales = {"k_scale": case["k_scale"], "v_scale": case["v_scale"]}
    args = (case["k_cache"], case["v_cache"])
    if decode:  # one query per sequence: q, or each sequence's last
        q = (
            case["q"]
            if len(case["q"]) == len(case["context_lens"])
            else case["q"][case["cu_seqlens_q"][1:].long() - 1]
        )
        return backend.paged_decode_attention(
            q, *args, case["context_lens"], case["block_tables"], HEAD_DIM**-0.5, **scales, **kwargs
        )
    return backend.paged_prefill_attention(
        case["q"],
        *args,
        case["cu_seqlens_q"],
        case["context_lens"],
        case["block_tables"],
        HEAD_DIM**-0.5,
        case["max_q"],
        **scales,
        **kwargs,
    )


def errors(got: torch.Tensor, want: torch.Tensor) -> dict:
    got, want = got.float(), want.float()
    return {
        "max_abs": (got - want).abs().max().item(),
        "rel_l2": ((got - want).norm() / want.norm()).item(),
    }


def correctness(cases: dict[str, tuple[dict, bool]], device: torch.device, max_rel: float) -> dict:
    """Part (a): per case and variant, the errors against the widening kernel and the exact reference."""
    out = {}
    for name, (case, decode) in cases.items():
        exact = attend(case, decode, backend=ref)
        widen = attend(case, decode, fp8_dot=False)
        out[name] = {}
        for variant, kwargs in variants(device).items():
            try:
                got = attend(case, decode, **kwargs)
            except Exception as exc:  # e.g. a Triton without this fp8 product for the device
                out[name][variant] = {"error": repr(exc)[:300]}
                print(f"  {name} {variant}: {repr(exc)[:300]}")
                continue
            entry = {"vs_widen": errors(got, widen), "vs_exact": errors(got, exact)}
            entry["ok"] = bool(torch.isfinite(got).all()) and entry["vs_exact"]["rel_l2"] <= max_rel
            out[name][variant] = entry
    return out


def correctness_cases(device: torch.device) -> dict[str, tuple[dict, bool]]:
    """Decode at the workload's first and a late snapshot, prefill of whole prompts and of a chunk
    after a cached prefix; small ones under the interpreter."""
    if device.type != "cuda":
        return {
            "decode": (cache_case([100, 300], [1, 1], device), True),
            "prefill chunk": (cache_case([116], [16], device), False),
        }
    prompts, _ = nanovllm(151936, seed=0)
    lens = [len(p) for p in prompts]
    late = snapshot(900)
    return {
        "decode step 1": (cache_case([n + 1 for n in lens], [1] * len(lens), device), True),
        "decode step 900": (cache_case(late, [1] * len(late), device), True),
        "prefill prompts": (cache_case(lens[:8], lens[:8], device), False),
        "prefill chunk": (cache_case([n + 512 for n in lens[:8]], [512] * 8, device), False),
    }


def decode_timing(device: torch.device, reps: int) -> list[dict]:
    """Part (b), decode: per snapshot and variant, ms and TB/s; every tile at the first snapshot."""
    default = tuning.for_device(device).decode(True, HEAD_DIM)
    tiles = list(
        dict.fromkeys(
            [(default["BLOCK_N"], default["num_warps"], default["num_stages"], None), *TILES]
        )
    )
    best, rows = {}, []
    for step in STEPS:
        contexts = snapshot(step)
        case = cache_case(contexts, [1] * len(contexts), device)
        order = torch.argsort(case["context_lens"], descending=True, stable=True).to(torch.int32)
        counters = tri.SplitCounters()  # split-K's, as each layer keeps them
        kv_bytes = sum(contexts) * KV_HEADS * HEAD_DIM * 2  # K and V, one byte a value
        row = {
            "step": step,
            "batch": len(contexts),
            "mean_context": sum(contexts) / len(contexts),
            "max_context": max(contexts),
            "kv_bytes": kv_bytes,
            "variants": {},
        }
        for variant, kwargs in variants(device).items():
            timed = {}
            for bn, w, st, bh in (
                tiles if step == STEPS[0] else [best[variant]] if variant in best else []
            ):
                if bh and not kwargs["fp8_dot"]:
                    continue  # widening's rows are 16 anyway
                key = f"{bn}w{w}s{st}" + (f"r{bh}" if bh else "")
                fn = lambda: attend(
                    case,
                    True,
                    order=order,
                    BLOCK_N=bn,
                    num_warps=w,
                    num_stages=st,  # noqa: B023,E731
                    BLOCK_H=bh,
                    counters=counters,
                    **kwargs,
                )  # noqa: B023
                try:
                    ms = graph_time_ms(fn, reps)
                except Exception as exc:  # e.g. out of shared memory, or no such fp8 product here
                    timed[key] = {"error": repr(exc)[:300]}
                    continue
                timed[key] = {"ms": ms, "TB_per_s": kv_bytes / ms / 1e9, "tile": [bn, w, st, bh]}
            for key, entry in timed.items():
                print(
                    f"  {variant} {key}: "
                    + (f"{entry['ms']:.4f} ms" if "ms" in entry else entry["error"][:200])
                )
            ok = {k: v for k, v in timed.items() if "ms" in v}
            if ok and step == STEPS[0]:
                best[variant] = tuple(min(ok.values(), key=lambda v: v["ms"])["tile"])
            row["variants"][variant] = {
                "tiles": timed,
                "best": min(ok, key=lambda k: ok[k]["ms"]) if ok else None,
            }
        rows.append(row)
        print(
            f"decode step {step:4d}: batch {row['batch']:3d}, mean context {row['mean_context']:6.0f}: "
            + ", ".join(
                f"{v} {_best_ms(row, v):.4f} ms" for v in row["variants"] if _best_ms(row, v)
            ),
            flush=True,
        )
    return rows


def _best_ms(row: dict, variant: str) -> float | None:
    entry = row["variants"][variant]
    return entry["tiles"][entry["best"]]["ms"] if entry["best"] else None


def prefill_timing(device: torch.device, reps: int) -> dict:
    """Part (b), prefill: one step of the workload's first prompts (at most PREFILL_TOKENS tokens),
    each variant at the device's prefill tile: ms and TFLOP/s (QK and PV, causal)."""
    prompts, _ = nanovllm(151936, seed=0)
    lens = []
    for p in prompts:
        if sum(lens) + len(p) > PREFILL_TOKENS:
            break
        lens.append(len(p))
    case = cache_case(lens, lens, device)
    flops = sum(4 * n * (n + 1) / 2 * HEADS * HEAD_DIM for n in lens)
    out = {"prompts": len(lens), "tokens": sum(lens), "flops": flops, "variants": {}}
    for variant, kwargs in variants(device).items():
        try:
            ms = graph_time_ms(lambda: attend(case, False, **kwargs), reps)  # noqa: B023
        except Exception as exc:
            out["variants"][variant] = {"error": repr(exc)[:300]}
            continue
        out["variants"][variant] = {"ms": ms, "TFLOP_per_s": flops / ms / 1e9}
    print(
        f"prefill of {len(lens)} prompts, {sum(lens)} tokens: "
        + ", ".join(
            f"{v} {e['ms']:.3f} ms" if "ms" in e else f"{v} ERROR {e['error'][:200]}"
            for v, e in out["variants"].items()
        )
    )
    return out


def summary(record: dict) -> list[dict]:
    """One row per variant: decode at the first snapshot (batch 256) and over the whole mix
    (every snapshot's bytes over their summed time), prefill, and the worst relative error."""
    rows, bandwidth = [], record["device_peaks"]["bandwidth"]
    first = record["decode"][0]
    for variant in variants(torch.device("cpu")):
        times = [_best_ms(r, variant) for r in record["decode"]]
        prefill = record["prefill"]["variants"].get(variant, {})
        errs = [
            c[variant]["vs_exact"]["rel_l2"]
            for c in record["correctness"].values()
            if "vs_exact" in c[variant]
        ]
        row = {
            "variant": variant,
            "tile": first["variants"][variant]["best"],
            "prefill_ms": prefill.get("ms"),
            "prefill_TFLOP_per_s": prefill.get("TFLOP_per_s"),
            "max_rel_error": max(errs) if errs else None,
        }
        if all(times):
            row |= {
                "batch256_ms": times[0],
                "batch256_TB_per_s": first["kv_bytes"] / times[0] / 1e9,
                "mix_ms": sum(times),
                "mix_TB_per_s": sum(r["kv_bytes"] for r in record["decode"]) / sum(times) / 1e9,
            }
            row["mix_share_of_bandwidth"] = row["mix_TB_per_s"] * 1e12 / bandwidth
        rows.append(row)
    return rows


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_correctness(results: dict) -> None:
    print(
        "correctness: ||error|| / ||reference|| against the exact reference (and the widening kernel)"
    )
    for case, by_variant in results.items():
        cells = [
            f"{v} {e['vs_exact']['rel_l2']:.4f} ({e['vs_widen']['rel_l2']:.4f}){'' if e['ok'] else ' FAIL'}"
            if "vs_exact" in e
            else f"{v} ERROR"
            for v, e in by_variant.items()
        ]
        print(f"  {case:16} " + ", ".join(cells))


def print_summary(rows: list[dict]) -> None:
    print(
        f"{'variant':16} {'tile':10} {'b256 ms':>8} {'TB/s':>6} {'mix ms':>8} {'TB/s':>6} {'of bw':>6} "
        f"{'prefill ms':>10} {'TFLOP/s':>8} {'rel err':>8}"
    )
    for r in rows:
        print(
            f"{r['variant']:16} {r['tile'] or '-':10} {_fmt(r.get('batch256_ms'), '8.4f')} "
            f"{_fmt(r.get('batch256_TB_per_s'), '6.2f')} {_fmt(r.get('mix_ms'), '8.4f')} {_fmt(r.get('mix_TB_per_s'), '6.2f')} "
            f"{_fmt(r.get('mix_share_of_bandwidth'), '6.1%')} {_fmt(r['prefill_ms'], '10.4f')} "
            f"{_fmt(r['prefill_TFLOP_per_s'], '8.1f')} {_fmt(r['max_rel_error'], '8.4f')}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument(
        "--max-rel-error",
        type=float,
        default=2**-4,
        help="a variant passes (a) where ||error|| / ||exact|| stays under this (default: e4m3's "
        "relative half step, the most that rounding q moves a value of it)",
    )
    parser.add_argument(
        "--out", help="the JSON record (default benchmarks/results/fp8_attention_<device>.json)"
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = time.perf_counter()
    results = correctness(correctness_cases(device), device, args.max_rel_error)
    print_correctness(results)
    if device.type != "cuda":
        parser.exit(
            2,
            "error: the timings need a CUDA GPU (the correctness part above ran in the Triton interpreter)\n",
        )
    import triton

    record = {
        "benchmark": "fp8_attention",
        "device_name": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK},
        "engine_default": {
            "fp8_dot": tri.dispatch.fp8_dot(torch.zeros(1, dtype=torch.bfloat16, device=device)),
            "pv_fp8": tri.PV_FP8,
            "q_scale": "per head",
        },
        "command": " ".join(["python", *sys.argv]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "device_peaks": measure_peaks(),
        "correctness": results,
    }
    out = Path(
        args.out or Path(__file__).parent / "results" / f"fp8_attention_{device_tag(device)}.json"
    )
    for part, measure in (("decode", decode_timing), ("prefill", prefill_timing)):
        record[part] = measure(device, args.reps)
        out.write_text(
            json.dumps(record, indent=1) + "\n"
        )  # each part kept, should a later one fail
    record["summary"] = summary(record)
    record["seconds"] = time.perf_counter() - start
    print_summary(record["summary"])
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out} ({record['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
