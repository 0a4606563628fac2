"""Structured output's cost: decode step time with every row constrained against none, and
schema compile time percentiles, on one device in one process.

    python -m benchmarks.structured_bench --shape qwen3-0.6b --batch 256 --repeats 3 \
        --out benchmarks/results/structured_step_time_qwen3-0.6b_h100.json
    python -m benchmarks.structured_bench --shape tiny-qwen3 --batch 16 --device cpu   # a quick check
    python -m benchmarks.structured_bench --pieces-only 151936 --batch 256 --device cpu  # the pieces alone

The constrained step's pieces (`pieces`: the matchers' advance, the bitmask's fill as the engine does
it (on a GPU past FILL_INLINE_ROWS rows on the pool's NANOVLLM_FILL_THREADS threads) and on one thread, its upload, the mask's
application by the kernel and by the PyTorch reference) are timed alone at the same batch.

`batch` prompts of 32 random tokens generate `--max-tokens` tokens each (ignore_eos, greedy),
either free or each under a JSON schema (an object holding an array of at least 1000 objects, so
no row ends early); the step time is the median wall time of the decode steps of the full batch
in llm.stats (with `--repeats R`, the median of R such runs, alternated with the other mode's in
one engine).
Each mode runs with overlap scheduling on (a step's mask filled on the host while the device runs
its forward pass, see engine/structured.py) and off. Compile times: every schema of
benchmarks/structured_schemas.py against the
model's tokenizer and vocabulary, uncached (random-weight models carry the factory's small
tokenizer: a real checkpoint's 150k-token vocabulary takes the compiler longer)."""

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch

from benchmarks.run import model_for_shape, versions
from benchmarks.structured_schemas import SCHEMAS
from nanovllm_final import LLM, SamplingParams
from nanovllm_final.engine.structured import (
    Grammars,
    Job,
    apply_bitmask,
    apply_bitmask_reference,
    xgrammar,
)
from nanovllm_final.structured_outputs import StructuredOutputsParams

LONG = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 1000,
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
                "required": ["name", "count"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


def step_ms(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    llm.generate(prompts, params, use_tqdm=False)  # warm-up (and the grammar's compile)
    before = len(llm.stats)
    llm.generate(prompts, params, use_tqdm=False)
    decode = [
        s["seconds"]
        for s in list(llm.stats)[before:]
        if not s["is_prefill"] and s["num_seqs"] == len(prompts)
    ]
    return statistics.median(decode) * 1e3


def valid_outputs(llm: LLM) -> dict:
    """Every shared schema under greedy, sampled (the full-vocabulary draw) and top-k sampled decoding
    on this device: how many outputs parse and validate (all of them, or the run fails)."""
    import jsonschema

    count = 0
    for extra in (
        {"temperature": 0.0},
        {"temperature": 0.8, "seed": 1},
        {"temperature": 0.8, "top_k": 20, "seed": 2},
    ):
        params = [
            SamplingParams(max_tokens=128, structured_outputs={"json": s}, **extra) for s in SCHEMAS
        ]
        for schema, out in zip(
            SCHEMAS, llm.generate(["Describe it:"] * len(SCHEMAS), params, use_tqdm=False)
        ):
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

    def pick(q: float) -> float:
        return round(times[min(len(times) - 1, int(q * len(times)))], 3)

    return {
        "count": len(times),
        "p50_ms": pick(0.5),
        "p90_ms": pick(0.9),
        "p99_ms": pick(0.99),
        "max_ms": round(times[-1], 3),
    }


def pieces(
    tokenizer,
    vocab_size: int,
    eos_ids: list[int],
    batch: int,
    device: str,
    dtype: torch.dtype,
    steps: int = 20,
) -> dict:
    """A constrained step's host and device pieces at this batch, every row under LONG, the median
    ms over `steps` steps along the grammar: the matchers' advance by the step before's tokens
    (Grammars.advance), the bitmask's fill (Grammars.bitmask), its upload, and its application to
    (batch, vocab) logits by apply_bitmask (the kernel on CUDA) and by the PyTorch reference."""
    grammars = Grammars(tokenizer, vocab_size, eos_ids)
    grammars.device = torch.device(device)
    compiled = grammars._compile(Job(), StructuredOutputsParams(json=LONG))
    seqs = [
        SimpleNamespace(
            grammar=xgrammar().GrammarMatcher(compiled),
            is_finished=False,
            grammar_early=None,
            seq_id=i,
        )
        for i in range(batch)
    ]
    # twins in the same states, filled on one thread: each fill is the first at its state (a
    # matcher fills faster at a state it has filled before)
    twins = [seq.grammar.fork() for seq in seqs]
    logits = torch.randn(batch, vocab_size, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times: dict[str, list[float]] = {
        k: [] for k in ("advance", "fill", "fill_one_thread", "upload", "apply", "apply_reference")
    }

    def timed(name: str, fn):
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        times[name].append((time.perf_counter() - start) * 1e3)
        return out

    one = xgrammar().BatchGrammarMatcher(max_threads=1)
    for step in range(steps):
        # in turns, which fills first: the first after the step's other work meets colder caches
        spare = torch.zeros(batch, -(-grammars.grammar_vocab // 32), dtype=torch.int32)
        if step % 2:
            timed("fill_one_thread", lambda: one.batch_fill_next_token_bitmask(twins, spare))
        mask = timed("fill", lambda: grammars.bitmask(seqs).wait())
        if not step % 2:
            timed("fill_one_thread", lambda: one.batch_fill_next_token_bitmask(twins, spare))
        if grammars.grammar_vocab % 32:  # as HostMask.wait clears them
            spare[:, -1] &= (1 << grammars.grammar_vocab % 32) - 1
        assert torch.equal(spare, mask.filled)
        bitmask = mask.bitmask
        on_device = timed("upload", lambda: mask.to(torch.device(device)))
        work = logits.clone()
        timed("apply", lambda: apply_bitmask(work, *on_device, inplace=True))
        if step < 3 or device.startswith(
            "cuda"
        ):  # the reference takes ~1 s a step on a CPU at a full vocabulary
            timed("apply_reference", lambda: apply_bitmask_reference(logits, *on_device))
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")  # (batch, 32 words)
        tokens = [
            int(np.flatnonzero(b)[step * 7 % max(1, int(b.sum()))]) for b in bits
        ]  # allowed tokens
        timed("advance", lambda: grammars.advance(seqs, tokens))
        assert all(twin.accept_token(t) for twin, t in zip(twins, tokens))
        for seq in seqs:
            assert seq.grammar_early
            seq.grammar_early = None
    grammars.shutdown()
    out = {f"{name}_ms": round(statistics.median(t), 3) for name, t in times.items()}
    out["bitmask_shape"] = list(bitmask.shape)
    out["fill_threads"] = grammars.fill_threads  # the pool's (0: none, the engine's thread fills)
    out["host_ms"] = round(out["advance_ms"] + out["fill_ms"], 3)  # the grammar's host work a step
    return out


def print_pieces(p: dict, batch: int) -> None:
    print(
        f"pieces at batch {batch} (bitmask {p['bitmask_shape']}): advance {p['advance_ms']:.3f} ms  "
        f"fill {p['fill_ms']:.3f} ms (pool threads: {p['fill_threads']}; one thread: {p['fill_one_thread_ms']:.3f} ms)  "
        f"upload {p['upload_ms']:.3f} ms  apply {p['apply_ms']:.3f} ms  "
        f"(PyTorch reference {p['apply_reference_ms']:.3f} ms)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of each mode, alternated; the median counts"
    )
    parser.add_argument("--out")
    parser.add_argument(
        "--pieces-only",
        type=int,
        metavar="VOCAB_SIZE",
        help="only the pieces, on tiny-qwen3's tokenizer with this vocab_size (no model)",
    )
    parser.add_argument(
        "--full-vocab-matchers",
        action="store_true",
        help="the matchers and bitmask over the model's "
        "whole vocab_size, not only the tokenizer's ids (as before Grammars.grammar_vocab)",
    )
    args = parser.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.full_vocab_matchers:
        Grammars.grammar_vocab = property(lambda self: self.vocab_size)
    if args.pieces_only:
        return main_pieces(args, dtype)
    path = model_for_shape(args.shape, args.device)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (32,), generator=g).tolist() for _ in range(args.batch)]
    free = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0,
        max_tokens=args.max_tokens,
        ignore_eos=True,
        structured_outputs={"json": LONG},
    )
    rows = []
    for overlap in (True, False):
        with LLM(
            path,
            device=args.device,
            dtype=dtype,
            max_num_seqs=args.batch,
            max_model_len=max(48 + args.max_tokens, 256),
            overlap_scheduling=overlap,
        ) as llm:
            runs = {"free": [], "constrained": []}  # alternated: a drift reaches both modes alike
            for _ in range(args.repeats):
                for mode, p in (("free", free), ("constrained", constrained)):
                    runs[mode].append(step_ms(llm, prompts, p))
            times = {mode: statistics.median(t) for mode, t in runs.items()}
            if overlap:
                compiles, checked = compile_ms(llm), valid_outputs(llm)
                engine = llm.engine
                parts = pieces(
                    llm.tokenizer,
                    engine.model_config.vocab_size,
                    engine.eos_token_ids,
                    args.batch,
                    args.device,
                    getattr(torch, dtype),
                )
        row = {
            "overlap_scheduling": overlap,
            "free_ms": round(times["free"], 3),
            "constrained_ms": round(times["constrained"], 3),
            "ratio": round(times["constrained"] / times["free"], 3),
        }
        if args.repeats > 1:
            row |= {f"{mode}_runs_ms": [round(t, 3) for t in runs[mode]] for mode in runs}
        rows.append(row)
        print(
            f"overlap {row['overlap_scheduling']!s:5}  batch {args.batch}: free {row['free_ms']:8.2f} ms   "
            f"constrained {row['constrained_ms']:8.2f} ms   x{row['ratio']:.3f}",
            flush=True,
        )
    print_pieces(parts, args.batch)
    print(f"{checked['valid']} outputs of the shared schemas parse and validate on {args.device}")
    print(
        f"compile ({compiles['count']} schemas): p50 {compiles['p50_ms']} ms  p90 {compiles['p90_ms']} ms  "
        f"max {compiles['max_ms']} ms"
    )
    record = {
        "benchmark": "structured_step_time",
        "shape": args.shape,
        "dtype": dtype,
        "batch": args.batch,
        "prompt_len": 32,
        "max_tokens": args.max_tokens,
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "full_vocab_matchers": args.full_vocab_matchers,
        "rows": rows,
        "pieces": parts,
        "compile": compiles,
        "outputs": checked,
        "versions": versions(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)


def main_pieces(args, dtype: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_for_shape("tiny-qwen3", "cpu"))
    parts = pieces(
        tokenizer,
        args.pieces_only,
        [tokenizer.eos_token_id],
        args.batch,
        args.device,
        getattr(torch, dtype),
    )
    print_pieces(parts, args.batch)
    record = {
        "benchmark": "structured_mask_pieces",
        "tokenizer": "tiny-qwen3",
        "vocab_size": args.pieces_only,
        "full_vocab_matchers": args.full_vocab_matchers,
        "dtype": dtype,
        "batch": args.batch,
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "pieces": parts,
        "versions": versions(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
