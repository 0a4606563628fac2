"""xgrammar against llguidance on the CPU: schema compile time and per-token mask time.

    python benchmarks/grammar_engines.py --out benchmarks/results/grammar_engines_compile_mask_cpu.json

For each tokenizer (the course model's and a tiny Qwen3's) and each engine: the time to compile
each of the shared JSON schemas (benchmarks/structured_schemas.py, a fresh compiler, no cache),
and the time to fill one row's token bitmask, walking each schema to its end by a seeded random
choice among the allowed tokens. Prints a table, writes the JSON record."""

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.structured_schemas import SCHEMAS  # noqa: E402
from tools.tiny_model import build_if_missing  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def allowed(bitmask: torch.Tensor, vocab: int) -> list[int]:
    """Token ids whose bit is set in a (words,) int32 bitmask."""
    bits = (bitmask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1  # (words, 32)
    return bits.flatten()[:vocab].nonzero().flatten().tolist()


class Xgrammar:
    def __init__(self, tokenizer, vocab: int, eos: list[int]):
        import xgrammar as xgr

        self.xgr, self.vocab = xgr, vocab
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab, stop_token_ids=eos
        )

    def compile(self, schema: dict):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask):
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher, token: int) -> bool:
        assert matcher.accept_token(token)
        return matcher.is_terminated()


class Llguidance:
    def __init__(self, tokenizer, vocab: int, eos: list[int]):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.fill_row, self.vocab = (
            llguidance,
            llguidance.torch.fill_next_token_bitmask,
            vocab,
        )
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos[0])

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
        matcher = self.llg.LLMatcher(
            self.tokenizer, grammar
        )  # llguidance compiles lazily: build one to compile
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tokenizer, compiled)

    def fill(self, matcher, bitmask):
        self.fill_row(matcher, bitmask.unsqueeze(0), 0)

    def accept(self, matcher, token: int) -> bool:
        assert matcher.consume_token(token), matcher.get_error()
        return matcher.is_stopped()


def walk(engine, compiled, eos: list[int], rng: random.Random, max_steps: int = 64) -> list[float]:
    """Mask-fill seconds of each step of one random walk to the schema's end."""
    matcher, times = engine.matcher(compiled), []
    bitmask = torch.zeros((engine.vocab + 31) // 32, dtype=torch.int32)
    for _ in range(max_steps):
        start = time.perf_counter()
        engine.fill(matcher, bitmask)
        times.append(time.perf_counter() - start)
        ids = allowed(bitmask, engine.vocab)
        token = eos[0] if eos[0] in ids else rng.choice(ids)
        if token in eos or engine.accept(matcher, token):
            break
    return times


def percentiles(seconds: list[float]) -> dict:
    ms = sorted(1e3 * s for s in seconds)
    return {
        "p50_ms": round(statistics.median(ms), 4),
        "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 4),
        "max_ms": round(ms[-1], 4),
        "count": len(ms),
    }


def measure(name: str, cls, tokenizer, vocab: int, eos: list[int]) -> dict:
    start = time.perf_counter()
    engine = cls(tokenizer, vocab, eos)
    setup = time.perf_counter() - start
    compile_s, fill_s, rng = [], [], random.Random(0)
    for schema in SCHEMAS:
        start = time.perf_counter()
        compiled = engine.compile(schema)
        compile_s.append(time.perf_counter() - start)
        fill_s += walk(engine, compiled, eos, rng)
    return {
        "engine": name,
        "tokenizer_setup_ms": round(1e3 * setup, 2),
        "compile": percentiles(compile_s),
        "mask_fill": percentiles(fill_s),
    }


def tokenizers(tmp: Path) -> dict:
    from transformers import AutoConfig, AutoTokenizer

    dirs = {
        "course-llama": ROOT / "models" / "course-llama",
        "tiny-qwen3": build_if_missing(tmp / "qwen3", arch="qwen3"),
    }
    out = {}
    for name, path in dirs.items():
        config = AutoConfig.from_pretrained(path)
        eos = (
            config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
        )
        out[name] = (AutoTokenizer.from_pretrained(path), config.vocab_size, eos)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=None, help="write the JSON record here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from importlib.metadata import version

    record = {
        "benchmark": "grammar_engines_compile_mask",
        "device": "cpu",
        "schemas": len(SCHEMAS),
        "versions": {name: version(name) for name in ("xgrammar", "llguidance", "torch")},
        "command": " ".join(["python", *sys.argv]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "rows": [],
    }
    print(
        f"{'tokenizer':14} {'engine':11} {'setup ms':>9} {'compile p50':>12} {'p90':>8} {'max':>8} {'mask p50':>9} {'p90':>8}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for tok_name, (tokenizer, vocab, eos) in tokenizers(Path(tmp)).items():
            for name, cls in (("xgrammar", Xgrammar), ("llguidance", Llguidance)):
                row = {
                    "tokenizer": tok_name,
                    "vocab_size": vocab,
                    **measure(name, cls, tokenizer, vocab, eos),
                }
                record["rows"].append(row)
                c, m = row["compile"], row["mask_fill"]
                print(
                    f"{tok_name:14} {name:11} {row['tokenizer_setup_ms']:9.1f} {c['p50_ms']:12.2f} {c['p90_ms']:8.2f} "
                    f"{c['max_ms']:8.2f} {m['p50_ms']:9.4f} {m['p90_ms']:8.4f}"
                )
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
