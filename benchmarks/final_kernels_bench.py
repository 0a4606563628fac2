"""Time nanovllm_final's GPU fast paths against what they replace (CUDA only).

    python benchmarks/final_kernels_bench.py --out benchmarks/results/final_kernels_h200.json

1. The fused Triton kernels (kernels/norm_rope.py, kernels/activation.py) against the layers' PyTorch code, at
   a decode batch (256 tokens) and a full prefill budget (16384 tokens), Qwen3-0.6B shapes.
2. Prefill attention of prompts without a cached prefix: torch's varlen FlashAttention
   (torch.nn.attention.varlen.varlen_attn, on the same K/V packed contiguously) against our
   paged Triton kernel with several tile configurations; and prompt chunks after a cached
   prefix (only the paged kernel can do those), same configurations. On the H200 with
   torch 2.11 the paged kernel at its default tiles was the faster of the two everywhere
   (results/final_kernels_h200.json), so the engine has no varlen path.
All times are GPU times of CUDA-graph replays (benchmarks/kernel_bench.py), medians, in ms.
"""

import inspect
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernel_bench import gpu_bench_args, graph_time_ms, make_batch  # noqa: E402
from nanovllm_final.kernels import activation as activation_kernels  # noqa: E402
from nanovllm_final.kernels import attention as attention_triton  # noqa: E402
from nanovllm_final.kernels import norm_rope  # noqa: E402
from nanovllm_final.layers import attention_torch  # noqa: E402
from nanovllm_final.layers.activation import SiluAndMul  # noqa: E402
from nanovllm_final.layers.norm import RMSNorm  # noqa: E402
from nanovllm_final.layers.rotary import RotaryEmbedding  # noqa: E402

try:  # torch >= 2.10, CUDA
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None


def varlen_prefill(q, k, v, cu, max_len, scale):
    """Causal prefill of whole prompts with torch's varlen FlashAttention (GQA native in
    torch 2.11; torch 2.13 asks for enable_gqa=True)."""
    keywords = inspect.signature(varlen_attn).parameters
    kwargs = {"window_size": (-1, 0)} if "window_size" in keywords else {"is_causal": True}
    if "enable_gqa" in keywords:
        kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
    if "scale" in keywords:
        kwargs["scale"] = scale
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) of the paged prefill kernel; the first is the default
TILES = [
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 64, 4, 2),
    (128, 128, 8, 2),
    (64, 128, 4, 2),
    (128, 32, 4, 2),
]


def elementwise(
    rows: list,
    tokens: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    inter: int,
    reps: int,
):
    dev, dt = "cuda", torch.bfloat16
    norm = RMSNorm(hidden, 1e-6).to(dev, dt)
    qk_norm = RMSNorm(head_dim, 1e-6).to(dev, dt)
    rope = RotaryEmbedding(head_dim, 4096, 1e6, None).to(dev)
    act = SiluAndMul()
    x, res = (
        torch.randn(tokens, hidden, device=dev, dtype=dt),
        torch.randn(tokens, hidden, device=dev, dtype=dt),
    )
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=dev, dtype=dt)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    pos = torch.randint(0, 4096, (tokens,), device=dev)
    gate_up = torch.randn(tokens, 2 * inter, device=dev, dtype=dt)
    cases = {
        "add_rms_norm": (
            lambda: norm_rope.rms_norm(x, norm.weight, 1e-6, res),
            lambda: (lambda s: (norm._norm(s), s))(x + res),
        ),
        "qk_rms_norm": (
            lambda: (
                norm_rope.rms_norm(q, qk_norm.weight, 1e-6),
                norm_rope.rms_norm(k, qk_norm.weight, 1e-6),
            ),
            lambda: (qk_norm._norm(q), qk_norm._norm(k)),
        ),
        "rotary": (
            lambda: norm_rope.rotary(pos, q, k, rope.cos, rope.sin),
            lambda: _torch_rotary(rope, pos, q, k),
        ),
        "silu_and_mul": (
            lambda: activation_kernels.silu_and_mul(gate_up),
            lambda: _torch_silu(act, gate_up),
        ),
    }
    for name, (fused, torch_fn) in cases.items():
        row = {
            "op": name,
            "tokens": tokens,
            "fused_ms": graph_time_ms(fused, reps),
            "torch_ms": graph_time_ms(torch_fn, reps),
        }
        row["speedup"] = row["torch_ms"] / row["fused_ms"]
        rows.append(row)
        print(
            f"{name:14} tokens {tokens:6d}  fused {row['fused_ms']:.4f} ms  torch {row['torch_ms']:.4f} ms  x{row['speedup']:.1f}",
            flush=True,
        )


def _torch_rotary(rope, pos, q, k):
    cos = rope.cos[pos].unsqueeze(1).to(q.dtype)
    sin = rope.sin[pos].unsqueeze(1).to(q.dtype)
    from nanovllm_final.layers.rotary import _rotate

    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _torch_silu(act, x):
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def prefill(rows: list, batch: int, q_len: int, context: int, reps: int, check: bool):
    heads, kv_heads, head_dim, dt = 16, 8, 128, torch.bfloat16
    scale = head_dim**-0.5
    torch.manual_seed(0)
    q, kc, vc, cu, ctx, bt = make_batch(
        batch, context, q_len, heads, kv_heads, head_dim, 16, dt, "cuda"
    )
    fresh = q_len == context
    row = {"batch": batch, "q_len": q_len, "context": context, "tiles": {}}
    flops = 4 * batch * heads * head_dim * (q_len * context - q_len * q_len / 2)  # causal
    expected = attention_torch.paged_attention(q, kc, vc, cu, ctx, bt, scale) if check else None
    if fresh and varlen_attn is not None:
        # the same K/V as the paged cache holds, packed: (batch * context, kv_heads, head_dim)
        k, v = (
            c[bt.long()]
            .reshape(batch, -1, kv_heads, head_dim)[:, :context]
            .reshape(-1, kv_heads, head_dim)
            for c in (kc, vc)
        )
        fn = lambda: varlen_prefill(q, k, v, cu, q_len, scale)
        row["varlen_ms"] = graph_time_ms(fn, reps)
        row["varlen_TFLOPs"] = flops / row["varlen_ms"] / 1e9
        if check:
            row["varlen_max_err"] = (fn().float() - expected.float()).abs().max().item()
    for bm, bn, w, s in TILES:
        fn = lambda: attention_triton.paged_prefill_attention(
            q, kc, vc, cu, ctx, bt, scale, q_len, bm, bn, w, s
        )
        try:
            ms = graph_time_ms(fn, reps)
        except Exception as exc:  # e.g. out of shared memory for a large tile
            row["tiles"][f"{bm}x{bn}w{w}s{s}"] = {"error": repr(exc)[:160]}
            continue
        entry = {"ms": ms, "TFLOPs": flops / ms / 1e9}
        if check:
            entry["max_err"] = (fn().float() - expected.float()).abs().max().item()
        row["tiles"][f"{bm}x{bn}w{w}s{s}"] = entry
    rows.append(row)
    best = min((v["ms"], k) for k, v in row["tiles"].items() if "ms" in v)
    print(
        f"prefill {batch}x{q_len} (ctx {context}): varlen {row.get('varlen_ms', float('nan')):.3f} ms  "
        f"paged default {row['tiles']['64x64w4s2'].get('ms', float('nan')):.3f} ms  best {best[1]} {best[0]:.3f} ms",
        flush=True,
    )
    for name, entry in row["tiles"].items():
        print(f"    {name:14} {entry}")


def main() -> None:
    args = gpu_bench_args(__doc__)
    varlen = varlen_attn
    record = {
        "benchmark": "final_kernels",
        "device_name": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "varlen_signature": str(inspect.signature(varlen)) if varlen is not None else None,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "elementwise": [],
        "prefill": [],
    }
    print("varlen_attn:", record["varlen_signature"], flush=True)
    for tokens in (256, 16384):
        elementwise(record["elementwise"], tokens, 1024, 16, 8, 128, 3072, args.reps)
    for batch, q_len, context in [
        (16, 1024, 1024),
        (4, 4096, 4096),
        (1, 16384, 16384),
        (4, 2048, 4096),
        (16, 512, 2048),
    ]:
        prefill(record["prefill"], batch, q_len, context, args.reps, check=q_len <= 4096)
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
