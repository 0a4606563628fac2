"""Decode step latency with and without CUDA graphs (stage 06 or later, CUDA only).

    python -m benchmarks.decode_latency --engine final --shape qwen3-0.6b --out benchmarks/results/decode_latency_qwen3-0.6b_final_h200.json

For each batch size, `batch` prompts of 32 random tokens (`--prompt-len`) generate 64
tokens each (ignore_eos, greedy); the latency is the median wall time of the pure decode
steps in `llm.stats` (scheduling, the forward pass and sampling included; with the final
engine's overlap scheduling, the time from one step's completion to the next's). Batch 1 is
the per-token latency of a single stream.

    python -m benchmarks.decode_latency --engine final --gemv-rows 0 2 4 --batches 1 2 4 8 --out ...

measures the final engine's graph steps instead once per value of the tuning's gemv rows, set
for every projection kind (the most rows a dense layer sends to the row-loop kernel; the
tensor-core product off; 0: cuBLAS always), in one process."""

import argparse
import json
import statistics
import time

import torch

from benchmarks.run import model_for_shape, resolve_engine, versions


def measure(st, path, batch: int, eager: bool, dtype: str, prompt_len: int = 32) -> float:
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, 10000, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    params = st.SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    with st.LLM(
        path, dtype=dtype, enforce_eager=eager, max_num_seqs=max(batch, 1), max_model_len=256
    ) as llm:
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        before = len(llm.stats)
        llm.generate(prompts, params, use_tqdm=False)
        decode = [
            s["seconds"]
            for s in list(llm.stats)[before:]
            if not s["is_prefill"] and s["num_seqs"] == batch
        ]
    return statistics.median(decode) * 1e3


def latency_rows(st, path, args) -> list[dict]:
    """Eager against graph steps at each batch."""
    rows = []
    for batch in args.batches:
        eager, graph = (
            measure(st, path, batch, e, args.dtype, args.prompt_len) for e in (True, False)
        )
        rows.append(
            {"batch": batch, "eager_ms": eager, "graph_ms": graph, "speedup": eager / graph}
        )
        print(
            f"batch {batch:4d}: eager {eager:7.2f} ms   graph {graph:7.2f} ms   x{eager / graph:.2f}",
            flush=True,
        )
    return rows


def gemv_rows(st, path, args) -> list[dict]:
    """Graph steps at each batch for each limit of the final engine's dense row-loop kernel, the
    same for every projection kind (cuBLAS past it: the tensor-core product off)."""
    from nanovllm_final.kernels import tuning

    rows = []
    for limit in args.gemv_rows:
        for batch in args.batches:
            few_rows = {"rows": limit, "dot_rows": 0}
            with tuning.override({"gemv": dict.fromkeys(tuning.GEMV_KINDS, few_rows)}):
                ms = measure(st, path, batch, False, args.dtype, args.prompt_len)
            rows.append({"gemv_rows": limit, "batch": batch, "graph_ms": ms})
            print(
                f"gemv rows {limit}  batch {batch:4d}: graph {rows[-1]['graph_ms']:7.3f} ms",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", default="final")
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument(
        "--gemv-rows",
        type=int,
        nargs="+",
        help="final engine: graph steps at each gemv rows, every kind's (kernels/tuning.py)",
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, "error: decode latency with CUDA graphs needs a CUDA GPU\n")
    if args.gemv_rows and args.engine != "final":
        parser.exit(2, "error: --gemv-rows is the final engine's\n")
    _, st = resolve_engine(args.engine)
    path = model_for_shape(args.shape, "cuda")
    rows = (gemv_rows if args.gemv_rows else latency_rows)(st, path, args)
    record = {
        "benchmark": "dense_gemv_decode_latency" if args.gemv_rows else "decode_latency",
        "engine": args.engine,
        "shape": args.shape,
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "max_tokens": 64,
        "device_name": torch.cuda.get_device_name(),
        "rows": rows,
        "versions": versions(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
