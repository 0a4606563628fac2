"""The sampler's candidates pass on a GPU: each row's k largest logits (CUDA only).

    python benchmarks/sampler_bench.py --out benchmarks/results/sampler_candidates_h200.json

With a top-k mask the Sampler draws among each row's `max_k` largest logits
(sampler.top_candidates). Over a large vocabulary that is a grouped pass: the maxima of groups
of logits, the top k groups, the top k of their logits. This times it as PyTorch ops (five
launches: amax, topk, an index tensor, gather, topk) against kernels/sampling.py's top_candidates (two
launches) and torch.topk, on bf16 logits of Qwen3's and Llama-3's vocabularies at several batch
sizes; checks that each gives torch.topk's values. Times are GPU times of CUDA-graph replays
(kernel_bench.graph_time_ms), in ms.
"""

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernel_bench import gpu_bench_args, graph_time_ms  # noqa: E402
from nanovllm_final.kernels import dispatch, sampling  # noqa: E402
from nanovllm_final.layers import sampler  # noqa: E402

VOCABS = {"qwen3": 151936, "llama-3": 128256}
ROWS = (256, 128, 32, 1)
K = 20


def torch_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """sampler.top_candidates' PyTorch ops, as on the CPU."""
    with dispatch.reference_only():
        return sampler.top_candidates(logits, k)


def main() -> None:
    args = gpu_bench_args(__doc__)
    torch.manual_seed(0)
    record = {
        "benchmark": "sampler_candidates",
        "k": K,
        "device_name": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": " ".join(["python", *sys.argv]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "rows": [],
    }
    for name, vocab in VOCABS.items():
        for rows in ROWS:
            logits = (torch.randn(rows, vocab, device="cuda") * 3).to(torch.bfloat16)
            expected = logits.topk(K, dim=-1).values
            group = sampler._group_size(vocab, K)
            fns = {
                "torch_ops": lambda: torch_candidates(logits, K),
                "fused": lambda: sampling.top_candidates(logits, K, group),
                "topk": lambda: logits.topk(K, dim=-1),
            }
            row = {"vocab": name, "vocab_size": vocab, "rows": rows, "group": group}
            for key, fn in fns.items():
                values, ids = fn()
                assert torch.equal(values, expected) and torch.equal(
                    logits.gather(1, ids), values
                ), key
                row[f"{key}_ms"] = graph_time_ms(fn, args.reps)
            record["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
