"""Train the course model: a small Llama on the stories of tools/course_model/stories.py.

The whole recipe is here and seeded: the stories (stories.py, seed 0), a byte-level BPE
tokenizer trained on them (tools.tiny_model.train_bpe; the draft reuses the course model's), a
Llama-architecture model from transformers, AdamW with warm-up and cosine decay, bf16 autocast
on CUDA (and on the CPU for the draft). It writes a Hugging Face checkpoint (config.json,
model.safetensors in bfloat16, generation_config.json, tokenizer.json, tokenizer_config.json
with a ChatML chat template) and training_log.json (loss curve, timings, device, greedy samples).

    # the committed model (about 2 minutes of training on one H200):
    python -m tools.course_model.train --out models/course-llama --device cuda
    # its draft for speculative decoding (about 1M parameters, the course model's tokenizer;
    # trained on a 2-core CPU within the time limit):
    python -m tools.course_model.train --size draft --out models/course-llama-draft --device cpu \
        --max-train-seconds 1080
    # a toy run on CPU, to check the script in a minute:
    python -m tools.course_model.train --out /tmp/course-toy --device cpu --toy
    # the loss curve as a PNG, from a training_log.json:
    python -m tools.course_model.train --plot models/course-llama

Same seed, same device type and library versions: same weights, as far as the GPU's kernels
are deterministic (torch.use_deterministic_algorithms is on, warn-only).
"""

import argparse
import hashlib
import itertools
import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from tools.course_model import stories as story_grammar
from tools.tiny_model import (
    ENDOFTEXT,
    ENDOFTEXT_ID,
    IM_END_ID,
    build_config,
    param_shapes,
    save_tokenizer,
)

# The committed model's shape: about 5M parameters, 10 MB in bfloat16.
MODEL_SHAPE = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    vocab_size=2048,
    max_position_embeddings=1024,
)
# The draft model for speculative decoding: about 1M parameters, the same vocabulary and tokenizer.
# Two layers, wide ones: a draft's step on a CPU (and a small one's on a GPU) costs per operation
# launched, so a layer fewer buys more speed than a narrower layer does.
DRAFT_SHAPE = dict(
    hidden_size=192,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=3,
    head_dim=32,
    vocab_size=2048,
    max_position_embeddings=1024,
)
TOY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    max_position_embeddings=256,
)
# The training run: (stories, tokenizer stories, validation stories, steps, batch, sequence length)
RUN = dict(
    stories=200_000,
    tokenizer_stories=20_000,
    val_stories=2_000,
    steps=3000,
    batch=128,
    seq_len=512,
    lr=2e-3,
    min_lr=2e-4,
    warmup=100,
    weight_decay=0.1,
    log_every=25,
    eval_every=250,
)
# The draft trains on a CPU: fewer stories, smaller batches of shorter windows (a story is about
# 130 tokens), and the course model's tokenizer files copied, so that token ids match exactly.
# bf16 autocast on the CPU too (2.5x the float32 speed on a CPU with AVX-512 bf16). With
# --max-train-seconds the learning rate decays over that time (decay_by_time), however fast the
# steps go on a shared machine; the log records the step it stopped at.
DRAFT_RUN = dict(
    stories=60_000,
    val_stories=2_000,
    steps=2000,
    batch=16,
    seq_len=256,
    lr=4e-3,
    min_lr=4e-4,
    warmup=30,
    weight_decay=0.1,
    log_every=10,
    eval_every=50,
    tokenizer_from="models/course-llama",
    cpu_autocast=True,
    decay_by_time=True,
)
TOY_RUN = dict(
    stories=2_000,
    tokenizer_stories=1_000,
    val_stories=100,
    steps=30,
    batch=8,
    seq_len=128,
    lr=3e-3,
    min_lr=3e-4,
    warmup=5,
    weight_decay=0.1,
    log_every=5,
    eval_every=15,
)
SIZES = {
    "course": (MODEL_SHAPE, RUN),
    "draft": (DRAFT_SHAPE, DRAFT_RUN),
    "toy": (TOY_SHAPE, TOY_RUN),
}
ROOT = Path(__file__).resolve().parents[2]
SAMPLE_PROMPTS = [
    "Once upon a time, in a small village by the sea,",
    "One sunny morning, a little girl named Lily",
    "Tom had a red ball that",
]
LOG_FILE = "training_log.json"
PLOT_FILE = "training_loss.png"


def model_config(size: str) -> dict:
    """config.json of the course model (or its draft, or the toy): a Llama with tied embeddings,
    GQA, bfloat16 weights."""
    return build_config(
        "llama", "tiny", tie_word_embeddings=True, dtype="bfloat16", init_std=0.02, **SIZES[size][0]
    )


def tokenize(tokenizer: Tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """One token stream (each text followed by <|endoftext|>) and where each text starts."""
    encoded = tokenizer.encode_batch_fast([t + ENDOFTEXT for t in texts], add_special_tokens=False)
    lengths = np.fromiter((len(e.ids) for e in encoded), dtype=np.int64, count=len(encoded))
    stream = np.fromiter(
        itertools.chain.from_iterable(e.ids for e in encoded),
        dtype=np.int64,
        count=int(lengths.sum()),
    )
    starts = np.cumsum(lengths) - lengths
    return torch.from_numpy(stream), torch.from_numpy(starts)


def batches(
    stream: torch.Tensor, starts: torch.Tensor, batch: int, seq_len: int, generator: torch.Generator
):
    """Endless (batch, seq_len + 1) windows of the stream, each beginning at a story's start, so
    that position 0 is always a story's first token, as in a prompt."""
    starts = starts[starts + seq_len + 1 <= len(stream)]
    offsets = torch.arange(seq_len + 1)
    while True:
        pick = starts[torch.randint(len(starts), (batch,), generator=generator)]
        yield stream[pick[:, None] + offsets]  # (batch, seq_len + 1)


def lr_at(step: int, run: dict, time_used: float = 0.0) -> float:
    """Warm-up, then cosine decay over the steps, or over the time limit where time_used (the
    share of it spent) is ahead of the steps."""
    if step < run["warmup"]:
        return run["lr"] * (step + 1) / run["warmup"]
    progress = min(
        1.0, max((step - run["warmup"]) / max(1, run["steps"] - run["warmup"]), time_used)
    )
    return run["min_lr"] + 0.5 * (run["lr"] - run["min_lr"]) * (1 + math.cos(math.pi * progress))


def loss_of(model, rows: torch.Tensor, autocast: bool) -> torch.Tensor:
    device = next(model.parameters()).device
    rows = rows.to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=rows[:, :-1]).logits  # (batch, seq_len, vocab)
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())


def train(
    out: Path,
    device: str,
    seed: int,
    size: str = "course",
    steps: int | None = None,
    max_train_seconds: float | None = None,
) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    run = dict(SIZES[size][1])
    if steps is not None:
        run["steps"] = steps
    times = {}
    start = time.perf_counter()
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    config = model_config(size)
    out.mkdir(parents=True, exist_ok=True)

    texts = story_grammar.stories(run["stories"], seed)
    val_texts = story_grammar.stories(run["val_stories"], seed, start=run["stories"])
    tokenizer_json = (
        _shared_tokenizer(run["tokenizer_from"], config)
        if "tokenizer_from" in run
        else _train_tokenizer(texts[: run["tokenizer_stories"]], config["vocab_size"])
    )
    tokenizer = Tokenizer.from_str(tokenizer_json)
    stream, starts = tokenize(tokenizer, texts)
    val_stream, val_starts = tokenize(tokenizer, val_texts)
    times["data_s"] = time.perf_counter() - start
    print(
        f"data: {len(texts)} stories, {len(stream)} tokens, tokenizer {tokenizer.get_vocab_size()} tokens "
        f"({times['data_s']:.1f} s)",
        flush=True,
    )

    model = LlamaForCausalLM(LlamaConfig(**config)).to(device)
    params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": run["weight_decay"]},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=run["lr"],
        betas=(0.9, 0.95),
        fused=device == "cuda",
    )
    autocast = device == "cuda" or run.get("cpu_autocast", False)
    data = batches(
        stream, starts, run["batch"], run["seq_len"], torch.Generator().manual_seed(seed)
    )
    val_rows = list(
        _take(
            batches(
                val_stream,
                val_starts,
                run["batch"],
                run["seq_len"],
                torch.Generator().manual_seed(seed + 1),
            ),
            4,
        )
    )
    # On a shared CPU the step rate is unknown in advance: the draft's schedule follows the clock.
    decay_by_time = run.get("decay_by_time", False) and max_train_seconds is not None
    curve, val_curve = [], []
    train_start = time.perf_counter()
    for step in range(run["steps"]):
        time_used = (
            (time.perf_counter() - train_start) / max_train_seconds if decay_by_time else 0.0
        )
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, run, time_used)
        loss = loss_of(model, next(data), autocast)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        out_of_time = (
            max_train_seconds is not None and time.perf_counter() - train_start > max_train_seconds
        )
        last = step == run["steps"] - 1 or out_of_time
        if step % run["log_every"] == 0 or last:
            curve.append(
                {
                    "step": step,
                    "loss": round(loss.item(), 4),
                    "lr": lr_at(step, run, time_used),
                    "seconds": round(time.perf_counter() - train_start, 2),
                }
            )
        if step % run["eval_every"] == 0 or last:
            val_curve.append({"step": step, "loss": round(_evaluate(model, val_rows, autocast), 4)})
            print(
                f"step {step}: loss {loss.item():.3f}, val {val_curve[-1]['loss']:.3f}, "
                f"{time.perf_counter() - train_start:.0f} s",
                flush=True,
            )
        if out_of_time:  # a safety net for a time-limited machine; the log says so
            run["stopped_early_at_step"] = step
            break
    if device == "cuda":
        torch.cuda.synchronize()
    times["train_s"] = time.perf_counter() - train_start

    _save(out, model, config, tokenizer_json)
    if "tokenizer_from" in run:  # the very files, not a re-serialisation of them
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(ROOT / run["tokenizer_from"] / name, out / name)
    samples = _greedy_samples(out, tokenizer, device)
    times["total_s"] = time.perf_counter() - start
    log = {
        "command": " ".join(["python -m tools.course_model.train", *sys.argv[1:]]),
        "seed": seed,
        "size": size,
        "toy": size == "toy",
        "run": run,
        "config": config,
        "parameters": params,
        "device": torch.cuda.get_device_name()
        if device == "cuda"
        else platform.processor() or "cpu",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "tokenizers": _version("tokenizers"),
        },
        "data": {
            "stories": len(texts),
            "tokens": len(stream),
            "tokens_seen": (curve[-1]["step"] + 1) * run["batch"] * run["seq_len"],
            "tokenizer_size": tokenizer.get_vocab_size(),
        },
        "times": {k: round(v, 1) for k, v in times.items()},
        "final_loss": curve[-1]["loss"],
        "final_val_loss": val_curve[-1]["loss"],
        "curve": curve,
        "val_curve": val_curve,
        "greedy_samples": samples,
        "sha256": {
            f: hashlib.sha256((out / f).read_bytes()).hexdigest()
            for f in ("model.safetensors", "tokenizer.json")
        },
    }
    (out / LOG_FILE).write_text(json.dumps(log, indent=1) + "\n")
    print(
        f"done: {params / 1e6:.2f}M parameters, final loss {log['final_loss']}, val {log['final_val_loss']}, "
        f"train {times['train_s']:.0f} s, total {times['total_s']:.0f} s",
        flush=True,
    )
    return log


def _train_tokenizer(texts: list[str], vocab_size: int) -> str:
    from tools.tiny_model import train_bpe

    # The chat markup is made of special tokens; the BPE merges come from the words alone.
    plain = [t.replace("<|im_start|>", " ").replace("<|im_end|>", " ") for t in texts]
    return train_bpe(plain, vocab_size)


def _shared_tokenizer(model_dir: str, config: dict) -> str:
    """The tokenizer of another checkpoint (the course model's, for its draft), whose vocab_size
    must be this model's."""
    source = ROOT / model_dir
    theirs = json.loads((source / "config.json").read_text())["vocab_size"]
    if theirs != config["vocab_size"]:
        raise ValueError(
            f"vocab_size: {config['vocab_size']} here, {theirs} in {source}/config.json"
        )
    return (source / "tokenizer.json").read_text()


def _take(iterator, n: int):
    return (next(iterator) for _ in range(n))


@torch.no_grad()
def _evaluate(model, rows: list[torch.Tensor], autocast: bool) -> float:
    model.eval()
    loss = sum(loss_of(model, r, autocast).item() for r in rows) / len(rows)
    model.train()
    return loss


def _save(out: Path, model, config: dict, tokenizer_json: str) -> None:
    """Write the checkpoint: weights in bfloat16 under the Hugging Face names, no tied head."""
    state = {
        name: t.detach().to("cpu", torch.bfloat16).contiguous()
        for name, t in model.state_dict().items()
        if name != "lm_head.weight"
    }
    expected = param_shapes(config)
    assert {k: tuple(v.shape) for k, v in state.items()} == expected, (
        "weights differ from param_shapes(config)"
    )
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ENDOFTEXT_ID,
            "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
            "pad_token_id": ENDOFTEXT_ID,
            "do_sample": False,
        },
    )
    save_tokenizer(out, config["max_position_embeddings"], tokenizer_json)


def _greedy_samples(
    out: Path, tokenizer: Tokenizer, device: str, max_new_tokens: int = 80
) -> list[dict]:
    """Greedy continuations of SAMPLE_PROMPTS by the saved checkpoint, in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(device).eval()
    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False).ids], device=device)
        with torch.no_grad():
            new = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )[0, ids.shape[1] :].tolist()
        samples.append(
            {"prompt": prompt, "completion": tokenizer.decode(new, skip_special_tokens=True)}
        )
        print(f"{prompt!r} -> {samples[-1]['completion']!r}", flush=True)
    return samples


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


_TITLES = {"course": "course model", "draft": "course model's draft", "toy": "toy model"}


def plot(model_dir: Path) -> Path:
    """Draw training_log.json's loss curves into training_loss.png beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    log = json.loads((model_dir / LOG_FILE).read_text())
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(
        [p["step"] for p in log["curve"]],
        [p["loss"] for p in log["curve"]],
        lw=1,
        label="training batch",
    )
    ax.plot(
        [p["step"] for p in log["val_curve"]],
        [p["loss"] for p in log["val_curve"]],
        "o-",
        ms=3,
        label="held-out stories",
    )
    ax.set(
        xlabel="step",
        ylabel="cross-entropy (nats/token)",
        yscale="log",
        title=f"{_TITLES[log.get('size', 'course')]}: {log['parameters'] / 1e6:.1f}M parameters, {log['device']}",
    )
    ax.set_yticks([0.2, 0.3, 0.5, 1, 2, 4, 8])
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    path = model_dir / PLOT_FILE
    fig.savefig(path, metadata={"Software": None})  # no version stamp: same log, same bytes
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Train the course model (a small Llama on generated stories)."
    )
    parser.add_argument("--out", type=Path, help="the checkpoint directory to write")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=story_grammar.SEED)
    parser.add_argument(
        "--size",
        choices=list(SIZES),
        default="course",
        help="course: the course model; draft: its ~1M-parameter draft; toy: a smoke test",
    )
    parser.add_argument("--toy", action="store_true", help="the same as --size toy")
    parser.add_argument("--steps", type=int, help="override the run's number of steps")
    parser.add_argument(
        "--max-train-seconds", type=float, help="stop early (and say so in the log) after this long"
    )
    parser.add_argument(
        "--plot", type=Path, metavar="MODEL_DIR", help="only draw MODEL_DIR's loss curve"
    )
    args = parser.parse_args(argv)
    if args.plot:
        print(plot(args.plot))
        return
    if args.out is None:
        parser.error("--out is required")
    os.environ.setdefault(
        "CUBLAS_WORKSPACE_CONFIG", ":4096:8"
    )  # deterministic cuBLAS; before CUDA starts
    train(
        args.out,
        args.device,
        args.seed,
        "toy" if args.toy else args.size,
        args.steps,
        args.max_train_seconds,
    )


if __name__ == "__main__":
    main()
