"""One mixture-of-experts layer of a shape: the fused grouped-GEMM path (final's
kernels/moe.py) against the loop over the experts that have tokens, bf16, CUDA only.

    python -m benchmarks.moe_layer_bench --shape qwen3-30b-a3b --out benchmarks/results/moe_layer_qwen3-30b-a3b_h200.json

For each token count, random hidden states and router logits; both paths must agree (max
relative error printed). Times are medians of CUDA-event-timed calls after warm-up: the loop
and the fused path called eagerly (the host's launches included), and the fused path
replayed from a CUDA graph, as a captured decode step runs it, for each tile configuration
of TILE_CHOICES (the GPU's time alone), and for few tokens the matrix-vector path with each
of GEMV_CHOICES; `fused_graph_us` is the path and tiles the layer picks by itself. `weight_bytes` is what the layer must read at least
(the experts that received a token), and `bound_us` that at `--bandwidth` TB/s.

The router, replayed from a CUDA graph: `route_torch_graph_us` (layers/moe.py's route_torch,
five launches) against `route_fused_graph_us` (kernels/moe.py's fused_route, one), and the whole
block as SparseMoeBlock runs it (the router GEMM, the routing, the fused experts) with either:
`block_graph_us_torch_route` and `block_graph_us_fused_route`."""

import argparse
import json

import torch
import torch.nn.functional as F
import triton

from benchmarks.kernel_bench import cuda_time_ms, graph_time_ms
from benchmarks.run import versions
from nanovllm_final.kernels import moe as fused_moe
from nanovllm_final.layers.moe import Experts, route, route_torch
from tools.tiny_model import FULL_SHAPES, build_config


def timed(fn, reps: int = 20) -> float:
    """Median microseconds of fn() called eagerly (the host's launches included)."""
    return cuda_time_ms(fn, reps) * 1e3


def graph_time(fn) -> float:
    """Median microseconds of fn() replayed from a CUDA graph (the GPU's time alone)."""
    return graph_time_ms(fn, reps=20) * 1e3


TILE_CHOICES = [  # BLOCK_N, BLOCK_K, num_warps, num_stages
    (64, 64, 4, 3),
    (64, 128, 4, 3),
    (64, 128, 4, 4),
    (128, 64, 4, 3),
    (32, 128, 4, 4),
    (128, 128, 8, 3),
    (64, 256, 8, 3),
]
GEMV_CHOICES = [  # BLOCK_N, BLOCK_K, num_warps, DOWN_BLOCK_N, DOWN_BLOCK_K
    (16, 128, 4, 2, 128),
    (8, 256, 4, 2, 256),
    (16, 256, 4, 2, 256),
    (16, 128, 2, 2, 128),
    (8, 128, 2, 2, 128),
    (8, 256, 4, 1, 256),
    (8, 256, 4, 4, 256),
    (8, 128, 4, 4, 128),
    (16, 256, 8, 4, 256),
    (8, 512, 4, 2, 256),
    (8, 512, 8, 2, 512),
    (4, 1024, 4, 2, 256),
    (4, 1024, 8, 2, 1024),
    (8, 1024, 8, 2, 1024),
    (4, 2048, 8, 1, 1024),
    (2, 2048, 4, 2, 512),
    (8, 256, 4, 2, 1024),
    (8, 256, 4, 4, 1024),
]
GEMV_MAX_PAIRS = 128  # the matrix-vector path is timed up to this many (token, expert) pairs


def routing_times(
    layer: Experts,
    gate: torch.Tensor,
    x: torch.Tensor,
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
) -> dict:
    """The router alone and the whole block (router GEMM, routing, experts) replayed from CUDA
    graphs, with the torch routing and with the routing kernel."""

    def block(route_fn):
        return lambda: layer(x, *route_fn(F.linear(x, gate), top_k, renormalize))  # (T, hidden)

    return {
        "route_torch_graph_us": graph_time(lambda: route_torch(logits, top_k, renormalize)),
        "route_fused_graph_us": graph_time(
            lambda: fused_moe.fused_route(logits, top_k, renormalize)
        ),
        "block_graph_us_torch_route": graph_time(block(route_torch)),
        "block_graph_us_fused_route": graph_time(block(fused_moe.fused_route)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shape", default="qwen3-30b-a3b", choices=[s for s in FULL_SHAPES if "a3b" in s]
    )
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256, 1024, 4096]
    )
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=4.3,
        help="TB/s of the GPU memory (an H200 copies at about 4.3)",
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    config = build_config(arch=None, shape=args.shape)
    experts_n, top_k = config["num_experts"], config["num_experts_per_tok"]
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    torch.manual_seed(0)
    layer = Experts(experts_n, hidden, inter).to("cuda", torch.bfloat16)
    with torch.no_grad():
        layer.gate_up_proj.normal_(0, 0.02)
        layer.down_proj.normal_(0, 0.02)
    gate = (
        torch.randn(experts_n, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    )  # (E, hidden): the router
    renormalize = config.get("norm_topk_prob", True)
    rows = []
    print(
        "time: median us per call; loop and eager include the host's launches, graph is the GPU alone"
    )
    with torch.inference_mode():
        for tokens in args.tokens:
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)  # (T, hidden)
            logits = torch.randn(tokens, experts_n, device="cuda", dtype=torch.bfloat16)  # (T, E)
            weights, ids = route(logits, top_k, renormalize)
            fused = fused_moe.fused_experts(x, layer.gate_up_proj, layer.down_proj, weights, ids)
            loop = layer.forward_loop(x, weights, ids)
            error = (
                (fused.float() - loop.float()).abs().max()
                / loop.float().abs().max().clamp_min(1e-6)
            ).item()
            hit = ids.unique().numel()
            weight_bytes = hit * 3 * hidden * inter * 2

            def fused_with(tiles=None, small=None):
                return lambda: fused_moe.fused_experts(
                    x, layer.gate_up_proj, layer.down_proj, weights, ids, tiles=tiles, small=small
                )

            graphs = {}  # grouped GEMMs by tiles, then the matrix-vector path ("gemv ...") for few pairs
            choices = [
                (
                    f"{bn}x{bk}/w{w}/s{st}",
                    {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": st},
                    False,
                )
                for bn, bk, w, st in TILE_CHOICES
            ]
            if tokens * top_k <= GEMV_MAX_PAIRS:
                gemv = fused_moe.fused_experts(
                    x, layer.gate_up_proj, layer.down_proj, weights, ids, small=True
                )
                error = max(
                    error,
                    (
                        (gemv.float() - loop.float()).abs().max()
                        / loop.float().abs().max().clamp_min(1e-6)
                    ).item(),
                )
                choices += [
                    (
                        f"gemv {bn}x{bk}/w{w}/d{dn}x{dk}",
                        {
                            "BLOCK_N": bn,
                            "BLOCK_K": bk,
                            "num_warps": w,
                            "DOWN_BLOCK_N": dn,
                            "DOWN_BLOCK_K": dk,
                        },
                        True,
                    )
                    for bn, bk, w, dn, dk in GEMV_CHOICES
                ]
            for name, tiles, small in choices:
                try:
                    graphs[name] = graph_time(fused_with(tiles, small))
                except (
                    triton.runtime.errors.OutOfResources
                ):  # too much shared memory for this block size
                    graphs[name] = None
            best = min((k for k in graphs if graphs[k] is not None), key=graphs.get)
            row = {
                "tokens": tokens,
                "experts_hit": hit,
                "max_rel_error": error,
                "loop_us": timed(lambda: layer.forward_loop(x, weights, ids), reps=5),
                "fused_eager_us": timed(fused_with()),
                "fused_graph_us": graph_time(fused_with()),
                "graph_us_by_tiles": graphs,
                "best_tiles": best,
                "weight_bytes": weight_bytes,
                "bound_us": weight_bytes / (args.bandwidth * 1e12) * 1e6,
            }
            row["speedup"] = row["loop_us"] / row["fused_eager_us"]
            row.update(routing_times(layer, gate, x, logits, top_k, renormalize))
            rows.append(row)
            print(
                f"{tokens:>6} tokens {hit:>4} experts  loop {row['loop_us']:8.1f} us  fused eager {row['fused_eager_us']:7.1f}"
                f"  graph {row['fused_graph_us']:7.1f} (best {graphs[best]:7.1f} {best})  x{row['speedup']:5.1f}"
                f"  bound {row['bound_us']:6.1f} us  err {error:.1e}",
                flush=True,
            )
            print(
                f"{'':>6} route torch {row['route_torch_graph_us']:6.1f} us  fused {row['route_fused_graph_us']:6.1f} us;"
                f"  block (router GEMM, route, experts) torch route {row['block_graph_us_torch_route']:7.1f} us"
                f"  fused route {row['block_graph_us_fused_route']:7.1f} us",
                flush=True,
            )
    record = {
        "benchmark": "moe_layer",
        "shape": args.shape,
        "device": torch.cuda.get_device_name(),
        "dtype": "bfloat16",
        "num_experts": experts_n,
        "top_k": top_k,
        "hidden_size": hidden,
        "moe_intermediate_size": inter,
        "rows": rows,
        "versions": versions(),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
