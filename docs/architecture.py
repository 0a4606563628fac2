"""Draw the course's architecture diagram: docs/architecture.png (notebooks/README.md shows it).

    python docs/architecture.py            # rewrites docs/architecture.png

One request's path through the engine, top to bottom, each box tagged with the stage whose
notebook builds it. Run it again after changing the boxes below; the PNG is committed.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).with_name("architecture.png")
STAGE_COLORS = {
    "01": "#4e79a7",
    "02": "#59a14f",
    "03": "#e15759",
    "04": "#f28e2b",
    "05": "#b07aa1",
    "06": "#76b7b2",
    "07": "#9c755f",
    "final": "#555555",
}

# (x, y, width, height, title, lines, stages that build it)
BOXES = [
    (
        0.5,
        8.6,
        9.0,
        1.0,
        "nanovllm serve  (final)",
        ["OpenAI-compatible HTTP: /v1/completions, /v1/chat/completions, SSE streams"],
        ["final"],
    ),
    (
        0.5,
        6.9,
        9.0,
        1.2,
        "LLM  —  the face",
        [
            "generate(prompts, SamplingParams) · stream · chat · metrics()",
            "tokenize in, detokenize out",
        ],
        ["01", "final"],
    ),
    (
        0.5,
        4.4,
        4.3,
        2.1,
        "Scheduler",
        [
            "waiting / running queues",
            "continuous batching, preemption",
            "token budget: chunked prefill",
        ],
        ["03", "05"],
    ),
    (
        5.2,
        4.4,
        4.3,
        2.1,
        "Block manager",
        ["free blocks, block tables", "ref counts; hash of full blocks", "-> prefix cache hits"],
        ["03", "04"],
    ),
    (
        0.5,
        2.2,
        9.0,
        1.7,
        "Model runner",
        [
            "one step: prefill and decode tokens in one batch -> slot mapping, block tables",
            "decode replayed as CUDA graphs · ranks of tensor parallelism",
        ],
        ["02", "03", "06", "07"],
    ),
    (
        0.5,
        0.0,
        5.1,
        1.7,
        "Model (Qwen3 / Llama)",
        ["embedding -> blocks of attention + MLP -> LM head", "sampler: Gumbel-max, top-k / top-p"],
        ["01", "07"],
    ),
    (
        6.0,
        0.0,
        3.5,
        1.7,
        "KV cache",
        ["blocks of K and V per layer", "store kernel, paged", "attention kernels"],
        ["02", "03"],
    ),
]
ARROWS = [  # (from (x, y), to (x, y), label)
    ((2.6, 8.6), (2.6, 8.1), "requests"),
    ((7.4, 8.1), (7.4, 8.6), "tokens, as they come"),
    ((2.6, 6.9), (2.6, 6.5), "add_request / step()"),
    ((4.8, 5.45), (5.2, 5.45), ""),
    ((5.0, 4.4), (5.0, 3.9), "the step's sequences"),
    ((3.3, 2.2), (3.3, 1.7), "input ids, positions"),
    ((5.6, 0.85), (6.0, 0.85), ""),
    ((8.8, 2.2), (8.8, 1.7), ""),
]


def draw(path: Path = OUT) -> Path:
    fig, ax = plt.subplots(figsize=(10, 10.6))
    ax.set(xlim=(0, 10), ylim=(-0.9, 9.9))
    ax.axis("off")
    for x, y, w, h, title, lines, stages in BOXES:
        ax.add_patch(
            FancyBboxPatch(
                (x, y),
                w,
                h,
                boxstyle="round,pad=0.02,rounding_size=0.12",
                fc="#f7f7f7",
                ec="#333333",
                lw=1.2,
            )
        )
        ax.text(x + 0.15, y + h - 0.2, title, fontsize=12, fontweight="bold", va="top")
        for i, line in enumerate(lines):
            ax.text(
                x + 0.15, y + h - 0.62 - 0.36 * i, line, fontsize=9.5, va="top", color="#222222"
            )
        for j, stage in enumerate(
            reversed(stages)
        ):  # badges at the top right: the stages that build it
            bx = x + w - 0.15 - 0.62 * (j + 1)
            ax.add_patch(
                FancyBboxPatch(
                    (bx, y + h - 0.42),
                    0.55,
                    0.3,
                    boxstyle="round,pad=0.01,rounding_size=0.08",
                    fc=STAGE_COLORS[stage],
                    ec="none",
                )
            )
            ax.text(
                bx + 0.275,
                y + h - 0.27,
                stage,
                fontsize=8.5,
                color="white",
                ha="center",
                va="center",
                fontweight="bold",
            )
    for start, end, label in ARROWS:
        ax.add_patch(
            FancyArrowPatch(
                start, end, arrowstyle="-|>", mutation_scale=14, lw=1.4, color="#333333"
            )
        )
        if label:
            ax.text(
                start[0] + 0.12,
                (start[1] + end[1]) / 2,
                label,
                fontsize=8.5,
                va="center",
                style="italic",
                color="#444444",
            )
    ax.text(
        0.5,
        -0.55,
        "Badges: the stage (notebook) that builds each part.\n01 naive · 02 KV cache · 03 paged · "
        "04 prefix cache · 05 chunked prefill · 06 CUDA graphs · 07 tensor parallel · final: the finished engine",
        fontsize=8.5,
        color="#444444",
    )
    ax.set_title("One request through the engine", fontsize=14, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


if __name__ == "__main__":
    print(draw())
