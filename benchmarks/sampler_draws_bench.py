"""The Sampler's draw as the engine calls it, on a GPU (CUDA only).

    python benchmarks/sampler_draws_bench.py --out benchmarks/results/sampler_draws_h200.json

From a decode step's bf16 logits to its tokens, for Qwen3's and Llama-3's vocabularies at
several batch sizes: temperature only (`top_k=0, top_p=1`: Gumbel-max over the whole
vocabulary, one Triton launch that hashes each token's noise from its row's key) and the
checkpoint's top-k 20 / top-p 0.95 (the candidates pass, then the draw among them). Times are
medians of CUDA-event pairs around each call (eager, as the engine calls the sampler outside its
CUDA graphs), in ms. Beside them, the PyTorch code of the same draw on the same GPU (torch's
exponential noise over the rows' tokens, then the masks and an argmax); checks that the
fused draw is greedy where T = 0 and that seeded rows draw the PyTorch code's tokens (the
logits' top 32 of each row are unequal: torch.topk and the fused candidates pass may order
tied logits differently, which can change a row's 20 candidates).
"""

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernel_bench import cuda_time_ms, gpu_bench_args  # noqa: E402
from nanovllm_final.kernels import dispatch  # noqa: E402
from nanovllm_final.layers import sampler  # noqa: E402

VOCABS = {"qwen3": 151936, "llama-3": 128256}
ROWS = (256, 128, 32, 1)
MASKS = {"temperature-only": {}, "top_k=20,top_p=0.95": {"top_k": 20, "top_p": 0.95}}


def draw_fn(logits: torch.Tensor, masks: dict, fused: bool, seeds: torch.Tensor | None = None):
    """The Sampler's call of a step with these masks (its fused draw, or its PyTorch code)."""
    rows = logits.shape[0]
    temperatures = torch.full((rows,), 0.6, device="cuda")
    temperatures[::5] = 0.0  # some greedy rows
    kwargs = {"greedy_rows": True}
    if masks:
        kwargs.update(
            top_k=torch.full((rows,), masks["top_k"], device="cuda"),
            top_p=torch.full((rows,), masks["top_p"], device="cuda"),
            max_k=masks["top_k"],
        )
    if seeds is not None:
        kwargs.update(seeds=seeds, positions=torch.arange(rows, device="cuda"))
    draw = sampler.Sampler(seed=0, device=torch.device("cuda"))

    def fn():
        if fused:
            return draw(logits, temperatures, **kwargs)
        with dispatch.reference_only():
            return draw(logits, temperatures, **kwargs)

    return fn, temperatures


def main() -> None:
    args = gpu_bench_args(__doc__)
    torch.manual_seed(0)
    record = {
        "benchmark": "sampler_draws",
        "device_name": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": " ".join(["python", *sys.argv]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "rows": [],
    }
    for name, vocab in VOCABS.items():
        for rows in ROWS:
            logits = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16)  # below 12 here
            # 32 tokens a row above the rest and unequal, so that a row's top 20 have no tie at the 20th
            top = torch.rand(rows, vocab, device="cuda").argsort(-1)[:, :32]
            logits.scatter_(
                1,
                top,
                (12 + 0.125 * torch.arange(32, device="cuda")).to(torch.bfloat16).expand(rows, -1),
            )
            seeds = (
                torch.arange(rows, device="cuda") * 7919
            )  # every row seeded: both paths draw the same tokens
            for mask_name, masks in MASKS.items():
                row = {"vocab": name, "vocab_size": vocab, "rows": rows, "masks": mask_name}
                fused, temperatures = draw_fn(logits, masks, True)
                tokens = fused()
                greedy = temperatures == 0
                assert torch.equal(tokens[greedy], logits[greedy].argmax(-1)), "greedy rows"
                seeded = [draw_fn(logits, masks, f, seeds)[0]() for f in (True, False)]
                assert torch.equal(seeded[0], seeded[1]), (
                    "seeded rows: fused against the PyTorch code"
                )
                row["fused_ms"] = cuda_time_ms(fused, args.reps)
                row["torch_ops_ms"] = cuda_time_ms(draw_fn(logits, masks, False)[0], args.reps)
                record["rows"].append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
