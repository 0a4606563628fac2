"""The final engine's decode kernel as the engine calls it, per tile choice (CUDA only).

    python benchmarks/decode_tiles_bench.py --shape qwen3-0.6b --out benchmarks/results/decode_tiles_qwen3-0.6b_h200.json
    python benchmarks/decode_tiles_bench.py --shape qwen3-0.6b --kv-cache-dtype fp8 \\
        --out benchmarks/results/decode_tiles_fp8-kv_qwen3-0.6b_h200.json
    python benchmarks/decode_tiles_bench.py --shape llama-3.2-1b --out benchmarks/results/decode_tiles_llama-3.2-1b_h200.json

decode_attention_bench.py times the kernel's attention alone; a decode step also hands it the
new tokens' K/V to store and, for Qwen3, q and k before their norms and RoPE (`new_kv`,
`rope`). This times that whole launch (GPU time of CUDA-graph replays) over the context
snapshots of nano-vllm's workload, longest context first as the engine launches it, with each
sequence's blocks where the engine's block manager puts them (`--layout engine`: a prompt's
blocks in one run, the later ones a block at a time across the batch; `shuffled`: every block
at a random place, as decode_attention_bench.py has them), for each
(BLOCK_N, num_warps, num_stages), checks each result against the PyTorch path (the rotary layer,
the reference store and attention), and sums the snapshots' times: the sum is what
the device's tuning (kernels/tuning.py) picks by. At the chosen tile it also times split-K factors
and the number default_num_splits picks (the splits' sums beside the tiles').
"""

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_attention_bench import BLOCK, engine_block_tables, paged_batch, snapshot  # noqa: E402
from benchmarks.kernel_bench import gpu_bench_args, graph_time_ms  # noqa: E402
from nanovllm_final.kernels import attention as attention_triton  # noqa: E402
from nanovllm_final.kernels import tuning  # noqa: E402
from nanovllm_final.layers import attention_torch  # noqa: E402
from nanovllm_final.layers.norm import RMSNorm  # noqa: E402
from nanovllm_final.layers.rotary import RotaryEmbedding  # noqa: E402
from nanovllm_final.tune import DECODE_TILES  # noqa: E402

# heads, kv heads, head_dim, q/k norms (Qwen3), RoPE theta
SHAPES = {"qwen3-0.6b": (16, 8, 128, True, 1e6), "llama-3.2-1b": (32, 8, 64, False, 5e5)}
TILES = DECODE_TILES  # the candidates `python -m nanovllm_final.tune` times
STEPS = (
    1,
    300,
    400,
    500,
    600,
    700,
    750,
    850,
    900,
    950,
    980,
    1000,
    1020,
)  # decode steps into the run (snapshot)
SPLITS = (1, 2, 3, 4, 6, 8)  # split-K factors tried at decode_tiles' tile


def decode_batch(
    contexts: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    cache_dtype: torch.dtype,
    block_tables: list[list[int]] | None,
):
    """decode_attention_bench's paged batch, the step's new K/V, each sequence's position and new slot (its last)."""
    q, k_cache, v_cache, lens, tables = paged_batch(
        contexts, torch.bfloat16, cache_dtype, heads, kv_heads, head_dim, block_tables
    )
    positions = (lens - 1).long()
    slots = (
        tables.gather(1, (positions // BLOCK)[:, None]).squeeze(1).long() * BLOCK
        + positions % BLOCK
    )
    k, v = (
        torch.randn(len(contexts), kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
        for _ in range(2)
    )
    return q, k, v, k_cache, v_cache, lens, tables, positions, slots


def main() -> None:
    def add_arguments(parser):
        parser.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-0.6b")
        parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
        parser.add_argument(
            "--layout",
            choices=("engine", "shuffled"),
            default="engine",
            help="where the blocks are",
        )

    args = gpu_bench_args(__doc__, reps=10, add_arguments=add_arguments)
    torch.manual_seed(0)
    heads, kv_heads, head_dim, qk_norm, theta = SHAPES[args.shape]
    fp8 = args.kv_cache_dtype == "fp8"
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    scales = (
        {
            "k_scale": torch.full((kv_heads,), 0.5, device="cuda"),
            "v_scale": torch.full((kv_heads,), 0.25, device="cuda"),
        }
        if fp8
        else {}
    )
    rotary = RotaryEmbedding(head_dim, 4096, theta, None).cuda()
    norms = [None, None]
    if qk_norm:
        norms = [RMSNorm(head_dim, 1e-6).cuda().to(torch.bfloat16) for _ in range(2)]
        for norm in norms:
            norm.weight.data = 1 + 0.1 * torch.randn_like(norm.weight)
    scale = head_dim**-0.5
    chosen = tuning.for_device(torch.device("cuda")).decode(fp8, head_dim)
    record = {
        "benchmark": "decode_tiles",
        "shape": args.shape,
        "kv_cache_dtype": args.kv_cache_dtype,
        "layout": args.layout,
        "attention_shape": {
            "heads": heads,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "qk_norm": qk_norm,
            "block_size": BLOCK,
        },
        "device_name": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": " ".join(["python", *sys.argv]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "chosen": "{BLOCK_N}w{num_warps}s{num_stages}".format(**chosen),
        "snapshots": [],
    }
    for step in STEPS:
        contexts = snapshot(step)
        layout = engine_block_tables(step) if args.layout == "engine" else None
        q, k, v, k_cache, v_cache, lens, tables, positions, slots = decode_batch(
            contexts, heads, kv_heads, head_dim, cache_dtype, layout
        )
        order = torch.argsort(lens, descending=True, stable=True).to(torch.int32)
        rope = rotary.kernel_args(positions, *norms)
        q_rot, k_rot = rotary(
            positions, q, k, *norms
        )  # the rotary layer: what the kernel must apply itself
        expected = attention_torch.paged_decode_attention(
            q_rot,
            k_cache.clone(),
            v_cache.clone(),
            lens,
            tables,
            scale,
            new_kv=(k_rot, v, slots),
            **scales,
        ).float()
        kv_bytes = sum(contexts) * kv_heads * head_dim * 2 * k_cache.element_size()  # K and V
        row = {
            "step": step,
            "batch": len(contexts),
            "mean_context": sum(contexts) / len(contexts),
            "max_context": max(contexts),
            "kv_bytes": kv_bytes,
            "tiles": {},
        }
        for bn, w, s in TILES:

            def fn():
                return attention_triton.paged_decode_attention(
                    q,
                    k_cache,
                    v_cache,
                    lens,
                    tables,
                    scale,
                    order,
                    BLOCK_N=bn,
                    num_warps=w,
                    num_stages=s,
                    new_kv=(k, v, slots),
                    rope=rope,
                    **scales,
                )

            key = f"{bn}w{w}s{s}"
            try:
                ms = graph_time_ms(fn, args.reps)
            except Exception as exc:  # e.g. out of shared memory
                row["tiles"][key] = {"error": repr(exc)[:160]}
                continue
            row["tiles"][key] = {
                "ms": ms,
                "TB_per_s": kv_bytes / ms / 1e9,
                "max_err": (fn().float() - expected).abs().max().item(),
            }
        row["default_num_splits"] = attention_triton.default_num_splits(
            len(contexts),
            kv_heads,
            tables.shape[1] * BLOCK,
            q.device,
            chosen["BLOCK_N"],
            chosen["programs_per_sm"],
        )
        row["splits"] = {}
        for n in (*SPLITS, None):  # None: the default

            def fn():
                return attention_triton.paged_decode_attention(
                    q,
                    k_cache,
                    v_cache,
                    lens,
                    tables,
                    scale,
                    order,
                    num_splits=n,
                    new_kv=(k, v, slots),
                    rope=rope,
                    **scales,
                )

            ms = graph_time_ms(fn, args.reps)
            row["splits"]["default" if n is None else f"splits{n}"] = {
                "ms": ms,
                "TB_per_s": kv_bytes / ms / 1e9,
                "max_err": (fn().float() - expected).abs().max().item(),
            }
        record["snapshots"].append(row)
        print(
            f"step {step:4d}: batch {row['batch']:3d}, mean ctx {row['mean_context']:6.0f}: "
            + "  ".join(f"{key} {t['ms']:.4f}" for key, t in row["tiles"].items() if "ms" in t)
            + f"\n    {record['chosen']}, default splits {row['default_num_splits']}: "
            + "  ".join(f"{key} {t['ms']:.4f}" for key, t in row["splits"].items()),
            flush=True,
        )
    for name in ("tiles", "splits"):
        sums = {}
        for row in record["snapshots"]:
            for key, t in row[name].items():
                if "ms" in t:
                    sums[key] = sums.get(key, 0.0) + t["ms"]
        record["sum_ms" if name == "tiles" else "splits_sum_ms"] = dict(
            sorted(sums.items(), key=lambda kv: kv[1])
        )
    record["max_err"] = max(
        t.get("max_err", 0.0)
        for row in record["snapshots"]
        for t in (*row["tiles"].values(), *row["splits"].values())
    )
    for key, ms in record["sum_ms"].items():
        print(
            f"    {key:10} {ms:.4f} ms summed"
            + ("   <- the tuning's" if key == record["chosen"] else "")
        )
    for key, ms in record["splits_sum_ms"].items():
        print(f"    {key:10} {ms:.4f} ms summed at {record['chosen']}")
    print(f"largest difference from the PyTorch path: {record['max_err']:.4g}")
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
