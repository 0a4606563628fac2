"""Time the Triton paged-attention kernels against the PyTorch reference on a CUDA GPU.

    python benchmarks/kernel_bench.py --out benchmarks/results/kernel_bench_h200.json

For each batch size and context length it times
  decode : one query per sequence over a paged cache (Triton decode kernel, with its
           default split-K choice and without split-K) vs the per-sequence reference loop,
           plus dense SDPA on contiguous K/V as a "speed of light" point of comparison;
  prefill: full prompts of that length (q_len == context_len) through the Triton prefill
           kernel vs the reference, plus dense causal SDPA on contiguous K/V.
Times are medians of CUDA-event-timed repetitions, in milliseconds. Triton and SDPA are
timed as CUDA-graph replays (pure GPU time, as with captured decode steps); "eager" is one
plain call including the CPU launch cost; the reference is timed eagerly. Decode also reports
the achieved K/V read bandwidth (GB/s); prefill the attention TFLOP/s (causal half).
"""

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # repo root, for `import stages`

from nanovllm_final.kernels.timing import cuda_time_ms, graph_time_ms  # noqa: E402,F401  (the benchmarks' timers)


def gpu_bench_args(doc: str, reps: int = 20, add_arguments=None) -> argparse.Namespace:
    """A GPU benchmark's command line: --reps, --out and what add_arguments(parser) adds;
    without CUDA, exit with a message."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--out")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, "error: needs a CUDA GPU\n")
    return args


def make_batch(batch, context, q_len, heads, kv_heads, head_dim, block_size, dtype, device):
    """Random paged cache holding `batch` sequences of `context` tokens in shuffled blocks."""
    blocks_per_seq = (context + block_size - 1) // block_size
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    block_tables = perm.view(batch, blocks_per_seq).contiguous()
    q = torch.randn(batch * q_len, heads, head_dim, dtype=dtype, device=device)
    cu_seqlens_q = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * q_len
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables


def contiguous_kv(k_cache, v_cache, block_tables, context):
    """The same K/V gathered into dense (batch, kv_heads, context, head_dim) tensors."""

    def gather(cache):
        b, n = block_tables.shape
        x = cache[block_tables.long()].reshape(b, n * cache.shape[1], *cache.shape[2:])[:, :context]
        return x.transpose(1, 2).contiguous()

    return gather(k_cache), gather(v_cache)


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    ap.add_argument(
        "--stage", default="03_paged", help="stage folder holding layers/attention_triton.py"
    )
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=131072,
        help="skip prefill cases with more tokens than this",
    )
    ap.add_argument(
        "--max-ref-tokens",
        type=int,
        default=32768,
        help="time the (slow) reference only up to this many query tokens",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel_bench.py needs a CUDA GPU")

    tri = importlib.import_module(f"stages.{args.stage}.layers.attention_triton")
    ref = importlib.import_module(f"stages.{args.stage}.layers.attention_torch")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    dtype, dev = getattr(torch, args.dtype), "cuda"
    H, KVH, D, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    scale = D**-0.5
    elem = torch.finfo(dtype).bits // 8
    rows = []

    for mode in ["decode", "prefill"]:
        for context in args.contexts:
            for batch in args.batches:
                q_len = 1 if mode == "decode" else context
                if mode == "prefill" and batch * context > args.max_prefill_tokens:
                    continue
                torch.manual_seed(0)
                q, kc, vc, cu, ctx, bt = make_batch(
                    batch, context, q_len, H, KVH, D, bs, dtype, dev
                )
                row = dict(
                    mode=mode,
                    batch=batch,
                    context=context,
                    heads=H,
                    kv_heads=KVH,
                    head_dim=D,
                    block_size=bs,
                    dtype=args.dtype,
                )
                k_dense, v_dense = contiguous_kv(kc, vc, bt, context)
                if mode == "decode":
                    tri_fn = lambda: tri.paged_decode_attention(q, kc, vc, ctx, bt, scale)
                    row["triton_ms"] = graph_time_ms(tri_fn, args.reps)
                    row["triton_nosplit_ms"] = graph_time_ms(
                        lambda: tri.paged_decode_attention(q, kc, vc, ctx, bt, scale, num_splits=1),
                        args.reps,
                    )
                    qd = q.view(batch, H, 1, D)
                    sdpa_fn = lambda: sdpa(qd, k_dense, v_dense, scale=scale, enable_gqa=True)
                    kv_bytes = 2 * batch * context * KVH * D * elem
                    row["triton_GBps"] = kv_bytes / row["triton_ms"] / 1e6
                else:
                    tri_fn = lambda: tri.paged_prefill_attention(
                        q, kc, vc, cu, ctx, bt, scale, q_len
                    )
                    row["triton_ms"] = graph_time_ms(tri_fn, args.reps)
                    qp = q.view(batch, context, H, D).transpose(1, 2)
                    sdpa_fn = lambda: sdpa(
                        qp,
                        k_dense,
                        v_dense,
                        is_causal=True,
                        scale=scale,
                        enable_gqa=True,
                    )
                    flops = 4 * batch * H * D * context * context / 2  # QK^T and PV, causal half
                    row["triton_TFLOPs"] = flops / row["triton_ms"] / 1e9
                row["triton_eager_ms"] = cuda_time_ms(tri_fn, args.reps)
                try:
                    row["sdpa_dense_ms"] = graph_time_ms(sdpa_fn, args.reps)
                except Exception as exc:  # a backend may not support this shape/dtype
                    row["sdpa_dense_ms"] = None
                    row["sdpa_error"] = repr(exc)[:200]
                if batch * q_len <= args.max_ref_tokens:
                    ref_fn = lambda: ref.paged_attention(q, kc, vc, cu, ctx, bt, scale)
                    row["torch_ref_ms"] = cuda_time_ms(ref_fn, max(3, args.reps // 5), warmup=1)
                    row["max_abs_err"] = (tri_fn().float() - ref_fn().float()).abs().max().item()
                    row["speedup_vs_ref"] = row["torch_ref_ms"] / row["triton_ms"]
                else:
                    row["torch_ref_ms"] = None
                rows.append(row)
                q = kc = vc = k_dense = v_dense = None  # freed before the next batch
                torch.cuda.empty_cache()

    def fmt(x, spec=".3f"):
        return "-" if x is None else format(x, spec)

    print(
        f"{torch.cuda.get_device_name()}  torch {torch.__version__}  heads {H}/{KVH}  head_dim {D}  "
        f"block {bs}  {args.dtype}"
    )
    print(
        f"{'mode':8} {'batch':>5} {'ctx':>5} {'triton ms':>10} {'no-split':>9} {'eager':>8} {'sdpa ms':>9} "
        f"{'ref ms':>9} {'x ref':>7} {'GB/s|TF/s':>10} {'max err':>8}"
    )
    for r in rows:
        rate = r.get("triton_GBps", r.get("triton_TFLOPs"))
        print(
            f"{r['mode']:8} {r['batch']:5d} {r['context']:5d} {fmt(r['triton_ms']):>10} "
            f"{fmt(r.get('triton_nosplit_ms')):>9} {fmt(r['triton_eager_ms']):>8} "
            f"{fmt(r['sdpa_dense_ms']):>9} {fmt(r['torch_ref_ms']):>9} "
            f"{fmt(r.get('speedup_vs_ref'), '.1f'):>7} {fmt(rate, '.1f'):>10} {fmt(r.get('max_abs_err'), '.1e'):>8}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(
            device=torch.cuda.get_device_name(),
            torch=torch.__version__,
            triton=importlib.import_module("triton").__version__,
            stage=args.stage,
        )
        args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
