"""Named benchmark workloads: deterministic prompts and sampling parameters.

Every workload is a function ``fn(vocab_size, *, seed=..., **params)`` that returns
``(prompts, params)``: ``prompts`` is a list of token-id lists, every id in
``[0, vocab_size)``, and ``params`` a list of ``SamplingParams`` keyword dicts, one per
prompt (``{"temperature": 0.6, "max_tokens": 123, "ignore_eos": True}``). The same
arguments always give the same workload: each call draws from its own
``random.Random(seed)``, never from global state.

    from nanovllm_final.workloads import make_workload   # or benchmarks.workloads, the same
    prompts, params = make_workload("nanovllm", vocab_size=151936, num_seqs=64)

`nanovllm bench` runs them; so does the benchmark runner (benchmarks/run.py), on every
stage. Standard library only. Workloads (see benchmarks/README.md):
  nanovllm       nano-vllm's headline benchmark (bench.py): 256 sequences, random ids in
                 [0, 10000], prompts of 100..1024 tokens, max_tokens 100..1024.
  tiny-cpu       16 short sequences for the tiny CPU models; a few seconds on stage 02.
  shared-prefix  prompts that share one long "system prompt", for prefix caching.
  long-prompts   a few very long prompts among many short ones, for chunked prefill.
"""

import inspect
import random
from collections.abc import Callable

Prompts = list[list[int]]
Params = list[dict]
Workload = tuple[Prompts, Params]


def _sampling(max_tokens: int, temperature: float = 0.6) -> dict:
    return {"temperature": temperature, "max_tokens": max_tokens, "ignore_eos": True}


def _ids(rng: random.Random, n: int, high: int) -> list[int]:
    """n random token ids in [0, high]."""
    return [rng.randint(0, high) for _ in range(n)]


def _check(vocab_size: int, **counts: int) -> None:
    """vocab_size >= 2 and every count (num_seqs, lengths) a positive integer."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
    for name, value in counts.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def nanovllm(
    vocab_size: int,
    *,
    num_seqs: int = 256,
    max_input_len: int = 1024,
    max_output_len: int = 1024,
    min_input_len: int = 100,
    min_output_len: int = 100,
    max_token_id: int = 10000,
    temperature: float = 0.6,
    seed: int = 0,
) -> Workload:
    """nano-vllm's bench.py. The draws are made in bench.py's order (every prompt's length
    then its ids, then every max_tokens) from random.Random(seed), so with the defaults and
    a vocabulary above 10000 this is exactly nano-vllm's workload. Token ids are capped at
    vocab_size - 1; the minimum lengths shrink when the maxima are set below them."""
    _check(
        vocab_size,
        num_seqs=num_seqs,
        max_input_len=max_input_len,
        max_output_len=max_output_len,
        min_input_len=min_input_len,
        min_output_len=min_output_len,
    )
    rng = random.Random(seed)
    high = min(max_token_id, vocab_size - 1)
    min_in, min_out = min(min_input_len, max_input_len), min(min_output_len, max_output_len)
    prompts = [_ids(rng, rng.randint(min_in, max_input_len), high) for _ in range(num_seqs)]
    params = [_sampling(rng.randint(min_out, max_output_len), temperature) for _ in range(num_seqs)]
    return prompts, params


def tiny_cpu(
    vocab_size: int,
    *,
    num_seqs: int = 16,
    max_input_len: int = 48,
    max_output_len: int = 48,
    min_input_len: int = 8,
    min_output_len: int = 16,
    temperature: float = 0.6,
    seed: int = 0,
) -> Workload:
    """A small mixed batch for the tiny models on CPU (vocab 512): nano-vllm's draws with
    shorter lengths, over the whole vocabulary."""
    return nanovllm(
        vocab_size,
        num_seqs=num_seqs,
        max_input_len=max_input_len,
        max_output_len=max_output_len,
        min_input_len=min_input_len,
        min_output_len=min_output_len,
        max_token_id=vocab_size - 1,
        temperature=temperature,
        seed=seed,
    )


def shared_prefix(
    vocab_size: int,
    *,
    num_seqs: int = 32,
    prefix_len: int = 64,
    min_suffix_len: int = 4,
    max_suffix_len: int = 16,
    max_output_len: int = 16,
    temperature: float = 0.6,
    seed: int = 0,
) -> Workload:
    """One shared prefix (a "system prompt") of prefix_len tokens, then 4..16 tokens unique
    to each prompt; every request generates exactly max_output_len tokens. With prefix
    caching the prefix's full KV blocks are computed once instead of num_seqs times."""
    _check(
        vocab_size,
        num_seqs=num_seqs,
        prefix_len=prefix_len,
        max_suffix_len=max_suffix_len,
        max_output_len=max_output_len,
    )
    rng = random.Random(seed)
    prefix = _ids(rng, prefix_len, vocab_size - 1)
    min_suffix = min(min_suffix_len, max_suffix_len)
    prompts = [
        prefix + _ids(rng, rng.randint(min_suffix, max_suffix_len), vocab_size - 1)
        for _ in range(num_seqs)
    ]
    params = [_sampling(max_output_len, temperature) for _ in range(num_seqs)]
    return prompts, params


def long_prompts(
    vocab_size: int,
    *,
    num_seqs: int = 64,
    num_long: int = 4,
    max_input_len: int = 3072,
    min_short_len: int = 16,
    max_short_len: int = 128,
    min_output_len: int = 32,
    max_output_len: int = 128,
    temperature: float = 0.6,
    seed: int = 0,
) -> Workload:
    """num_long prompts of exactly max_input_len tokens, spread evenly among num_seqs - num_long
    short ones (min_short_len..max_short_len tokens). Without chunked prefill, each long
    prompt is one huge step that stalls every running decode; with it, the prompt is split
    across steps (set the engine option max_num_batched_tokens below max_input_len to see it).
    The defaults fit the engines' default max_model_len (4096)."""
    _check(
        vocab_size,
        num_seqs=num_seqs,
        max_input_len=max_input_len,
        max_output_len=max_output_len,
        min_short_len=min_short_len,
        min_output_len=min_output_len,
    )
    if not 0 <= num_long <= num_seqs:
        raise ValueError(f"num_long must be in [0, num_seqs={num_seqs}], got {num_long}")
    rng = random.Random(seed)
    long_at = {i * num_seqs // num_long for i in range(num_long)} if num_long else set()
    max_short = min(max_short_len, max_input_len)
    min_short, min_out = min(min_short_len, max_short), min(min_output_len, max_output_len)
    lengths = [
        max_input_len if i in long_at else rng.randint(min_short, max_short)
        for i in range(num_seqs)
    ]
    prompts = [_ids(rng, n, vocab_size - 1) for n in lengths]
    params = [_sampling(rng.randint(min_out, max_output_len), temperature) for _ in range(num_seqs)]
    return prompts, params


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "nanovllm": nanovllm,
    "tiny-cpu": tiny_cpu,
    "shared-prefix": shared_prefix,
    "long-prompts": long_prompts,
}


def get(name: str) -> Callable[..., Workload]:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; workloads are: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


def parameters(name: str) -> dict:
    """The workload's keyword parameters and their defaults (vocab_size excluded)."""
    signature = inspect.signature(get(name))
    return {p.name: p.default for p in signature.parameters.values() if p.kind is p.KEYWORD_ONLY}


def resolve_params(name: str, **overrides) -> dict:
    """Defaults merged with overrides; an unknown parameter is a clear ValueError."""
    known = parameters(name)
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise ValueError(
            f"workload {name!r} has no parameter(s) {unknown}; its parameters are: {', '.join(known)}"
        )
    return known | overrides


def make_workload(name: str, vocab_size: int, **overrides) -> Workload:
    """Build workload `name` for a model with `vocab_size` tokens."""
    return get(name)(vocab_size, **resolve_params(name, **overrides))
