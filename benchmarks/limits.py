"""The physical limit of a throughput record: how fast any engine could run its workload on
its GPU, from the bytes and FLOPs the workload cannot avoid.

    limit seconds = KV bytes the decode steps must read / bandwidth
                  + weights read once per decode step / bandwidth
                  + prefill FLOPs / peak FLOP/s

* KV bytes: a request of `in` prompt and `out` output tokens reads, over its decode steps,
  sum over t < out of (in + t) cached tokens: out * in + out^2 / 2 tokens, each
  2 (K and V) * layers * kv_heads * head_dim * bytes per value (1 for an fp8 cache).
* Weights: every decode step reads the weights once (all of them: at large batches nearly
  every expert of a MoE layer is hit); there are max(out) decode steps.
* Prefill: 2 FLOPs per active parameter per prompt token (a MoE token uses top_k experts).

Defaults are an H200's: 4.3 TB/s (what a copy reaches, of the 4.8 TB/s spec) and 790 dense
bf16 TFLOP/s. The workload is regenerated from the record (its name, parameters and seed).
"""

from nanovllm_final.workloads import make_workload

BANDWIDTH = 4.3e12  # bytes/s
PEAK_FLOPS = 790e12  # FLOP/s


def active_parameters(model: dict) -> float:
    """Parameters one token uses: all of a dense model's; a MoE model's without the experts it skips."""
    if "moe" not in model.get("model_type", ""):
        return model["num_parameters"]
    from tools.tiny_model import build_config  # the shape's MoE fields (records keep the dense ones)

    cfg = build_config(arch=None, shape=model["shape"])
    experts = cfg["num_hidden_layers"] * cfg["num_experts"] * 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"]
    return model["num_parameters"] - experts * (1 - cfg["num_experts_per_tok"] / cfg["num_experts"])


def _requests(record: dict) -> tuple[list[int], list[int], int]:
    """A record's workload as (prompt lengths, output lengths, K/V bytes per cached token)."""
    model, workload = record["model"], record["workload"]
    prompts, sampling = make_workload(workload["name"], model["vocab_size"], **workload["params"])
    fp8 = str(record.get("engine_options", {}).get("kv_cache_dtype", "auto")).startswith("fp8")
    value_bytes = 1 if fp8 else {"float32": 4}.get(model["dtype"], 2)
    per_token = 2 * model["num_hidden_layers"] * model["num_key_value_heads"] * model["head_dim"] * value_bytes
    return [len(p) for p in prompts], [s["max_tokens"] for s in sampling], per_token


def workload_limit(record: dict, bandwidth: float = BANDWIDTH, peak_flops: float = PEAK_FLOPS) -> dict:
    """{"output_tokens_per_s", "kv_s", "weights_s", "prefill_s"} of a benchmarks/run.py record."""
    model = record["model"]
    ins, outs, per_token = _requests(record)
    kv_s = sum(o * i + o * o / 2 for i, o in zip(ins, outs)) * per_token / bandwidth
    weights_s = model["num_parameters"] * 2 * max(outs) / bandwidth
    prefill_s = 2 * active_parameters(model) * sum(ins) / peak_flops
    return {"output_tokens_per_s": sum(outs) / (kv_s + weights_s + prefill_s), "kv_s": kv_s, "weights_s": weights_s,
            "prefill_s": prefill_s, "bandwidth": bandwidth, "peak_flops": peak_flops}


def decode_step_limits(record: dict, bandwidth: float = BANDWIDTH) -> list[tuple[int, float]]:
    """(batch, seconds) of each decode step of the workload at its limit: step t (1 <= t < the
    longest output) runs every request with more than t output tokens, reading their in + t
    cached tokens' K/V and the weights once. The steps of workload_limit's kv_s and weights_s."""
    ins, outs, per_token = _requests(record)
    weights = record["model"]["num_parameters"] * 2
    steps = []
    for t in range(1, max(outs)):
        live = [i + t for i, o in zip(ins, outs) if o > t]
        steps.append((len(live), (sum(live) * per_token + weights) / bandwidth))
    return steps
