"""Time every kernel's tile choices on this GPU and write its configuration file.

    python -m nanovllm_final.tune                  (or: nanovllm tune)
    python -m nanovllm_final.tune --out my.json    (anywhere else; NANOVLLM_KERNEL_CONFIG=my.json uses it)
    python -m nanovllm_final.tune --dry-run --out /tmp/cpu.json   (tiny shapes on the CPU, Triton's interpreter)
    python -m nanovllm_final.tune --only gemv moe (time these; the rest stay as this GPU's file or rules have them)

For each kernel (kernels/tuning.py lists the file's fields) it times a short list of candidates
on the shapes of the models this engine serves (Qwen3-0.6B, Llama-3.2-1B, Qwen3-30B-A3B's
experts), each as GPU time of CUDA-graph replays, and keeps the fastest summed over the shapes:
decode attention's tiles (as the engine calls it: new K/V stored, norms and RoPE applied), then
its programs per SM for split-K; prefill attention's tiles; per projection kind, the few-row
kernels' tiles (the row loop's and the tensor-core product's, on weights that stream from
memory, as a model's do), then the rows each takes before cuBLAS; the MoE's grouped GEMM tiles per size and its
matrix-vector tiles, then the most (token, expert) pairs for which those beat the grouped path.
The file records every time measured. Without --out it goes to kernels/configs/<this GPU>.json."""

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .kernels import tuning

# decode attention: heads, kv heads, head_dim, q/k norms (Qwen3-0.6B, Llama-3.2-1B)
DECODE_SHAPES = {"bf16": [(16, 8, 128, True), (32, 8, 64, False)], "fp8": [(16, 8, 128, True)]}
DECODE_TILES = [
    (64, 4, 3),
    (64, 2, 3),
    (64, 2, 2),
    (128, 4, 2),
    (128, 2, 2),
    (128, 4, 3),
    (32, 2, 2),
    (64, 1, 2),
    (32, 1, 2),
]  # BLOCK_N, num_warps, num_stages
PROGRAMS_PER_SM = (1, 2, 4, 6, 8)
PREFILL_TILES = [
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (64, 64, 8, 2),
    (128, 64, 8, 2),
    (128, 64, 4, 2),
    (64, 32, 4, 2),
]
# dense projections (N, K) of a decoder layer: Qwen3-0.6B's and Llama-3.2-1B's
GEMV_SHAPES = {
    "linear": [(4096, 1024), (1024, 2048), (3072, 2048), (2048, 2048)],
    "gate_up": [(6144, 1024), (16384, 2048)],
    "down": [(1024, 3072), (2048, 8192)],
}
GEMV_TILES = [
    (bn, bk, w) for bn in (1, 2, 4) for bk in (1024, 2048, 4096) for w in (2, 4) if bn * bk <= 8192
]
GEMV_DOT_TILES = [
    (16, 128, 4, 3),
    (16, 128, 4, 5),
    (16, 256, 4, 3),
    (32, 128, 4, 3),
    (32, 128, 4, 5),
    (32, 256, 4, 3),
    (32, 256, 4, 5),
    (32, 512, 4, 5),
    (64, 128, 8, 5),
    (64, 256, 4, 5),
]  # the tensor-core product's BLOCK_N, BLOCK_K, num_warps, num_stages
# each also with K split until the programs cover the SMs (SPLIT_K 0, gemv.split_k)
GEMV_DOT_TILES += [(*t, 0) for t in GEMV_DOT_TILES]
MOE_SHAPE = (128, 2048, 768, 8)  # Qwen3-30B-A3B: experts, hidden, expert width, top_k
MOE_TILES = [(64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3)]
MOE_GEMV_TILES = [
    (4, 1024, 4, 2, 256),
    (8, 256, 4, 2, 256),
    (16, 128, 4, 2, 128),
    (8, 512, 4, 2, 256),
    (4, 1024, 8, 2, 1024),
    (2, 2048, 4, 2, 512),
]  # BLOCK_N, BLOCK_K, num_warps, DOWN_BLOCK_N, _K


@dataclass
class Plan:
    """What to time: shapes and candidate lists (the GPU's, or a dry run's tiny ones)."""

    decode_shapes: dict = field(default_factory=lambda: DECODE_SHAPES)
    decode_batches: tuple = ((256, 600), (64, 1500), (16, 3000))  # sequences, mean context
    decode_tiles: list = field(default_factory=lambda: DECODE_TILES)
    programs_per_sm: tuple = PROGRAMS_PER_SM
    split_context: int = 1500  # mean context of the batches that time programs_per_sm
    prefill_batch: tuple = (4, 1024)  # prompts, tokens each
    prefill_tiles: list = field(default_factory=lambda: PREFILL_TILES)
    gemv_shapes: dict = field(default_factory=lambda: GEMV_SHAPES)
    gemv_tiles: list = field(default_factory=lambda: GEMV_TILES)
    gemv_rows: tuple = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
    # the rows a tile is chosen on: a decode step of one and of two sequences, a verify step of
    # k = 4 proposals at batch 1
    gemv_tile_rows: tuple = (1, 2, 5)
    gemv_dot_tiles: list = field(default_factory=lambda: GEMV_DOT_TILES)
    gemv_dot_tile_rows: tuple = (5, 8)  # a verify step of k = 4, a decode step of 8 sequences
    moe_shape: tuple = MOE_SHAPE
    moe_sizes: dict = field(
        default_factory=lambda: {"2048": 256, "8192": 1024, "65536": 4096}
    )  # key: tokens
    moe_tiles: list = field(default_factory=lambda: MOE_TILES)
    moe_gemv_tiles: list = field(default_factory=lambda: MOE_GEMV_TILES)
    moe_small_tokens: tuple = (1, 2, 4, 8, 16)
    reps: int = 10


DRY_PLAN = Plan(
    decode_shapes={"bf16": [(4, 2, 32, True)], "fp8": [(4, 2, 32, False)]},
    decode_batches=((3, 40),),
    decode_tiles=[(16, 1, 1), (32, 1, 1)],
    programs_per_sm=(1, 2),
    split_context=40,
    prefill_batch=(2, 20),
    prefill_tiles=[(16, 16, 1, 1), (32, 32, 1, 1)],
    gemv_shapes={"linear": [(24, 40)], "gate_up": [(32, 40)], "down": [(40, 16)]},
    gemv_tiles=[(4, 16, 1), (8, 32, 1)],
    gemv_rows=(1, 2),
    gemv_tile_rows=(1, 2),
    gemv_dot_tiles=[(16, 16, 1, 1), (16, 32, 1, 1), (16, 32, 1, 1, 0)],
    gemv_dot_tile_rows=(3,),
    moe_shape=(4, 32, 16, 2),
    moe_sizes={"64": 3},
    moe_tiles=[(16, 16, 1, 1), (32, 16, 1, 1)],
    moe_gemv_tiles=[(8, 32, 1, 32, 16), (16, 16, 1, 16, 16)],
    moe_small_tokens=(1, 2),
    reps=1,
)


class Timer:
    """Times candidates (GPU time of graph replays, or wall time on a CPU) and counts them on a progress bar."""

    def __init__(self, device: torch.device, reps: int, bar):
        self.device, self.reps, self.bar = device, reps, bar

    def ms(self, fn: Callable) -> float:
        from .kernels.timing import graph_time_ms, wall_time_ms

        ms = (
            graph_time_ms(fn, self.reps)
            if self.device.type == "cuda"
            else wall_time_ms(fn, self.reps)
        )
        return ms / getattr(fn, "calls", 1)  # per product of a `streamed` call

    def fastest(self, candidates: dict[str, list[Callable]]) -> tuple[str, dict]:
        """The name of the candidate whose calls take the least time summed, and every candidate's
        sum (ms; a candidate that fails, e.g. out of shared memory, records its error)."""
        times = {}
        for name, calls in candidates.items():
            try:
                times[name] = sum(self.ms(fn) for fn in calls)
            except Exception as exc:  # noqa: BLE001  a tile this GPU cannot run
                times[name] = {"error": repr(exc)[:160]}
            self.bar.update(1)
        ok = {name: t for name, t in times.items() if not isinstance(t, dict)}
        if not ok:
            raise RuntimeError(f"every candidate failed: {times}")
        return min(ok, key=ok.get), times


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def decode_inputs(
    batch: int, context: int, shape: tuple, fp8: bool, device: torch.device, seed: int = 0
):
    """A decode step's attention arguments, as the engine passes them: `batch` sequences of contexts
    around `context` in shuffled blocks of 16, their new K/V and slots, RoPE (and q/k norms)."""
    from .layers.rotary import RotaryEmbedding

    heads, kv_heads, head_dim, qk_norm = shape
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(1, context // 2), context * 3 // 2 + 1, (batch,), generator=g)
    per_seq = (int(lens.max()) + 15) // 16
    tables = torch.randperm(batch * per_seq, generator=g).view(batch, per_seq).to(torch.int32)
    cache = torch.randn(batch * per_seq, 16, kv_heads, head_dim, generator=g).to(_dtype(device))
    cache = cache.to(torch.float8_e4m3fn) if fp8 else cache
    q, k, v = (
        torch.randn(batch, n, head_dim, generator=g).to(_dtype(device))
        for n in (heads, kv_heads, kv_heads)
    )
    positions = lens - 1
    slots = tables.gather(1, (positions // 16)[:, None]).squeeze(1).long() * 16 + positions % 16
    rotary = RotaryEmbedding(head_dim, int(lens.max()) + 1, 1e6, None)
    norm_w = (torch.ones(head_dim, dtype=_dtype(device)),) * 2 if qk_norm else (None, None)
    rope = (positions, rotary.cos, rotary.sin, *norm_w, 1e-6 if qk_norm else 0.0)
    moved = [
        t.to(device) if isinstance(t, torch.Tensor) else t
        for t in (q, cache, cache.clone(), lens.to(torch.int32), tables, k, v, slots, *rope)
    ]
    q, k_cache, v_cache, lens, tables, k, v, slots = moved[:8]
    scales = (
        {
            "k_scale": torch.full((kv_heads,), 0.5, device=device),
            "v_scale": torch.full((kv_heads,), 0.5, device=device),
        }
        if fp8
        else {}
    )
    return (q, k_cache, v_cache, lens, tables, head_dim**-0.5), dict(
        new_kv=(k, v, slots), rope=tuple(moved[8:]), **scales
    )


def tune_decode(timer: Timer, plan: Plan, record: dict) -> dict:
    """decode_attention: per kv dtype and head_dim, the fastest tile over the batches, then the
    programs per SM that the split-K rule aims at, timed on batches too small to fill the GPU."""
    from .kernels.attention import SplitCounters, default_num_splits, paged_decode_attention

    out = {}
    sms = tuning.describe(timer.device).sms
    for kind, shapes in plan.decode_shapes.items():
        out[kind] = {}
        for shape in shapes:
            fp8, kv_heads = kind == "fp8", shape[1]
            steps = [decode_inputs(b, c, shape, fp8, timer.device) for b, c in plan.decode_batches]

            def call(args, kwargs, **launch):
                counters = SplitCounters()
                return lambda: paged_decode_attention(*args, **kwargs, counters=counters, **launch)

            tiles = {
                f"{bn}w{w}s{s}": [
                    call(*step, BLOCK_N=bn, num_warps=w, num_stages=s) for step in steps
                ]
                for bn, w, s in plan.decode_tiles
            }
            best, times = timer.fastest(tiles)
            bn, w, s = next(t for t in plan.decode_tiles if f"{t[0]}w{t[1]}s{t[2]}" == best)
            small = [
                decode_inputs(
                    max(1, k * sms // kv_heads),
                    plan.split_context,
                    shape,
                    fp8,
                    timer.device,
                    seed=k,
                )
                for k in (1, 3, 6)
            ]

            def split_call(args, kwargs, per_sm):
                splits = default_num_splits(
                    args[0].shape[0], kv_heads, args[4].shape[1] * 16, timer.device, bn, per_sm
                )
                return call(args, kwargs, num_splits=splits, BLOCK_N=bn, num_warps=w, num_stages=s)

            per_sm, split_times = timer.fastest(
                {str(p): [split_call(*step, p) for step in small] for p in plan.programs_per_sm}
            )
            out[kind][str(shape[2])] = {
                "BLOCK_N": bn,
                "num_warps": w,
                "num_stages": s,
                "programs_per_sm": int(per_sm),
            }
            record[f"decode_attention.{kind}.{shape[2]}"] = {
                "tiles_ms": times,
                "programs_per_sm_ms": split_times,
            }
    return out


def tune_prefill(timer: Timer, plan: Plan, record: dict) -> dict:
    """prefill_attention: per head_dim, the fastest tile on whole prompts (every key tile visited)."""
    from .kernels.attention import paged_prefill_attention

    out = {}
    prompts, tokens = plan.prefill_batch
    per_seq, dtype, device = (tokens + 15) // 16, _dtype(timer.device), timer.device
    for heads, kv_heads, head_dim, _ in plan.decode_shapes["bf16"]:
        k_cache, v_cache = (
            torch.randn(prompts * per_seq, 16, kv_heads, head_dim, dtype=dtype, device=device)
            for _ in range(2)
        )
        tables = (
            torch.randperm(prompts * per_seq, device=device).view(prompts, per_seq).to(torch.int32)
        )
        lens = torch.full((prompts,), tokens, dtype=torch.int32, device=device)
        cu = torch.arange(prompts + 1, dtype=torch.int32, device=device) * tokens
        q = torch.randn(prompts * tokens, heads, head_dim, dtype=dtype, device=device)
        args = (q, k_cache, v_cache, cu, lens, tables, head_dim**-0.5, tokens)
        best, times = timer.fastest(
            {
                f"{m}x{n}w{w}s{s}": [
                    lambda m=m, n=n, w=w, s=s: paged_prefill_attention(*args, m, n, w, s)
                ]
                for m, n, w, s in plan.prefill_tiles
            }
        )
        m, n, w, s = next(t for t in plan.prefill_tiles if "{}x{}w{}s{}".format(*t) == best)
        out[str(head_dim)] = {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s}
        record[f"prefill_attention.{head_dim}"] = {"tiles_ms": times}
    return out


def tune_gemv(timer: Timer, plan: Plan, record: dict) -> dict:
    """gemv, per projection kind (linear, gate_up, down), over that kind's shapes: the row loop's
    tiles (loop), the fastest summed over `plan.gemv_tile_rows` rows; the tensor-core product's
    (dot), the fastest summed over `plan.gemv_dot_tile_rows` rows; then, counting rows up,
    `rows`: as long as the row loop is the fastest of the three, and `dot_rows`: from there, as
    long as the tensor-core product takes no longer than cuBLAS (for gate_up, cuBLAS with the
    activation's kernel after it, as the layer runs it). The weights stream from memory, as a
    model's layers do (`streamed`): one weight timed again and again sits in the L2 cache, where
    other tiles win."""
    import torch.nn.functional as F

    from .kernels.gemv import dense_gate_up, gemv
    from .layers.activation import SiluAndMul

    out, dtype = {}, _dtype(timer.device)
    l2 = tuning.describe(timer.device).l2
    weights = {  # per kind, per shape: copies whose bytes exceed twice the L2
        kind: [
            [
                torch.randn(n, k, dtype=dtype, device=timer.device) * 0.02
                for _ in range(streamed_copies(n * k * dtype.itemsize, l2))
            ]
            for n, k in shapes
        ]
        for kind, shapes in plan.gemv_shapes.items()
    }
    act = SiluAndMul()
    kernel = {"linear": gemv, "gate_up": dense_gate_up, "down": gemv}
    cublas = {"linear": F.linear, "gate_up": lambda x, w: act(F.linear(x, w)), "down": F.linear}

    def calls(kind, rows, tiles=None, dot=False):
        fn = (lambda x, w: kernel[kind](x, w, tiles, dot)) if tiles else cublas[kind]
        return [
            streamed(fn, torch.randn(rows, ws[0].shape[1], dtype=dtype, device=timer.device), ws)
            for ws in weights[kind]
        ]

    def fastest_tiles(kind, named, tile_rows, dot):  # the tiles of `named` fastest over tile_rows
        best, times = timer.fastest(
            {
                name: [fn for rows in tile_rows for fn in calls(kind, rows, tiles, dot)]
                for name, tiles in named.items()
            }
        )
        record[f"gemv.{kind}.{'dot' if dot else 'loop'}"] = {"tiles_ms": times}
        return named[best]

    loop_tiles = {"{}x{}w{}".format(*t): _gemv_tiles(t) for t in plan.gemv_tiles}
    dot_tiles = {_dot_name(t): _dot_tiles(t) for t in plan.gemv_dot_tiles}
    for kind in weights:
        entry = out[kind] = {
            "rows": 0,
            "dot_rows": 0,
            "loop": fastest_tiles(kind, loop_tiles, plan.gemv_tile_rows, False),
            "dot": fastest_tiles(kind, dot_tiles, plan.gemv_dot_tile_rows, True),
        }
        loop = True  # the row loop still the fastest at every count so far
        for rows in plan.gemv_rows:
            _, times = timer.fastest(
                {
                    "loop": calls(kind, rows, entry["loop"]),
                    "dot": calls(kind, rows, entry["dot"], dot=True),
                    "cublas": calls(kind, rows),
                }
            )
            record[f"gemv.{kind}.rows.{rows}"] = times
            loop = loop and times["loop"] <= min(times["dot"], times["cublas"])
            if loop:
                entry["rows"] = rows
            elif times["dot"] <= times["cublas"]:
                entry["dot_rows"] = rows
            else:
                break
    return out


def streamed_copies(weight_bytes: int, l2_bytes: int) -> int:
    """Copies of a weight whose bytes together exceed twice the L2 cache (at least two)."""
    return max(2, -(-2 * l2_bytes // weight_bytes))


def streamed(fn: Callable, x: torch.Tensor, weights: list[torch.Tensor]) -> Callable:
    """fn(x, w) for each of `weights` in turn: one call is len(weights) products (`calls`, by
    which Timer divides), each on a weight the products before it have pushed out of the L2."""

    def run():
        for w in weights:
            fn(x, w)

    run.calls = len(weights)
    return run


def _gemv_tiles(t: tuple) -> dict:
    return {"BLOCK_N": t[0], "BLOCK_K": t[1], "num_warps": t[2]}


def _dot_tiles(t: tuple) -> dict:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages[, SPLIT_K]) as the tiling; SPLIT_K 1 is left out."""
    tiles = {"BLOCK_N": t[0], "BLOCK_K": t[1], "num_warps": t[2], "num_stages": t[3]}
    return tiles if len(t) < 5 or t[4] == 1 else {**tiles, "SPLIT_K": t[4]}


def _dot_name(t: tuple) -> str:
    """32x512w4s5, and 32x512w4s5/split with SPLIT_K 0 (split to cover the SMs)."""
    name = "{}x{}w{}s{}".format(*t[:4])
    return name if len(t) < 5 or t[4] == 1 else f"{name}/split" if t[4] == 0 else f"{name}/k{t[4]}"


def moe_weights(plan: Plan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan's experts' stacked gate/up and down weights, drawn on the device."""
    experts, hidden, inter, _ = plan.moe_shape
    return tuple(
        torch.randn(shape, device=device).to(_dtype(device)) * 0.02
        for shape in ((experts, 2 * inter, hidden), (experts, hidden, inter))
    )


def moe_inputs(tokens: int, plan: Plan, weights: tuple, seed: int = 0) -> list:
    """fused_experts' arguments for `tokens` tokens routed at random over the plan's experts."""
    from .layers.moe import route_torch

    experts, hidden, _, top_k = plan.moe_shape
    g = torch.Generator().manual_seed(seed)
    device, dtype = weights[0].device, weights[0].dtype
    x = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=dtype)
    routing, ids = route_torch(torch.randn(tokens, experts, generator=g), top_k, True)
    return [x, *weights, routing.to(device=device, dtype=dtype), ids.to(device)]


def tune_moe(timer: Timer, plan: Plan, record: dict) -> dict:
    """moe: the grouped GEMMs' fastest tile per size, the matrix-vector path's fastest tile at one
    and four tokens, then `small_pairs`: the most pairs (counting up) at which that path is faster."""
    from .kernels.moe import fused_experts

    grouped, weights = {}, moe_weights(plan, timer.device)
    for key, tokens in plan.moe_sizes.items():
        args = moe_inputs(tokens, plan, weights)
        tiles = {
            "{}x{}w{}s{}".format(*t): dict(
                zip(("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"), t)
            )
            for t in plan.moe_tiles
        }
        best, times = timer.fastest(
            {
                name: [lambda t=t: fused_experts(*args, tiles=t, small=False)]
                for name, t in tiles.items()
            }
        )
        grouped[key] = tiles[best]
        record[f"moe.grouped.{key}"] = {"tiles_ms": times}
    fields = ("BLOCK_N", "BLOCK_K", "num_warps", "DOWN_BLOCK_N", "DOWN_BLOCK_K")
    gemv_tiles = {"{}x{}w{}/{}x{}".format(*t): dict(zip(fields, t)) for t in plan.moe_gemv_tiles}
    small = [moe_inputs(tokens, plan, weights, seed=tokens) for tokens in (1, 4)]
    best, times = timer.fastest(
        {
            name: [lambda a=a, t=t: fused_experts(*a, tiles=t, small=True) for a in small]
            for name, t in gemv_tiles.items()
        }
    )
    record["moe.gemv"] = {"tiles_ms": times}
    small_pairs = 0
    with tuning.override({"moe": {"grouped": grouped}}):
        for tokens in plan.moe_small_tokens:
            args = moe_inputs(tokens, plan, weights, seed=tokens)
            _, times = timer.fastest(
                {
                    "gemv": [lambda: fused_experts(*args, tiles=gemv_tiles[best], small=True)],
                    "grouped": [lambda: fused_experts(*args, small=False)],
                }
            )
            record[f"moe.small_pairs.{tokens}"] = times
            if times["gemv"] > times["grouped"]:
                break
            small_pairs = tokens * plan.moe_shape[3]
    return {"small_pairs": small_pairs, "gemv": gemv_tiles[best], "grouped": grouped}


SECTIONS = {
    "decode_attention": tune_decode,
    "prefill_attention": tune_prefill,
    "gemv": tune_gemv,
    "moe": tune_moe,
}
NOTES = {
    "method": "each choice is the fastest candidate (GPU time of CUDA-graph replays, summed over the shapes) "
    "of python -m nanovllm_final.tune's lists; measured_ms has every time",
    "decode_attention": "the decode kernel as the engine calls it (new K/V stored, q/k norms and RoPE applied) on "
    "batches of 256, 64 and 16 sequences; programs_per_sm: the split-K rule's target, timed on "
    "batches of 1, 3 and 6 programs per SM",
    "decode_splits": "not timed: 2 waves of programs_per_sm programs on every SM, at most 32 splits",
    "gemv": "per projection kind, over its shapes: the row loop's tiles (loop) summed over {rows} rows, the "
    "tensor-core product's (dot, each tiling also with K split until its programs cover the SMs: "
    "/split) over {dot_rows} rows; each shape's weight in copies whose bytes exceed "
    "twice the L2, timed in turn (streamed from memory, as a model's layers are)",
    "gemv.<kind>.rows": "the most rows (counting up) at which the kind's row loop took no longer than its "
    "tensor-core product and cuBLAS",
    "gemv.<kind>.dot_rows": "from there, the most rows at which the kind's tensor-core product took no "
    "longer than cuBLAS (0: none)",
    "moe.small_pairs": "the most (token, expert) pairs (counting up) at which the matrix-vector path beat the "
    "grouped one",
}


def candidates(plan: Plan) -> dict[str, int]:
    """How many timings each section counts on the progress bar."""
    shapes = sum(len(s) for s in plan.decode_shapes.values())
    return {
        "decode_attention": shapes * (len(plan.decode_tiles) + len(plan.programs_per_sm)),
        "prefill_attention": len(plan.decode_shapes["bf16"]) * len(plan.prefill_tiles),
        "gemv": len(plan.gemv_shapes)
        * (len(plan.gemv_tiles) + len(plan.gemv_dot_tiles) + 3 * len(plan.gemv_rows)),
        "moe": len(plan.moe_sizes) * len(plan.moe_tiles)
        + len(plan.moe_gemv_tiles)
        + 2 * len(plan.moe_small_tokens),
    }


def tune(device: torch.device, plan: Plan, only: list[str] | None = None) -> dict:
    """The device's configuration, in kernels/tuning.py's layout, with its record. Sections left
    out of `only` keep the device's present choices (its file, or the rules)."""
    from tqdm.auto import tqdm

    torch.manual_seed(0)
    dev = tuning.describe(device)
    present = tuning.choose(dev)
    measured: dict = {}
    config = {
        "device": dev.name,
        **{name: present.config[name] for name in SECTIONS if only and name not in only},
    }
    timed = [name for name in SECTIONS if name not in config]
    with tqdm(
        total=sum(candidates(plan)[name] for name in timed),
        desc=f"tuning {dev.name}",
        unit="timing",
    ) as bar:
        timer = Timer(device, plan.reps, bar)
        for name in timed:
            bar.set_postfix_str(name)
            config[name] = SECTIONS[name](timer, plan, measured)
        bar.update(
            bar.total - bar.n
        )  # the counts that stopped early (gemv rows, small pairs) were not timed
    config["decode_splits"] = {"waves": 2, "max_splits": 32}
    kept = [name for name in SECTIONS if name not in timed]
    notes = {key: text for key, text in NOTES.items() if key != "gemv" or "gemv" in timed}
    if "gemv" in timed:
        notes["gemv"] = NOTES["gemv"].format(
            rows=", ".join(map(str, plan.gemv_tile_rows)),
            dot_rows=", ".join(map(str, plan.gemv_dot_tile_rows)),
        )
    if kept:
        notes["kept"] = f"{', '.join(kept)}: not timed, as they were ({present.source})"
    config["record"] = {
        "made_by": "python -m nanovllm_final.tune"
        + (f" --reps {plan.reps}" if plan.reps != Plan.reps else ""),
        "device": str(dev),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "notes": notes,
        "measured_ms": measured,
    }
    return tuning.check(config, "the tuned configuration")


def _triton_version() -> str:
    import triton

    return triton.__version__


def add_parser(commands) -> None:
    """`nanovllm tune`: this module's command line as a subcommand."""
    parser = commands.add_parser(
        "tune",
        help="time the kernels' tile choices on this GPU and write its config file",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", type=Path, help="where to write the file (default: kernels/configs/<GPU>.json)"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny shapes and two candidates each, on the CPU under Triton's interpreter (a test)",
    )
    parser.add_argument("--reps", type=int, help="timed replays per candidate (default 10)")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=tuple(SECTIONS),
        help="time these kernels only; the others keep this GPU's present choices",
    )


def run(args: argparse.Namespace) -> None:
    if args.dry_run:
        if args.out is None:
            raise SystemExit("error: --dry-run needs --out (a dry run's file describes no GPU)")
        if (
            os.environ.get("TRITON_INTERPRET") != "1"
        ):  # read as triton is imported: run again with it set
            argv = [
                sys.executable,
                "-m",
                "nanovllm_final.tune",
                "--dry-run",
                "--out",
                str(args.out),
            ]
            env = {**os.environ, "TRITON_INTERPRET": "1"}
            argv += (["--reps", str(args.reps)] if args.reps else []) + (
                ["--only", *args.only] if args.only else []
            )
            raise SystemExit(subprocess.run(argv, env=env).returncode)
        device, plan = torch.device("cpu"), DRY_PLAN
    elif not torch.cuda.is_available():
        raise SystemExit(
            "error: tuning times kernels on a CUDA GPU (--dry-run runs tiny shapes on the CPU)"
        )
    else:
        device, plan = torch.device("cuda", torch.cuda.current_device()), Plan()
    if args.reps:
        plan = Plan(**{**plan.__dict__, "reps": args.reps})
    config = tune(device, plan, args.only)
    out = args.out or tuning.CONFIG_DIR / tuning.file_name(config["device"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(config, indent=1) + "\n")
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m nanovllm_final.tune",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
