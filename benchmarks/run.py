"""Time engines on a workload and write one JSON record per engine.

    python -m benchmarks.run --engine 03_paged --engine final --workload nanovllm \\
        --shape qwen3-0.6b --device cuda --out benchmarks/results/nanovllm_qwen3-0.6b_03_h200.json
    python -m benchmarks.run --engine 02_kvcache --workload tiny-cpu --shape tiny-qwen3

For each engine: load it, run a short warm-up generate, then time one
`llm.generate(prompts, sampling_params)` over the whole workload (with
torch.cuda.synchronize() on both sides on CUDA). Throughput is output tokens / wall
time, as in nano-vllm's bench.py. See benchmarks/README.md for the JSON schema.
"""

import argparse
import contextlib
import datetime
import gc
import importlib
import importlib.metadata
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # repo root, also for `python benchmarks/run.py`

# Triton kernels run in the interpreter without a GPU; this must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import stages  # noqa: E402
from benchmarks import workloads  # noqa: E402
from benchmarks.limits import measure_peaks, workload_limit  # noqa: E402
from benchmarks.results import HEADER, summary_row  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MAX_MODEL_LEN = 4096  # EngineConfig.max_model_len's default
FINAL_NAMES = ("final", "nanovllm_final")
HF_NAMES = ("hf", "transformers")
WARMUP_LENGTHS = (16, 32)  # prompt lengths of the two warm-up requests
WARMUP_MAX_TOKENS = 8
SUMMED_STATS = (
    "preemptions",
    "recomputed_tokens",
    "prefix_hit_tokens",
)  # per-step keys some stages record


class UsageError(ValueError):
    """A problem with the command line: reported as `error: ...`, exit code 2."""


# ---- command line ----


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--engine",
        action="append",
        required=True,
        help="a stage (03_paged, paged or 3), 'final', or 'hf' (Hugging Face transformers' "
        "continuous batching); repeat to run several in turn",
    )
    parser.add_argument("--workload", default="nanovllm", choices=tuple(workloads.WORKLOADS))
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", type=Path, help="a Hugging Face model directory")
    model.add_argument(
        "--shape",
        choices=tuple(SHAPES),
        help="random weights of this shape, built once into .models/<shape>",
    )
    parser.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--dtype", help="float32, float16 or bfloat16 (default: the engine's)")
    parser.add_argument("--num-seqs", type=int, help="workload parameter num_seqs")
    parser.add_argument("--max-input-len", type=int, help="workload parameter max_input_len")
    parser.add_argument("--max-output-len", type=int, help="workload parameter max_output_len")
    parser.add_argument("--seed", type=int, help="workload seed (default: the workload's, 0)")
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other workload parameter, e.g. prefix_len=256 (repeatable)",
    )
    parser.add_argument(
        "--sampling",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a SamplingParams field for every request, e.g. top_k=0 top_p=1.0 (the final engine "
        "otherwise takes top-k/top-p from generation_config.json; nano-vllm samples with temperature only)",
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine option, e.g. max_num_seqs=64 or enforce_eager=true (repeatable)",
    )
    parser.add_argument(
        "--threads", type=int, help="torch CPU threads (torch.set_num_threads); default: torch's"
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="after the timed generate, run the workload again under torch.profiler (a window of "
        "steps out of every 50) and record per-step host, GPU and sampling time",
    )
    parser.add_argument(
        "--out", help="write the JSON here ('-' for stdout); a list if several engines"
    )
    args = parser.parse_args(argv)
    args.error = parser.error
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def parse_value(text: str):
    """'64' -> 64, '0.9' -> 0.9, 'true' -> True, 'none' -> None, anything else stays a string."""
    words = {"true": True, "false": False, "none": None, "null": None}
    if text.lower() in words:
        return words[text.lower()]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_pairs(pairs: list[str], what: str) -> dict:
    result = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"{what} {pair!r} is not KEY=VALUE")
        result[key.strip().replace("-", "_")] = parse_value(value.strip())
    return result


# ---- engines ----


def resolve_engine(name: str) -> tuple[str, ModuleType]:
    """('03_paged', module) for '03_paged', 'paged' or '3'; ('final', nanovllm_final) for 'final';
    ('hf', None) for Hugging Face transformers' continuous batching."""
    if name in HF_NAMES:
        return "hf", None
    if name in FINAL_NAMES:
        try:
            module = importlib.import_module("nanovllm_final")
        except ImportError as err:
            raise UsageError(f"engine 'final' is not available: {err}") from err
        if not hasattr(module, "LLM"):
            raise UsageError("engine 'final' is not available: nanovllm_final has no LLM yet")
        return "final", module
    try:
        module = stages.load(int(name) if name.isdigit() else name)
    except ValueError as err:
        raise UsageError(
            f"unknown engine {name!r}; engines are: {', '.join([*stages.names(), 'final'])}"
        ) from err
    except ImportError as err:
        raise UsageError(f"engine {name!r} could not be imported: {err}") from err
    return module.__name__.rsplit(".", 1)[-1], module


def ladder_level(engine: str) -> int:
    """1 for 01_naive ... 7 for 07_tensor_parallel; 8 for the final engine; 0 for Hugging Face."""
    levels = {"final": 8, "hf": 0}
    return levels[engine] if engine in levels else int(engine[:2])


# ---- models ----


def _shapes() -> dict[str, dict]:
    from tools.tiny_model import FULL_SHAPES

    # The same arguments as the notebooks' cached_model("tiny-qwen3", arch="qwen3"), so that
    # both share one build instead of rebuilding each other's.
    tiny = {"tiny-qwen3": {"arch": "qwen3"}, "tiny-llama": {"arch": "llama"}}
    return tiny | {shape: {"shape": shape} for shape in FULL_SHAPES}


SHAPES = _shapes()


def model_for_shape(shape: str, device: str) -> Path:
    """The cached random-weight model of this shape; full shapes are drawn on the GPU when
    the run is on one (minutes on CPU, seconds on CUDA)."""
    from tools.tiny_model import cached_model

    kwargs = dict(SHAPES[shape])
    if "shape" in kwargs and device.startswith("cuda"):
        kwargs["device"] = "cuda"
    with contextlib.redirect_stdout(
        sys.stderr
    ):  # the factory's progress lines; stdout may carry JSON
        return cached_model(shape, **kwargs)


def read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.exists():
        raise UsageError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    return json.loads(path.read_text())


def count_parameters(model_dir: Path) -> int | None:
    """Parameters in the safetensors files, from their headers only."""
    from safetensors import safe_open

    total = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total or None


def model_info(model_dir: Path, config: dict, shape: str | None) -> dict:
    heads = config.get("num_attention_heads")
    return {
        "path": str(model_dir),
        "shape": shape,
        "architecture": (config.get("architectures") or ["?"])[0],
        "model_type": config.get("model_type"),
        "hidden_size": config.get("hidden_size"),
        "intermediate_size": config.get("intermediate_size"),
        "num_hidden_layers": config.get("num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or (config["hidden_size"] // heads if heads else None),
        "vocab_size": config.get("vocab_size"),
        "max_position_embeddings": config.get("max_position_embeddings"),
        "tie_word_embeddings": config.get("tie_word_embeddings", False),
        "dtype": config.get("torch_dtype") or config.get("dtype"),  # the checkpoint's
        "num_parameters": count_parameters(model_dir),
    }


def effective_dtype(options: dict, config: dict) -> str:
    """The dtype the engines compute in: the option, else the checkpoint's on CUDA, float32 on CPU."""
    if options.get("dtype"):
        return str(options["dtype"]).removeprefix("torch.")
    if options["device"].startswith("cuda"):
        return config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    return "float32"


def check_lengths(
    prompts: list[list[int]], params: list[dict], options: dict, config: dict
) -> None:
    """Every request must fit in max_model_len, or the engines would cut it short."""
    limit = min(
        options.get("max_model_len", DEFAULT_MAX_MODEL_LEN),
        config.get("max_position_embeddings", math.inf),
    )
    need = max((len(p) + sp["max_tokens"] for p, sp in zip(prompts, params)), default=0)
    if need > limit:
        raise UsageError(
            f"the workload has requests of up to {need} tokens (prompt + max_tokens) but max_model_len is {limit} "
            f"(the model's max_position_embeddings is {config.get('max_position_embeddings')}); "
            "lower --max-input-len / --max-output-len, or raise --option max_model_len=N"
        )


# ---- environment ----


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def command_line(module: str, argv: list[str]) -> str:
    """The command that made a record: the engine's environment switches (NANOVLLM_*) as its
    prefix, then python -m `module` and its arguments."""
    switches = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("NANOVLLM_")]
    return shlex.join(switches + ["python", "-m", module, *argv])


def versions() -> dict:
    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": version("triton"),
        "transformers": version("transformers"),
        "flash_attn": version("flash-attn") or version("flash_attn"),
    }


def git_commit() -> dict:
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"git_commit": commit, "git_dirty": None if dirty is None else bool(dirty)}


# ---- one run ----


def summarize_stats(steps: list[dict]) -> dict:
    """A few numbers from llm.stats, the engine's per-step records, of the timed generate."""

    def values(key: str) -> list:
        return [s[key] for s in steps if isinstance(s.get(key), (int, float))]

    tokens, seqs = values("num_tokens"), values("num_seqs")
    summary = {
        "num_steps": len(steps),
        "max_tokens_per_step": max(tokens, default=None),
        "mean_tokens_per_step": sum(tokens) / len(tokens) if tokens else None,
        "max_seqs_per_step": max(seqs, default=None),
        "step_seconds": sum(values("seconds")) if values("seconds") else None,
        "keys": sorted({key for s in steps for key in s}),
    }
    for key in SUMMED_STATS:  # per-step counts, summed over the run
        if any(key in s for s in steps):
            summary[key] = sum(values(key))
    if any("is_prefill" in s for s in steps):
        summary["prefill_steps"] = sum(1 for s in steps if s.get("is_prefill"))
        for kind, is_prefill in (("prefill", True), ("decode", False)):
            secs = [
                s["seconds"]
                for s in steps
                if bool(s.get("is_prefill")) == is_prefill and "seconds" in s
            ]
            summary[f"{kind}_step_ms_mean"] = 1e3 * sum(secs) / len(secs) if secs else None
        by_batch: dict[
            int, list[float]
        ] = {}  # decode steps by their num_seqs: a step time at one batch size
        for s in steps:
            if not s.get("is_prefill") and "seconds" in s and isinstance(s.get("num_seqs"), int):
                by_batch.setdefault(s["num_seqs"], []).append(s["seconds"])
        summary["decode_steps_by_num_seqs"] = {
            str(n): {"steps": len(secs), "ms_mean": 1e3 * sum(secs) / len(secs)}
            for n, secs in sorted(by_batch.items())
        }
    if any("blocks_used" in s for s in steps):
        summary["max_blocks_used"] = max(values("blocks_used"), default=None)
    return summary


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def warmup_prompts(vocab_size: int) -> list[list[int]]:
    return [[(3 + i) % vocab_size for i in range(n)] for n in WARMUP_LENGTHS]


def timed_generate(
    llm,
    module: ModuleType,
    prompts: list[list[int]],
    params: list[dict],
    device: str,
    vocab_size: int,
) -> dict:
    """Warm up, then time generate over the workload; returns the measured fields."""
    warm = module.SamplingParams(temperature=0.6, max_tokens=WARMUP_MAX_TOKENS, ignore_eos=True)
    llm.generate(warmup_prompts(vocab_size), warm, use_tqdm=False)
    sampling = [module.SamplingParams(**p) for p in params]
    try:
        llm.stats.clear()  # keep only the timed generate's steps
    except AttributeError:
        pass
    before = len(llm.stats)
    synchronize(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, sampling, use_tqdm=False)
    synchronize(device)
    seconds = time.perf_counter() - start
    steps = list(llm.stats)
    steps = steps[before:] if len(steps) > before else steps
    return {"outputs": outs, "seconds": seconds, "stats": summarize_stats(steps)}


def run_engine(module: ModuleType | None, setup: dict, breakdown: bool = False) -> dict:
    """Load one engine, time it, free it; returns the measured part of the record."""
    if module is None:
        return run_hf(setup)
    options, prompts, params = setup["options"], setup["prompts"], setup["params"]
    device = options["device"]
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    llm = module.LLM(str(setup["model_dir"]), **options)
    load_seconds = time.perf_counter() - start
    after_load = memory_now(device, llm)
    try:
        measured = timed_generate(
            llm, module, prompts, params, device, setup["config"]["vocab_size"]
        )
        if breakdown:
            try:
                measured["breakdown"] = step_breakdown(
                    llm, module, prompts, params, measured["stats"]
                )
            except Exception as err:  # the timed numbers stand without it
                traceback.print_exc()
                measured["breakdown"] = {"error": f"{type(err).__name__}: {err}"}
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    outputs, seconds = measured["outputs"], measured["seconds"]
    input_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(o["token_ids"]) for o in outputs)
    return {
        "num_seqs": len(prompts),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "requested_output_tokens": sum(p["max_tokens"] for p in params),
        "seconds": seconds,
        "output_tokens_per_s": output_tokens / seconds,
        "total_tokens_per_s": (input_tokens + output_tokens) / seconds,
        "load_seconds": load_seconds,
        "peak_memory": peak_memory(device),
        "memory_after_load": after_load,
        "stats": measured["stats"],
    } | ({"breakdown": measured["breakdown"]} if "breakdown" in measured else {})


def step_breakdown(
    llm, module: ModuleType, prompts: list[list[int]], params: list[dict], stats: dict
) -> dict:
    """The workload once more, under torch.profiler for 5 steps out of every 50 or so
    (benchmarks/profiling.py): per kind of step, the GPU busy time, the sampler's GPU time
    and the kernels that take the most. `host_ms` is the timed run's mean step time minus
    that GPU time: what the host adds while the GPU waits (engines that sync every step)."""
    from benchmarks.profiling import profile_generate

    every = max(7, min(50, stats["num_steps"] // 4))  # a few windows even in short runs
    report = profile_generate(
        llm,
        prompts,
        [module.SamplingParams(**p) for p in params],
        every=every,
        active=min(5, every - 2),
    )
    out = {"profiled_steps": report["profiled_steps"], "top_kernels": report["top_kernels"]}
    for kind, s in report["summary"].items():
        step_ms = stats.get(f"{kind}_step_ms_mean")
        out[kind] = {
            "profiled_steps": s["steps"],
            "step_ms": step_ms,
            "gpu_ms": s["mean_gpu_ms"],
            "sampling_gpu_ms": s["mean_sampling_ms"],
            "kernels": s["mean_kernels"],
            "host_ms": None if step_ms is None else max(0.0, step_ms - s["mean_gpu_ms"]),
            "profiled_wall_ms": s["mean_wall_ms"],
        }
    return out


# ---- Hugging Face transformers, continuous batching ----


def hf_generate(
    manager, prompts: list[list[int]], max_tokens: list[int], tag: str, timeout: float = 600.0
) -> list[list[int]]:
    """Submit every request to a running ContinuousBatchingManager and wait for all of them."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt, n in zip(ids, prompts, max_tokens):
        manager.add_request(input_ids=prompt, request_id=request_id, max_new_tokens=n)
    results = {}
    while len(results) < len(ids):
        result = manager.get_result(timeout=timeout)
        if result is None:
            raise RuntimeError(
                f"transformers' continuous batching returned nothing for {timeout:.0f} s "
                f"(running: {manager.is_running()})"
            )
        if result.is_finished():
            if getattr(result, "error", None):
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            results[result.request_id] = result.generated_tokens
    return [list(results[i]) for i in ids]


def run_hf(setup: dict) -> dict:
    """Hugging Face transformers' continuous batching (`init_continuous_batching`, the
    machinery of `generate_batch`) on the same requests: sampling at the workload's
    temperature with no top-k/top-p, no EOS (max_new_tokens per request), warmed up first."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    options, prompts, params = setup["options"], setup["prompts"], setup["params"]
    device = options["device"]
    temperatures = {p.get("temperature", 1.0) for p in params}
    if len(temperatures) != 1:
        raise UsageError("the hf engine needs one temperature for every request")
    temperature = temperatures.pop()
    dtype = getattr(torch, effective_dtype(options, setup["config"]))
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(setup["model_dir"], dtype=dtype).to(device).eval()
    sampling = (
        dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        if temperature > 0
        else dict(do_sample=False)
    )
    config = GenerationConfig(
        **sampling, max_new_tokens=max(p["max_tokens"] for p in params), pad_token_id=0
    )
    manager = model.init_continuous_batching(generation_config=config)  # eos_token_id None: no EOS
    manager.start()
    try:
        warm = warmup_prompts(setup["config"]["vocab_size"])
        hf_generate(manager, warm, [WARMUP_MAX_TOKENS] * len(warm), "warmup")
        load_seconds = time.perf_counter() - start
        synchronize(device)
        start = time.perf_counter()
        outputs = hf_generate(manager, prompts, [p["max_tokens"] for p in params], "timed")
        synchronize(device)
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True)
        if hasattr(model, "destroy_cached_continuous_batching_manager"):
            model.destroy_cached_continuous_batching_manager()
        del model, manager
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    input_tokens, output_tokens = sum(len(p) for p in prompts), sum(len(o) for o in outputs)
    return {
        "num_seqs": len(prompts),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "requested_output_tokens": sum(p["max_tokens"] for p in params),
        "seconds": seconds,
        "output_tokens_per_s": output_tokens / seconds,
        "total_tokens_per_s": (input_tokens + output_tokens) / seconds,
        "load_seconds": load_seconds,
        "peak_memory": peak_memory(device),
        "stats": None,
    }


def memory_now(device: str, llm) -> dict | None:
    """CUDA memory once the engine is loaded (weights, KV cache, CUDA graphs): device-wide use
    (what `gpu_memory_utilization` bounds, with nothing else on the GPU) and the KV cache's share."""
    if not device.startswith("cuda"):
        return None
    index = torch.device(device).index
    free, total = torch.cuda.mem_get_info(index)
    runner = getattr(getattr(llm, "engine", None), "model_runner", None)
    kv = getattr(runner, "kv_cache", None)
    return {
        "device_used_bytes": total - free,
        "device_total_bytes": total,
        "used_fraction": (total - free) / total,
        "allocated_bytes": torch.cuda.memory_allocated(index),
        "reserved_bytes": torch.cuda.memory_reserved(index),
        "kv_cache_bytes": kv.numel() * kv.element_size() if isinstance(kv, torch.Tensor) else None,
        "num_kvcache_blocks": getattr(runner, "num_kvcache_blocks", None),
    }


def peak_memory(device: str) -> dict | None:
    """CUDA memory high-water marks since the engine was loaded (this process only)."""
    if not device.startswith("cuda"):
        return None
    index = torch.device(device).index
    return {
        "allocated_bytes": torch.cuda.max_memory_allocated(index),
        "reserved_bytes": torch.cuda.max_memory_reserved(index),
        "device_total_bytes": torch.cuda.get_device_properties(index or 0).total_memory,
    }


# ---- main ----


def prepare(args: argparse.Namespace) -> dict:
    """Everything shared by the runs, checked before any engine is loaded."""
    engines = [resolve_engine(name) for name in args.engine]
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    options = {"device": args.device or ("cuda" if torch.cuda.is_available() else "cpu")}
    if args.dtype:
        options["dtype"] = args.dtype
    options |= parse_pairs(args.option, "--option")
    if options["device"].startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(
            f"device {options['device']!r} was asked for, but CUDA is not available here"
        )
    model_dir = args.model if args.model else model_for_shape(args.shape, options["device"])
    config = read_config(model_dir)
    overrides = {
        "num_seqs": args.num_seqs,
        "max_input_len": args.max_input_len,
        "max_output_len": args.max_output_len,
        "seed": args.seed,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None} | parse_pairs(
        args.param, "--param"
    )
    try:
        workload_params = workloads.resolve_params(args.workload, **overrides)
        prompts, params = workloads.get(args.workload)(config["vocab_size"], **workload_params)
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from err
    sampling = parse_pairs(args.sampling, "--sampling")
    params = [p | sampling for p in params]
    check_lengths(prompts, params, options, config)
    return {
        "engines": engines,
        "options": options,
        "model_dir": model_dir,
        "config": config,
        "prompts": prompts,
        "params": params,
        "workload": {
            "name": args.workload,
            "params": workload_params,
            "vocab_size": config["vocab_size"],
        }
        | ({"sampling": sampling} if sampling else {}),
    }


def base_record(engine: str, setup: dict, args: argparse.Namespace) -> dict:
    options = setup["options"]
    return {
        "engine": engine,
        "stage": ladder_level(engine),
        "device": options["device"].split(":")[0],
        "device_name": device_name(options["device"]),
        "device_count": torch.cuda.device_count()
        if options["device"].startswith("cuda")
        else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "model": model_info(setup["model_dir"], setup["config"], args.shape),
        "dtype": effective_dtype(options, setup["config"]),
        "workload": setup["workload"],
        "engine_options": options,
        "versions": versions(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **git_commit(),
        "command": command_line("benchmarks.run", args.argv),
        "hostname": platform.node(),
        "load_average": os.getloadavg()[0]
        if hasattr(os, "getloadavg")
        else None,  # busy machine: noisy CPU numbers
    }


def write_json(records: list[dict], out: str) -> None:
    data = records[0] if len(records) == 1 else records
    text = json.dumps(data, indent=2) + "\n"
    if out == "-":
        sys.stdout.write(text)
        return
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Returns 0 if every engine ran, 1 if one failed; exits 2 on a usage error."""
    args = parse_args(argv)
    try:
        setup = prepare(args)
    except UsageError as err:
        args.error(str(err))  # prints usage and `error: ...`, exits with code 2
    log = sys.stderr if args.out == "-" else sys.stdout
    print(HEADER, file=log, flush=True)
    records = []
    peaks = (
        measure_peaks(setup["options"]["device"])
        if setup["options"]["device"].startswith("cuda")
        else None
    )
    for engine, module in setup["engines"]:
        record = base_record(engine, setup, args) | ({"device_peaks": peaks} if peaks else {})
        try:
            record |= run_engine(module, setup, args.breakdown)
        except Exception as err:  # one engine failing (e.g. out of memory) must not lose the others
            traceback.print_exc()
            record["error"] = f"{type(err).__name__}: {err}"
        records.append(record)
        print(summary_row(record), file=log, flush=True)
        if (
            "error" not in record and record["device"] == "cuda"
        ):  # how far from what the GPU allows (benchmarks/limits.py)
            record["limit"] = workload_limit(record)
            print(
                f"{record['engine']}: {record['output_tokens_per_s'] / record['limit']['output_tokens_per_s']:.0%} of this workload's "
                f"limit on this GPU, {record['limit']['output_tokens_per_s']:,.0f} tok/s",
                file=log,
                flush=True,
            )
        if (
            args.out and args.out != "-"
        ):  # after every engine: a run cut short keeps what it measured
            write_json(records, args.out)
    hf = next((r for r in records if r["engine"] == "hf" and "error" not in r), None)
    if hf is not None:  # same requests, same process: the ratio is the comparison
        for r in records:
            if r is not hf and "error" not in r:
                r["vs_hf"] = r["output_tokens_per_s"] / hf["output_tokens_per_s"]
                print(
                    f"{r['engine']} / hf: {r['vs_hf']:.1f}x output tokens/s", file=log, flush=True
                )
    if args.out:
        write_json(records, args.out)
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
