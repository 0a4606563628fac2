"""Profile engine steps on a GPU: a full-budget prefill and large-batch decode steps.

    python -m benchmarks.profile_steps --engine final --shape qwen3-0.6b \\
        --out benchmarks/results/profile_final_h200.json

`num_seqs` prompts of `prompt_len` random tokens each generate `max_tokens` tokens: the
first steps are prefills of `max_num_batched_tokens` tokens (the first one of whole
prompts only, the later ones also carrying a chunk of a prompt begun in the step before),
then `max_tokens - 1` decode steps of `num_seqs` sequences at about `prompt_len` tokens of
context. The generate is run once untimed (warm-up), once timed without the profiler
(the step times in `llm.stats`), and once under torch.profiler (benchmarks/profiling.py:
per step, GPU busy time, sampling, GPU idle time, the top kernels).

`--variant base` runs the final engine with its fused Triton kernels switched off (the
layers' PyTorch code for RMSNorm, q/k norm and RoPE, SiLU-and-multiply, and the sampler's
temperature-only draw, as in the stages), `fused` as it is; both by default for the final
engine. Each variant also records the peak CUDA memory its timed generate allocated beyond
what the loaded engine holds.
"""

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.profiling import profile_generate  # noqa: E402
from benchmarks.run import model_for_shape, resolve_engine, versions  # noqa: E402

VARIANTS = ("base", "fused")


@contextlib.contextmanager
def variant(module, name: str):
    """Switch off the final engine's fast paths that `name` leaves out (final only)."""
    if module.__name__ == "nanovllm_final" and name == "base":  # every layer's PyTorch code
        from nanovllm_final.kernels import dispatch

        with dispatch.reference_only():
            yield
    else:
        yield


def step_times(stats: list[dict]) -> dict:
    out = {}
    for kind, is_prefill in (("prefill", True), ("decode", False)):
        secs = [s["seconds"] * 1e3 for s in stats if bool(s.get("is_prefill")) == is_prefill]
        if secs:
            out[kind] = {
                "steps": len(secs),
                "mean_ms": statistics.fmean(secs),
                "median_ms": statistics.median(secs),
            }
    return out


def run(module, path: Path, args: argparse.Namespace, name: str) -> dict:
    rng = random.Random(0)
    prompts = [
        [rng.randint(0, 10000) for _ in range(args.prompt_len)] for _ in range(args.num_seqs)
    ]
    params = module.SamplingParams(temperature=0.6, max_tokens=args.max_tokens, ignore_eos=True)
    options = dict(device="cuda", dtype=args.dtype, max_num_seqs=args.num_seqs)
    with variant(module, name):
        start = time.perf_counter()
        with module.LLM(str(path), **options) as llm:
            load = time.perf_counter() - start
            llm.generate(prompts, params, use_tqdm=False)  # warm-up: compiles, autotunes
            before = len(llm.stats)
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            step_peak = torch.cuda.max_memory_allocated() - held
            timed = step_times(list(llm.stats)[before:])
            report = profile_generate(llm, prompts, params, top=args.top)
    # host time: what the unprofiled step took beyond the profiled GPU busy time
    for kind, times in timed.items():
        gpu = report["summary"].get(kind, {}).get("mean_gpu_ms")
        if gpu is not None:
            times["host_ms_estimate"] = max(0.0, times["mean_ms"] - gpu)
    return {
        "variant": name,
        "load_seconds": load,
        "generate_seconds": seconds,
        "step_peak_bytes": step_peak,
        "unprofiled_steps": timed,
    } | report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", default="final")
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--top", type=int, default=12, help="kernels kept per step kind, by GPU time"
    )
    parser.add_argument(
        "--variant", action="append", choices=VARIANTS, help="default: both (final), else 'fused'"
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, "error: profiling GPU steps needs a CUDA GPU\n")
    label, module = resolve_engine(args.engine)
    path = model_for_shape(args.shape, "cuda")
    names = args.variant or (list(VARIANTS) if label == "final" else ["fused"])
    record = {
        "benchmark": "profile_steps",
        "engine": label,
        "shape": args.shape,
        "dtype": args.dtype,
        "num_seqs": args.num_seqs,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "device_name": torch.cuda.get_device_name(),
        "versions": versions(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "runs": [],
    }
    for name in names:
        result = run(module, path, args, name)
        record["runs"].append(result)
        for kind, s in result["summary"].items():
            t = result["unprofiled_steps"].get(kind, {})
            print(
                f"{label:8} {name:6} {kind:8} steps {s['steps']:3d}  step {t.get('mean_ms', float('nan')):7.2f} ms"
                f"  gpu {s['mean_gpu_ms']:7.2f} ms  sampling {s['mean_sampling_ms']:5.2f} ms"
                f"  kernels {s['mean_kernels']:6.0f}  host~ {t.get('host_ms_estimate', float('nan')):6.2f} ms",
                flush=True,
            )
        print(
            f"{label:8} {name:6} peak memory of a step beyond the loaded engine: {result['step_peak_bytes'] / 2**30:.2f} GiB"
        )
        for kind, top in result["top_kernels"].items():
            for k in top[:6]:
                print(
                    f"    {kind:8} {k['ms_per_step']:7.3f} ms/step {100 * k['share']:5.1f}%  {k['name'][:90]}"
                )
        if args.out:  # after each variant, so that a later failure keeps what was measured
            Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
