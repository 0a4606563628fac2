"""The final engine's paged decode attention on the context mix of a real run (CUDA only).

    python benchmarks/decode_attention_bench.py --out benchmarks/results/decode_attention_qwen3-0.6b_h200.json
    python benchmarks/decode_attention_bench.py --kv-cache-dtype fp8 --out benchmarks/results/decode_attention_fp8-kv_qwen3-0.6b_h200.json

nano-vllm's workload starts 256 requests together (prompts and outputs of 100-1024 tokens);
after s decode steps, the requests still running hold prompt + s tokens each. For a few
such snapshots this times the decode kernel (GPU time of CUDA-graph replays) for each tile
configuration, in batch order and longest-context-first (the order the engine launches),
and split-K factors at 64 keys, 4 warps and 3 stages, and reports
the bandwidth it reaches: the K/V bytes the batch must read over the time. With --kv-cache-dtype fp8 the cache holds e4m3 values
with one scale per kv head (half the bytes of bf16), as the engine's fp8 cache does.
Qwen3-0.6B's attention shape: 16 query heads, 8 kv heads, head_dim 128, blocks of 16.
"""

import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernel_bench import gpu_bench_args, graph_time_ms  # noqa: E402
from nanovllm_final.engine.block_manager import blocks_needed  # noqa: E402
from nanovllm_final.kernels import attention as attention_triton  # noqa: E402
from nanovllm_final.kernels import tuning  # noqa: E402
from nanovllm_final.layers import attention_torch  # noqa: E402
from nanovllm_final.workloads import nanovllm  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16
# (BLOCK_N, num_warps, num_stages) of the decode kernel
TILES = [
    (64, 4, 3),
    (64, 4, 2),
    (64, 4, 4),
    (64, 4, 1),
    (64, 2, 2),
    (32, 4, 3),
    (32, 2, 3),
    (128, 4, 2),
    (128, 4, 3),
    (128, 4, 1),
    (128, 2, 2),
    (128, 8, 3),
    (256, 4, 2),
    (256, 8, 2),
    (64, 8, 3),
    (16, 2, 3),
]
STEPS = (1, 300, 600, 750, 900, 1000)  # decode steps into the run
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)  # split-K factors tried at the first tile, longest first


def snapshot(step: int, seed: int = 0) -> list[int]:
    """Context lengths of the requests still running after `step` decode steps."""
    prompts, params = nanovllm(151936, seed=seed)
    return [len(p) + step for p, sp in zip(prompts, params) if sp["max_tokens"] > step]


def engine_block_tables(step: int, seed: int = 0) -> list[list[int]]:
    """The block tables of snapshot(step)'s requests as the engine's block manager hands blocks
    out from a pool large enough that freed blocks (put at its back) are never reached again:
    each prompt's blocks in one run, prompts in arrival order, then a block at a time, across
    the batch in step order, as a sequence's tokens cross a block boundary."""
    prompts, params = nanovllm(151936, seed=seed)
    tables, next_block = [], 0
    for p in prompts:
        n = blocks_needed(len(p), BLOCK)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    for t in range(
        1, step + 1
    ):  # after decode step t a running request holds len(prompt) + t tokens
        for p, sp, table in zip(prompts, params, tables):
            if sp["max_tokens"] > t - 1 and blocks_needed(len(p) + t, BLOCK) > len(table):
                table.append(next_block)
                next_block += 1
    return [table for table, sp in zip(tables, params) if sp["max_tokens"] > step]


def paged_batch(
    contexts: list[int],
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
    head_dim: int = HEAD_DIM,
    block_tables: list[list[int]] | None = None,
    device: str = "cuda",
):
    """A random paged cache and one query per sequence; each sequence's blocks at the places
    `block_tables` gives (engine_block_tables), or by default at shuffled places."""
    blocks = [blocks_needed(c, BLOCK) for c in contexts]
    if block_tables is None:
        perm, start = torch.randperm(sum(blocks)).tolist(), 0
        block_tables = []
        for n in blocks:
            block_tables.append(perm[start : start + n])
            start += n
    assert [len(t) for t in block_tables] == blocks
    total, width = 1 + max(max(t) for t in block_tables), max(blocks)
    k_cache = torch.randn(total, BLOCK, kv_heads, head_dim, dtype=dtype, device=device).to(
        cache_dtype
    )
    v_cache = torch.randn(total, BLOCK, kv_heads, head_dim, dtype=dtype, device=device).to(
        cache_dtype
    )
    tables = torch.tensor(
        [t + [-1] * (width - len(t)) for t in block_tables], dtype=torch.int32, device=device
    )
    q = torch.randn(len(contexts), heads, head_dim, dtype=dtype, device=device)
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, lens, tables


def main() -> None:
    args = gpu_bench_args(
        __doc__,
        add_arguments=lambda p: p.add_argument(
            "--kv-cache-dtype", choices=("auto", "fp8"), default="auto"
        ),
    )
    torch.manual_seed(0)
    dtype, scale = torch.bfloat16, HEAD_DIM**-0.5
    fp8 = args.kv_cache_dtype == "fp8"
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    # an fp8 cache's dequantization scales, one per kv head (the values are drawn in e4m3's range)
    scales = (
        {
            "k_scale": torch.full((KV_HEADS,), 0.5, device="cuda"),
            "v_scale": torch.full((KV_HEADS,), 0.25, device="cuda"),
        }
        if fp8
        else {}
    )
    kernel = functools.partial(attention_triton.paged_decode_attention, **scales)
    record = {
        "benchmark": "decode_attention",
        "kv_cache_dtype": args.kv_cache_dtype,
        "device_name": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK},
        "command": " ".join(["python", *sys.argv]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "snapshots": [],
    }
    for step in STEPS:
        contexts = snapshot(step)
        q, kc, vc, lens, tables = paged_batch(contexts, dtype, cache_dtype)
        order = torch.argsort(lens, descending=True, stable=True).to(torch.int32)
        kv_bytes = (
            sum(contexts) * KV_HEADS * HEAD_DIM * 2 * kc.element_size()
        )  # K and V, every layer reads
        expected = attention_torch.paged_decode_attention(
            q, kc, vc, lens, tables, scale, **scales
        ).float()
        row = {
            "step": step,
            "batch": len(contexts),
            "mean_context": sum(contexts) / len(contexts),
            "max_context": max(contexts),
            "kv_bytes": kv_bytes,
            "tiles": {},
        }
        for bn, w, s in TILES:
            for name, o in (("batch_order", None), ("longest_first", order)):
                fn = lambda: kernel(
                    q, kc, vc, lens, tables, scale, o, BLOCK_N=bn, num_warps=w, num_stages=s
                )
                key = f"{bn}w{w}s{s}/{name}"
                try:
                    ms = graph_time_ms(fn, args.reps)
                    err = (fn().float() - expected).abs().max().item()
                except Exception as exc:  # e.g. out of shared memory
                    row["tiles"][key] = {"error": repr(exc)[:160]}
                    continue
                row["tiles"][key] = {"ms": ms, "TB_per_s": kv_bytes / ms / 1e9, "max_err": err}
        for n in SPLITS:
            fn = lambda: kernel(
                q, kc, vc, lens, tables, scale, order, num_splits=n, num_warps=4, num_stages=3
            )
            ms = graph_time_ms(fn, args.reps)
            row["tiles"][f"splits{n}/longest_first"] = {
                "ms": ms,
                "TB_per_s": kv_bytes / ms / 1e9,
                "max_err": (fn().float() - expected).abs().max().item(),
            }
        tiles = tuning.for_device(q.device).decode(kc.dtype == torch.float8_e4m3fn, q.shape[-1])
        row["default_num_splits"] = attention_triton.default_num_splits(
            len(contexts),
            KV_HEADS,
            tables.shape[1] * BLOCK,
            q.device,
            tiles["BLOCK_N"],
            tiles["programs_per_sm"],
        )
        best = min((v["ms"], k) for k, v in row["tiles"].items() if "ms" in v)
        default = row["tiles"]["64w4s3/batch_order"]["ms"]
        print(
            f"step {step:4d}: batch {row['batch']:3d}, mean ctx {row['mean_context']:6.0f}, max {row['max_context']:5d}: "
            f"default {default:.4f} ms ({kv_bytes / default / 1e9:.2f} TB/s), best {best[1]} {best[0]:.4f} ms "
            f"({kv_bytes / best[0] / 1e9:.2f} TB/s)",
            flush=True,
        )
        for key, entry in row["tiles"].items():
            print(f"    {key:26} {entry}")
        record["snapshots"].append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
