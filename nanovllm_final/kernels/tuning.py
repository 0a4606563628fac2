"""Every kernel's tile choices, per GPU: the one owner of launch parameters.

A device's choices come from `configs/<device name>.json` (the name torch gives, each run of
characters other than letters and digits made one `_`: "NVIDIA H200" -> NVIDIA_H200.json),
written by `python -m nanovllm_final.tune` on that card, or from `rules` on the card's
properties when there is no file. One log line says which. The file is keyed by kernel, then
by shape, as vLLM keys its fused-MoE configs; where a shape is a number (head_dim, token-expert
pairs), an entry serves every size up to its key (the largest key serves the rest):

    decode_attention.{bf16,fp8}.<head_dim>  BLOCK_N, num_warps, num_stages, programs_per_sm
    decode_splits                           waves, max_splits
    prefill_attention.<head_dim>            BLOCK_M, BLOCK_N, num_warps, num_stages
    gemv.{linear,gate_up,down}              rows, dot_rows; loop: BLOCK_N, BLOCK_K, num_warps;
                                            dot: BLOCK_N, BLOCK_K, num_warps, num_stages[, SPLIT_K]
    moe                                     small_pairs; gemv: BLOCK_N, BLOCK_K, num_warps, DOWN_BLOCK_N,
                                            DOWN_BLOCK_K; grouped.<pairs>: BLOCK_N, BLOCK_K, num_warps, num_stages

`record` holds how the file was made and why each choice is what it is. NANOVLLM_KERNEL_CONFIG
names a file to use instead of the device's (one card's choices on another, to compare)."""

import contextlib
import copy
import functools
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..log import log_once

logger = logging.getLogger(__name__)
CONFIG_DIR = Path(__file__).parent / "configs"
ENV = "NANOVLLM_KERNEL_CONFIG"

_DECODE = ("BLOCK_N", "num_warps", "num_stages", "programs_per_sm")
_PREFILL = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
_GEMV = ("BLOCK_N", "BLOCK_K", "num_warps")
_GROUPED = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
# the few-row tensor-core product's; SPLIT_K (optional, "?"): gemv.split_k's, 1 when absent
_DOT = (*_GROUPED, "SPLIT_K?")
# a projection kind's few-row kernels: the row loop up to `rows` rows, the tensor-core product
# up to `dot_rows`, cuBLAS past both
_FEW_ROWS = {"rows": None, "dot_rows": None, "loop": _GEMV, "dot": _DOT}
GEMV_KINDS = ("linear", "gate_up", "down")
# The file's layout: a tuple names an entry's fields; "*" a table keyed by shape (a number).
SCHEMA = {
    "decode_attention": {"bf16": {"*": _DECODE}, "fp8": {"*": _DECODE}},
    "decode_splits": ("waves", "max_splits"),
    "prefill_attention": {"*": _PREFILL},
    "gemv": {kind: _FEW_ROWS for kind in GEMV_KINDS},
    "moe": {
        "small_pairs": None,
        "gemv": (*_GEMV, "DOWN_BLOCK_N", "DOWN_BLOCK_K"),
        "grouped": {"*": _GROUPED},
    },
}


@dataclass(frozen=True)
class Device:
    """What the rules read of a device (a CPU reads as one small SM)."""

    name: str
    sms: int
    shared_memory: int  # bytes a program may use
    capability: tuple[int, int]
    l2: int  # bytes

    def __str__(self) -> str:
        return (
            f"{self.sms} SMs, {self.shared_memory // 1024} KiB shared memory, compute capability "
            f"{self.capability[0]}.{self.capability[1]}, {self.l2 // 2**20} MiB L2"
        )


def describe(device: torch.device) -> Device:
    if device.type != "cuda":
        return Device("cpu", 1, 64 * 1024, (0, 0), 0)
    return _cuda_device(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_device(index: int) -> Device:
    p = torch.cuda.get_device_properties(index)
    smem = getattr(p, "shared_memory_per_block_optin", 48 * 1024)
    return Device(
        p.name, p.multi_processor_count, smem, (p.major, p.minor), getattr(p, "L2_cache_size", 0)
    )


def file_name(device_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json"


def rules(dev: Device) -> dict:
    """Choices for a device without a file. On a GPU, the tiles measured on Hopper cards, with
    fewer pipeline stages where shared memory is under 128 KiB (Ampere and Ada consumer cards);
    the programs an SM runs at once follow from a program's registers (an fp8 decode program:
    2 warps of 168 registers, 6 to a 64K-register SM). On a CPU (the Triton interpreter), small
    tiles: every loop of a kernel runs more than once on a test's shapes, and programs stay cheap."""
    if dev.name == "cpu":
        return _cpu_rules()
    stages = 3 if dev.shared_memory >= 128 * 1024 else 2
    decode = {
        "bf16": {"64": _tiles(_DECODE, 128, 4, 2, 2), "128": _tiles(_DECODE, 64, 2, stages, 2)},
        "fp8": {"128": _tiles(_DECODE, 64, 2, 2, 6)},
    }
    dot = _tiles(_GROUPED, 32, 128, 4, stages)
    return {
        "decode_attention": decode,
        "decode_splits": {"waves": 2, "max_splits": 32},
        "prefill_attention": {"128": _tiles(_PREFILL, 64, 64, 4, 2)},
        "gemv": {  # the tensor-core product untimed here: cuBLAS past the row loop
            "linear": _few_rows(2, 0, _tiles(_GEMV, 2, 1024, 2), dot),
            "gate_up": _few_rows(2, 0, _tiles(_GEMV, 1, 1024, 2), dot),
            "down": _few_rows(2, 0, _tiles(_GEMV, 2, 4096, 4), dot),
        },
        "moe": {
            "small_pairs": 64,
            "gemv": {**_tiles(_GEMV, 4, 1024, 4), "DOWN_BLOCK_N": 2, "DOWN_BLOCK_K": 256},
            "grouped": {
                "2048": _tiles(_GROUPED, 64, 128, 4, stages),
                "8192": _tiles(_GROUPED, 64, 64, 4, stages),
                "65536": _tiles(_GROUPED, 128, 64, 4, stages),
            },
        },
    }


def _cpu_rules() -> dict:
    decode = _tiles(_DECODE, 32, 1, 1, 1)
    dot = _tiles(_GROUPED, 16, 32, 1, 1)
    return {
        "decode_attention": {"bf16": {"128": decode}, "fp8": {"128": decode}},
        "decode_splits": {"waves": 2, "max_splits": 32},
        "prefill_attention": {"128": _tiles(_PREFILL, 32, 32, 1, 1)},
        "gemv": {
            "linear": _few_rows(2, 0, _tiles(_GEMV, 16, 32, 1), dot),
            "gate_up": _few_rows(2, 0, _tiles(_GEMV, 16, 32, 1), dot),
            "down": _few_rows(2, 0, _tiles(_GEMV, 16, 16, 1), dot),
        },
        "moe": {
            "small_pairs": 64,
            "gemv": {**_tiles(_GEMV, 16, 32, 1), "DOWN_BLOCK_N": 32, "DOWN_BLOCK_K": 32},
            "grouped": {"65536": _tiles(_GROUPED, 16, 16, 1, 1)},
        },
    }


def _few_rows(rows: int, dot_rows: int, loop: dict, dot: dict) -> dict:
    return {"rows": rows, "dot_rows": dot_rows, "loop": loop, "dot": dict(dot)}


def _tiles(fields: tuple, *values: int) -> dict:
    return dict(zip(fields, values, strict=True))


def check(config: dict, source: str) -> dict:
    """config if it has every field SCHEMA names, each a positive integer; else a ValueError
    naming the file and the field."""
    _check(config, SCHEMA, source, "")
    return config


def _check(value, schema, source: str, at: str) -> None:
    where = at or "the top level"
    if schema is None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(
                f"kernel config {source}: {at} must be a non-negative integer, got {value!r}"
            )
        return
    if not isinstance(value, dict):
        raise ValueError(f"kernel config {source}: {where} must be an object, got {value!r}")
    if isinstance(schema, tuple):
        schema = dict.fromkeys(schema)
    for key in [key for key in schema if key.endswith("?")]:  # optional: checked if present
        schema = {k: v for k, v in schema.items() if k != key}
        if key[:-1] in value:
            schema[key[:-1]] = None
    if "*" in schema:
        if not value or not all(key.isdigit() for key in value):
            raise ValueError(
                f"kernel config {source}: {where} must map sizes (digits) to entries, got {list(value)}"
            )
        for key, entry in value.items():
            _check(entry, schema["*"], source, f"{at}.{key}")
        return
    for key, sub in schema.items():
        if key not in value:
            raise ValueError(f"kernel config {source}: {where} lacks {key!r}")
        _check(value[key], sub, source, f"{at}.{key}".lstrip("."))


def load(path: Path | str) -> dict:
    path = Path(path)
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"kernel config {path}: not valid JSON ({exc})") from None
    return check(config, str(path))


class Tuning:
    """One device's choices (`config`, in the file's layout) and where they came from (`source`)."""

    def __init__(self, config: dict, source: str):
        self.config, self.source = config, source

    def decode(self, fp8: bool, head_dim: int) -> dict:
        """BLOCK_N, num_warps, num_stages and programs_per_sm of the decode attention kernel."""
        return _by_size(self.config["decode_attention"]["fp8" if fp8 else "bf16"], head_dim)

    def decode_splits(self) -> dict:
        return self.config["decode_splits"]

    def prefill(self, head_dim: int) -> dict:
        return _by_size(self.config["prefill_attention"], head_dim)

    def gemv(self, kind: str) -> dict:
        """A projection kind's (linear, gate_up or down) few-row kernels: rows and dot_rows, the
        row loop's tiles (loop) and the tensor-core product's (dot)."""
        return self.config["gemv"][kind]

    def few_rows(self, kind: str) -> int:
        """The most rows a projection kind's few-row kernels take (the row loop, then the
        tensor-core product); cuBLAS takes more."""
        entry = self.config["gemv"][kind]
        return max(entry["rows"], entry["dot_rows"])

    def moe_grouped(self, pairs: int) -> dict:
        return _by_size(self.config["moe"]["grouped"], pairs)

    def moe_gemv(self) -> dict:
        return self.config["moe"]["gemv"]

    @property
    def moe_small_pairs(self) -> int:
        return self.config["moe"]["small_pairs"]


def fit_stages(tiles: dict, stage_bytes: int, device: torch.device) -> dict:
    """`tiles` with num_stages cut to what the device's shared memory holds: a Triton pipeline of
    num_stages keeps num_stages - 1 stages of `stage_bytes` each in shared memory (a file's tiles
    were timed in bfloat16; float32 operands take twice the bytes)."""
    fits = 1 + describe(device).shared_memory // stage_bytes
    return tiles if tiles["num_stages"] <= fits else {**tiles, "num_stages": max(1, fits)}


def _by_size(table: dict, size: int) -> dict:
    """The entry of the smallest key >= size, else of the largest key."""
    keys = sorted(int(key) for key in table)
    return table[str(next((key for key in keys if key >= size), keys[-1]))]


_OVERRIDES: list[dict] = []


def for_device(device: torch.device) -> Tuning:
    """The device's choices (logged once per device), with any `override` in force on top."""
    tuning = _for(
        device.type,
        device.index
        if device.type != "cuda" or device.index is not None
        else torch.cuda.current_device(),
    )
    for changes in _OVERRIDES:
        tuning = Tuning(_merged(tuning.config, changes), tuning.source + " (overridden)")
    return tuning


@functools.cache
def _for(kind: str, index: int | None) -> Tuning:
    return choose(describe(torch.device(kind, index) if kind == "cuda" else torch.device(kind)))


def choose(dev: Device) -> Tuning:
    """A GPU's file (NANOVLLM_KERNEL_CONFIG's, or configs/<its name>.json) if there is one, else the
    rules on its properties; which, one log line says (once per device and source)."""
    if dev.name == "cpu":
        return Tuning(check(rules(dev), "rules"), "rules for a CPU")
    path = Path(os.environ[ENV]) if os.environ.get(ENV) else CONFIG_DIR / file_name(dev.name)
    if path.exists():
        tuning = Tuning(load(path), f"file {path}")
    else:
        tuning = Tuning(check(rules(dev), "rules"), f"no file {path.name}, rules from {dev}")
    log_once(logger, logging.INFO, f"kernel tuning for {dev.name}: {tuning.source}")
    return tuning


@contextlib.contextmanager
def override(changes: dict):
    """Within the block, `changes` (a part of the file's layout, e.g. {"gemv": {"rows": 4}})
    replace the device's choices: for a benchmark that measures one choice against another."""
    _OVERRIDES.append(changes)
    try:
        yield
    finally:
        _OVERRIDES.remove(changes)


def _merged(base: dict, changes: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in changes.items():
        out[key] = _merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out
