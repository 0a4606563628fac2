"""Structured output's cost: decode step time with every row constrained against none, and
schema compile time percentiles, on one device in one process.

    python -m benchmarks.structured_bench --shape qwen3-0.6b --batch 256 \
        --out benchmarks/results/structured_step_time_qwen3-0.6b_h100.json
    python -m benchmarks.structured_bench --shape tiny-qwen3 --batch 16 --device cpu   # a quick check

`batch` prompts of 32 random tokens generate `--max-tokens` tokens each (ignore_eos, greedy),
either free or each under a JSON schema (an object holding an array of at least 1000 objects, so
no row ends early); the step time is the median wall time of the decode steps of the full batch
in llm.stats.
Each mode runs with overlap scheduling on (a step with constrained rows is completed before the
next is launched, see engine/structured.py) and off. Compile times: every schema of benchmarks/structured_schemas.py against the
model's tokenizer and vocabulary, uncached (random-weight models carry the factory's small
tokenizer: a real checkpoint's 150k-token vocabulary takes the compiler longer)."""

import argparse
import json
import statistics
import time

import torch

from benchmarks.run import model_for_shape, versions
from benchmarks.structured_schemas import SCHEMAS
from nanovllm_final import LLM, SamplingParams
from nanovllm_final.engine.structured import Grammars, Job
from nanovllm_final.structured_outputs import StructuredOutputsParams

LONG = {"type": "object", "properties": {"items": {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
    "required": ["name", "count"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False}


def step_ms(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    llm.generate(prompts, params, use_tqdm=False)  # warm-up (and the grammar's compile)
    before = len(llm.stats)
    llm.generate(prompts, params, use_tqdm=False)
    decode = [s["seconds"] for s in list(llm.stats)[before:] if not s["is_prefill"] and s["num_seqs"] == len(prompts)]
    return statistics.median(decode) * 1e3


def valid_outputs(llm: LLM) -> dict:
    """Every shared schema under greedy, sampled (the full-vocabulary draw) and top-k sampled decoding
    on this device: how many outputs parse and validate (all of them, or the run fails)."""
    import jsonschema

    count = 0
    for extra in ({"temperature": 0.0}, {"temperature": 0.8, "seed": 1}, {"temperature": 0.8, "top_k": 20, "seed": 2}):
        params = [SamplingParams(max_tokens=128, structured_outputs={"json": s}, **extra) for s in SCHEMAS]
        for schema, out in zip(SCHEMAS, llm.generate(["Describe it:"] * len(SCHEMAS), params, use_tqdm=False)):
            assert out["finish_reason"] == "stop", (extra, out["text"])
            jsonschema.validate(json.loads(out["text"]), schema)
            count += 1
    return {"valid": count}


def compile_ms(llm: LLM) -> dict:
    engine = llm.engine
    grammars = Grammars(llm.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    times = []
    for schema in [*SCHEMAS, LONG]:
        start = time.perf_counter()
        grammars._compile(Job(), StructuredOutputsParams(json=schema))
        times.append((time.perf_counter() - start) * 1e3)
    grammars.shutdown()
    times.sort()
    pick = lambda q: round(times[min(len(times) - 1, int(q * len(times)))], 3)
    return {"count": len(times), "p50_ms": pick(0.5), "p90_ms": pick(0.9), "p99_ms": pick(0.99), "max_ms": round(times[-1], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--out")
    args = parser.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    path = model_for_shape(args.shape, args.device)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (32,), generator=g).tolist() for _ in range(args.batch)]
    free = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                                 structured_outputs={"json": LONG})
    rows = []
    for overlap in (True, False):
        with LLM(path, device=args.device, dtype=dtype, max_num_seqs=args.batch, max_model_len=max(48 + args.max_tokens, 256),
                 overlap_scheduling=overlap) as llm:
            times = {mode: step_ms(llm, prompts, p) for mode, p in (("free", free), ("constrained", constrained))}
            if overlap:
                compiles, checked = compile_ms(llm), valid_outputs(llm)
        row = {"overlap_scheduling": overlap, "free_ms": round(times["free"], 3),
               "constrained_ms": round(times["constrained"], 3), "ratio": round(times["constrained"] / times["free"], 3)}
        rows.append(row)
        print(f"overlap {row['overlap_scheduling']!s:5}  batch {args.batch}: free {row['free_ms']:8.2f} ms   "
              f"constrained {row['constrained_ms']:8.2f} ms   x{row['ratio']:.3f}", flush=True)
    print(f"{checked['valid']} outputs of the shared schemas parse and validate on {args.device}")
    print(f"compile ({compiles['count']} schemas): p50 {compiles['p50_ms']} ms  p90 {compiles['p90_ms']} ms  "
          f"max {compiles['max_ms']} ms")
    record = {"benchmark": "structured_step_time", "shape": args.shape, "dtype": dtype, "batch": args.batch,
              "prompt_len": 32, "max_tokens": args.max_tokens, "device": args.device,
              "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "rows": rows, "compile": compiles, "outputs": checked, "versions": versions(),
              "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
