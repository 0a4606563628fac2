"""A decode step's dense projections at one and two rows: the matrix-vector kernels
(final's kernels/gemv.py: gemv and dense_gate_up) for each tile choice, against cuBLAS (F.linear),
bf16, CUDA only.

    python -m benchmarks.gemv_bench --out benchmarks/results/gemv_tiles_h200.json

For each model shape, each projection of a decoder layer (qkv, o, the MLP's gate/up with
SiLU-and-multiply, down; the router's for a mixture of experts) with as many distinct
weight matrices as the model has layers, called one after another in a CUDA graph, as a
decode step calls them: the weights come from memory, not from the L2 cache. `us` is the
median GPU time of one call, `TB_per_s` the weight bytes over it. `best` names the fastest
tiles per projection and rows; `layer_us_by_tiles` sums qkv, o and down (the projections
`gemv` serves) of one layer for each tile choice of gemv, fastest first; `defaults` are the
engine's tiles (the device's tuning: gemv linear and gate_up) when the record was made.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.kernel_bench import graph_time_ms
from benchmarks.run import versions
from nanovllm_final.kernels import gemv, tuning
from tools.tiny_model import FULL_SHAPES, build_config

GEMV_CHOICES = [  # BLOCK_N, BLOCK_K, num_warps of gemv
    (bn, bk, w)
    for bn in (1, 2, 4, 8)
    for bk in (512, 1024, 2048, 4096)
    for w in (2, 4, 8)
    if bn * bk <= 16384
]
GATE_UP_CHOICES = [  # BLOCK_N, BLOCK_K, num_warps of dense_gate_up (each program reads 2 * BLOCK_N rows)
    (bn, bk, w)
    for bn in (1, 2, 4, 8)
    for bk in (512, 1024, 2048)
    for w in (2, 4, 8)
    if bn * bk <= 8192
]


def projections(config: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of each dense projection of a decoder layer."""
    hidden, heads, kv_heads = (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim)}
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:  # a MoE layer: its router is dense, its experts are not (moe_layer_bench.py)
        shapes["router"] = (experts, hidden)
    else:
        inter = config["intermediate_size"]
        shapes |= {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}
    return shapes


def tiles_name(bn: int, bk: int, w: int) -> str:
    return f"{bn}x{bk}/w{w}"


def time_calls(fn, xs, ws) -> float:
    """Microseconds of one fn(x, w) call, as the median over graph replays of one call per weight."""
    return (
        graph_time_ms(lambda: [fn(x, w) for x, w in zip(xs, ws)], reps=20, inner=1) * 1e3 / len(ws)
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shape",
        action="append",
        choices=FULL_SHAPES,
        help="default: qwen3-0.6b and qwen3-30b-a3b",
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, "error: needs a CUDA GPU\n")
    torch.manual_seed(0)
    record = {
        "benchmark": "gemv_tiles",
        "device_name": torch.cuda.get_device_name(),
        "versions": versions(),
        "command": " ".join(["python -m benchmarks.gemv_bench", *sys.argv[1:]]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "defaults": {
            "gemv": tuning.for_device(torch.device("cuda")).gemv("linear")["loop"],
            "dense_gate_up": tuning.for_device(torch.device("cuda")).gemv("gate_up")["loop"],
        },
        "shapes": {},
    }
    for shape in args.shape or ["qwen3-0.6b", "qwen3-30b-a3b"]:
        config = build_config(shape=shape)
        layers = config["num_hidden_layers"]
        entry = record["shapes"][shape] = {"layers": layers, "projections": {}}
        for name, (n, k) in projections(config).items():
            ws = [
                torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(layers)
            ]
            proj = entry["projections"][name] = {
                "n": n,
                "k": k,
                "weight_bytes": n * k * 2,
                "rows": {},
            }
            for rows in args.rows:
                xs = [
                    torch.randn(rows, k, dtype=torch.bfloat16, device="cuda") for _ in range(layers)
                ]
                cublas = time_calls(F.linear, xs, ws)
                res = proj["rows"][rows] = {"cublas_us": cublas, "tiles": {}}
                if name == "gate_up":
                    kernel, choices = gemv.dense_gate_up, GATE_UP_CHOICES
                    expected = [
                        F.silu(h[:, : n // 2]) * h[:, n // 2 :]
                        for h in (F.linear(x, w) for x, w in zip(xs, ws))
                    ]
                else:
                    kernel, choices, expected = (
                        gemv.gemv,
                        GEMV_CHOICES,
                        [F.linear(x, w) for x, w in zip(xs, ws)],
                    )
                for bn, bk, w in choices:
                    tiles = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w}
                    fn = lambda x, wt, tiles=tiles: kernel(x, wt, tiles)
                    err = max(
                        (fn(x, wt).float() - e.float()).abs().max().item()
                        for x, wt, e in zip(xs[:2], ws[:2], expected[:2])
                    )
                    us = time_calls(fn, xs, ws)
                    res["tiles"][tiles_name(bn, bk, w)] = {
                        "us": us,
                        "TB_per_s": n * k * 2 / us / 1e6,
                        "max_err": err,
                    }
                best = min(res["tiles"], key=lambda t: res["tiles"][t]["us"])
                res["best"] = best
                print(
                    f"{shape:14} {name:8} {n:6}x{k:<5} rows {rows}: cuBLAS {cublas:6.2f} us, best {best:12} "
                    f"{res['tiles'][best]['us']:6.2f} us ({res['tiles'][best]['TB_per_s']:.2f} TB/s)",
                    flush=True,
                )
            del ws
        gemv_names = [n for n in ("qkv", "o", "down") if n in entry["projections"]]
        for rows in args.rows:
            sums = {
                t: sum(entry["projections"][p]["rows"][rows]["tiles"][t]["us"] for p in gemv_names)
                for t in map(lambda c: tiles_name(*c), GEMV_CHOICES)
            }
            entry.setdefault("layer_us_by_tiles", {})[rows] = dict(
                sorted(sums.items(), key=lambda kv: kv[1])
            )
            best = min(sums, key=sums.get)
            print(
                f"{shape:14} {'+'.join(gemv_names)} rows {rows}: best gemv tiles {best} {sums[best]:.2f} us a layer",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
