"""The physical limit of a throughput record: how fast any engine could run its workload on
its GPU, from the bytes and FLOPs the workload cannot avoid.

    limit seconds = sum over decode steps of ( KV bytes of the step / bandwidth
                                               + max(weight bytes / bandwidth, GEMM FLOPs of the step / peak) )
                  + prefill FLOPs / peak

* A decode step t (1 <= t < the longest output) runs every request with more than t output
  tokens; each reads its in + t cached tokens, each token 2 (K and V) * layers * kv_heads *
  head_dim * bytes per value (1 for an fp8 cache).
* The step reads the weights once (all of them: at large batches nearly every expert of a MoE
  layer is hit), or, where the batch is large enough, does 2 FLOPs per active parameter per
  sequence: whichever takes longer on the device.
* Prefill: 2 FLOPs per active parameter per prompt token (a MoE token uses top_k experts).

Bandwidth and peak are the device's own: `measure_peaks` times a large copy and a large bf16
GEMM at the start of a run (benchmarks/run.py records them as `device_peaks`); records made
before that take KNOWN_PEAKS by device name. The workload is regenerated from the record (its
name, parameters and seed).
"""

from nanovllm_final.workloads import make_workload

# bytes/s a device-to-device copy reaches, dense bf16 FLOP/s a large GEMM reaches
KNOWN_PEAKS = {"NVIDIA H200": {"bandwidth": 4.3e12, "peak_flops": 790e12}}


def measure_peaks(
    device: str = "cuda", copy_bytes: int = 1 << 30, gemm_n: int = 8192, repeats: int = 20
) -> dict:
    """{"bandwidth", "peak_flops"} of this GPU: a copy of `copy_bytes` (each byte read and
    written) and a `gemm_n`-cubed bf16 matrix product, each timed over `repeats` runs after a warm-up."""
    import torch

    def seconds(fn) -> float:
        fn()
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / repeats

    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    bandwidth = 2 * copy_bytes / seconds(lambda: dst.copy_(src))
    src = dst = None  # freed before the GEMM's operands
    a = torch.randn(gemm_n, gemm_n, dtype=torch.bfloat16, device=device)
    b = torch.randn(gemm_n, gemm_n, dtype=torch.bfloat16, device=device)
    peak_flops = 2 * gemm_n**3 / seconds(lambda: a @ b)
    return {"bandwidth": bandwidth, "peak_flops": peak_flops}


def peaks_of(record: dict) -> dict:
    """The bandwidth and peak a record's limit is computed with: its own measurement, else KNOWN_PEAKS."""
    if record.get("device_peaks"):
        return record["device_peaks"]
    name = record.get("device_name")
    if name not in KNOWN_PEAKS:
        raise ValueError(
            f"no bandwidth or peak for device {name!r}: the record has no device_peaks and "
            f"benchmarks/limits.py KNOWN_PEAKS has no entry for it"
        )
    return KNOWN_PEAKS[name]


def _peaks(record: dict, bandwidth: float | None, peak_flops: float | None) -> tuple[float, float]:
    peaks = peaks_of(record) if bandwidth is None or peak_flops is None else {}
    return bandwidth or peaks["bandwidth"], peak_flops or peaks["peak_flops"]


def active_parameters(model: dict) -> float:
    """Parameters one token uses: all of a dense model's; a MoE model's without the experts it skips."""
    if "moe" not in model.get("model_type", ""):
        return model["num_parameters"]
    from tools.tiny_model import (
        build_config,  # the shape's MoE fields (records keep the dense ones)
    )

    cfg = build_config(arch=None, shape=model["shape"])
    experts = (
        cfg["num_hidden_layers"]
        * cfg["num_experts"]
        * 3
        * cfg["hidden_size"]
        * cfg["moe_intermediate_size"]
    )
    return model["num_parameters"] - experts * (1 - cfg["num_experts_per_tok"] / cfg["num_experts"])


def _requests(record: dict) -> tuple[list[int], list[int], int]:
    """A record's workload as (prompt lengths, output lengths, K/V bytes per cached token)."""
    model, workload = record["model"], record["workload"]
    prompts, sampling = make_workload(workload["name"], model["vocab_size"], **workload["params"])
    fp8 = str(record.get("engine_options", {}).get("kv_cache_dtype", "auto")).startswith("fp8")
    value_bytes = 1 if fp8 else {"float32": 4}.get(model["dtype"], 2)
    per_token = (
        2
        * model["num_hidden_layers"]
        * model["num_key_value_heads"]
        * model["head_dim"]
        * value_bytes
    )
    return [len(p) for p in prompts], [s["max_tokens"] for s in sampling], per_token


def _steps(
    record: dict, bandwidth: float, peak_flops: float
) -> list[tuple[int, float, float, bool]]:
    """(batch, K/V seconds, weights-or-GEMM seconds, GEMM-bound?) of each decode step at the limit."""
    ins, outs, per_token = _requests(record)
    model = record["model"]
    weights_s, flops_per_seq = model["num_parameters"] * 2 / bandwidth, 2 * active_parameters(model)
    steps = []
    for t in range(1, max(outs)):
        live = [i + t for i, o in zip(ins, outs) if o > t]
        gemm_s = flops_per_seq * len(live) / peak_flops
        steps.append(
            (
                len(live),
                sum(live) * per_token / bandwidth,
                max(weights_s, gemm_s),
                gemm_s > weights_s,
            )
        )
    return steps


def decode_step_limits(
    record: dict, bandwidth: float | None = None, peak_flops: float | None = None
) -> list[tuple[int, float]]:
    """(batch, seconds) of each decode step of the workload at its limit (the module's formula)."""
    bandwidth, peak_flops = _peaks(record, bandwidth, peak_flops)
    return [(batch, kv_s + w_s) for batch, kv_s, w_s, _ in _steps(record, bandwidth, peak_flops)]


def workload_limit(
    record: dict, bandwidth: float | None = None, peak_flops: float | None = None
) -> dict:
    """{"output_tokens_per_s", "kv_s", "weights_s", "prefill_s", "gemm_bound_steps", "decode_steps",
    "bandwidth", "peak_flops"} of a benchmarks/run.py record; bandwidth and peak default to the record's device's."""
    bandwidth, peak_flops = _peaks(record, bandwidth, peak_flops)
    steps = _steps(record, bandwidth, peak_flops)
    ins, outs, _ = _requests(record)
    kv_s, weights_s = sum(s[1] for s in steps), sum(s[2] for s in steps)
    prefill_s = 2 * active_parameters(record["model"]) * sum(ins) / peak_flops
    return {
        "output_tokens_per_s": sum(outs) / (kv_s + weights_s + prefill_s),
        "kv_s": kv_s,
        "weights_s": weights_s,
        "prefill_s": prefill_s,
        "gemm_bound_steps": sum(s[3] for s in steps),
        "decode_steps": len(steps),
        "bandwidth": bandwidth,
        "peak_flops": peak_flops,
    }
