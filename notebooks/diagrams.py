"""Conceptual diagrams, drawn in code from the numbers a notebook passes in (never engine code).

    import diagrams
    diagrams.kv_sources()                                  # 02: where K and V come from in a decoder layer
    diagrams.step_timeline({"01_naive": [13, 14, ...], "02_kvcache": [13, 1, ...]})  # 02: prefill, then decode
    diagrams.roofline(points)                              # 03: why a decode step is bound by memory bandwidth
    diagrams.launch_timelines(launch_us=11, kernel_us=2)   # 06: CPU and GPU, eager against a graph replay

Each draws into `ax` (a new figure if None) and returns it; end the cell with `plt.show()`.
"""

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

H200 = {"name": "NVIDIA H200", "bf16_tflops": 989.0, "hbm_tb_s": 4.8}  # NVIDIA's datasheet: dense BF16, HBM3e


def _box(ax, x, y, w, h, text, face="white", edge="0.35", fontsize=8, color="black", weight="normal"):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.06", facecolor=face,
                                edgecolor=edge, lw=1.0))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=color, weight=weight)


def _arrow(ax, a, b, color="0.4", rad=0.0, lw=1.0):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=9, color=color, lw=lw,
                                 connectionstyle=f"arc3,rad={rad}", shrinkA=1, shrinkB=1))


# ------------------------------------------------------------------------------ 02


def kv_sources(ax=None):
    """One decoder layer at decode time, for the newest token t: its hidden state is projected to
    q_t, k_t and v_t; k_t and v_t are appended to the cache, and q_t attends over every cached
    k and v (positions 0..t). Everything else in the layer sees token t alone."""
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 3.6))
    ax.set_axis_off()
    blue, red = "#dbe9f6", "#f8d9d4"
    _box(ax, 0.0, 1.6, 1.3, 0.7, "hidden state\nof token t", blue)
    _box(ax, 1.8, 1.6, 1.1, 0.7, "RMSNorm")
    _box(ax, 3.3, 1.6, 1.5, 0.7, "qkv_proj,\nq/k norm, RoPE", fontsize=7.5)
    _arrow(ax, (1.3, 1.95), (1.8, 1.95))
    _arrow(ax, (2.9, 1.95), (3.3, 1.95))
    for i, (name, y) in enumerate((("q_t", 2.75), ("k_t", 1.6), ("v_t", 0.9))):
        _box(ax, 5.4, y, 0.7, 0.45, name, blue if name == "q_t" else red, fontsize=9, weight="bold")
        _arrow(ax, (4.8, 1.95), (5.4, y + 0.22))
    # the cache: one row per earlier token, K and V, level with k_t and v_t
    x0, rows = 7.0, 6
    for r in range(rows):
        face = red if r == rows - 1 else "#eeeeee"
        ax.add_patch(Rectangle((x0 + r * 0.42, 1.6), 0.4, 0.45, facecolor=face, edgecolor="0.5"))
        ax.add_patch(Rectangle((x0 + r * 0.42, 0.9), 0.4, 0.45, facecolor=face, edgecolor="0.5"))
        ax.text(x0 + r * 0.42 + 0.2, 0.85, "t" if r == rows - 1 else str(r), ha="center", va="top", fontsize=7)
    ax.text(x0 - 0.1, 1.82, "K", ha="right", va="center", fontsize=9, weight="bold")
    ax.text(x0 - 0.1, 1.12, "V", ha="right", va="center", fontsize=9, weight="bold")
    ax.text(x0 + rows * 0.21, 0.55, "this layer's KV cache:\none row per token so far", ha="center", va="top", fontsize=8)
    last = x0 + (rows - 1) * 0.42 + 0.2
    _arrow(ax, (6.1, 1.9), (last, 2.05), color="tab:red", rad=-0.3)
    _arrow(ax, (6.1, 1.05), (last, 0.9), color="tab:red", rad=0.3)
    ax.text(last - 1.2, 2.6, "append k_t, v_t", fontsize=7.5, color="tab:red", ha="center")
    _box(ax, 10.1, 1.45, 2.2, 1.0, "attention over\npositions 0..t:\nsoftmax(q_t K / sqrt d) V", blue, fontsize=7.5)
    _arrow(ax, (6.1, 2.97), (10.1, 2.3), color="tab:blue")
    _arrow(ax, (x0 + rows * 0.42, 1.47), (10.1, 1.9), color="0.3")
    _box(ax, 12.7, 1.5, 1.7, 0.9, "o_proj, residual,\nRMSNorm, MLP,\nresidual", "white", fontsize=7.5)
    _arrow(ax, (12.3, 1.95), (12.7, 1.95))
    ax.text(14.5, 1.95, "next layer", va="center", fontsize=8)
    ax.text(0.0, 2.95, "k_t, v_t depend only on tokens 0..t:\nthey never change. Compute them once,\n"
            "store them: every later token reads them.\nOnly attention looks at other tokens.",
            fontsize=7.5, va="center", color="0.25")
    ax.set_xlim(-0.1, 15.4)
    ax.set_ylim(-0.1, 3.35)
    return ax


def step_timeline(runs: dict[str, list[int]], ax=None, title=None):
    """runs: {engine: tokens run through the model in each step} (llm.stats' num_tokens). Each
    engine is a row along an axis of work (tokens run); each step is one box, as wide as its
    tokens: the first step is the prefill, the others decode steps. Same generation, same
    prompt, so the rows' lengths compare the work."""
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 0.9 + 0.75 * len(runs)))
    names = list(runs)
    for row, name in enumerate(names):
        y, x = len(names) - 1 - row, 0
        for i, tokens in enumerate(runs[name]):
            color = "tab:purple" if i == 0 else ("tab:green" if i % 2 else "#7fc97f")
            ax.add_patch(Rectangle((x, y - 0.3), tokens, 0.6, facecolor=color, edgecolor="white", lw=0.3))
            x += tokens
        ax.text(x, y, f"  {x:,} tokens in {len(runs[name])} steps", va="center", fontsize=8)
    ax.set_yticks(range(len(names)), names[::-1])
    ax.set_xlim(0, 1.25 * max(sum(v) for v in runs.values()))
    ax.set_ylim(-0.6, len(names) - 0.4)
    ax.set_xlabel("tokens run through the model, step after step")
    handles = [Rectangle((0, 0), 1, 1, facecolor="tab:purple"), Rectangle((0, 0), 1, 1, facecolor="tab:green")]
    ax.legend(handles, ["the first step (the prompt: prefill)", "the later steps (one new token each: decode)"],
              loc="lower right", fontsize=8, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_title(title or "the same generation, step by step", fontsize=10)
    return ax


# ------------------------------------------------------------------------------ 03


def roofline(points: dict[str, tuple[float, float]], gpu: dict = H200, ax=None, title=None):
    """The roofline of `gpu`: attainable FLOP/s = min(peak, bandwidth x arithmetic intensity),
    with points {label: (FLOPs, bytes moved)} placed on it. Left of the ridge a kernel waits for
    memory; right of it, for arithmetic."""
    import numpy as np

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.8))
    peak, bw = gpu["bf16_tflops"] * 1e12, gpu["hbm_tb_s"] * 1e12
    x = np.logspace(-1, 4.5, 200)
    ax.plot(x, np.minimum(peak, bw * x), color="k", lw=1.5)
    ridge = peak / bw
    ax.axvline(ridge, color="0.6", ls=":", lw=1)
    ax.text(ridge * 1.08, peak * 0.02, f"ridge: {ridge:.0f} FLOP/byte", fontsize=8, color="0.35")
    for i, (label, (flops, bytes_)) in enumerate(points.items()):
        intensity = flops / bytes_
        attained = min(peak, bw * intensity)
        ax.plot(intensity, attained, "o", color=plt.get_cmap("tab10")(i))
        below = i % 2  # alternate sides, so that neighbouring points keep their labels apart
        ax.annotate(label, (intensity, attained), textcoords="offset points", xytext=(6, -12) if below else (-6, 6),
                    ha="left" if below else "right", fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOPs per byte read from memory)",
           ylabel="attainable FLOP/s")
    ax.set_ylim(bw * 0.05, peak * 3)
    ax.grid(alpha=0.3, which="both")
    ax.set_title(title or f"{gpu['name']}: {gpu['bf16_tflops']:.0f} TFLOP/s (BF16, dense), {gpu['hbm_tb_s']} TB/s",
                 fontsize=10)
    return ax


# ------------------------------------------------------------------------------ 06


def launch_timelines(launch_us: float, kernel_us: float, num_kernels: int = 10, copy_us: float | None = None, axes=None):
    """CPU and GPU over one decode step of num_kernels small kernels. Eager (top): the CPU spends
    launch_us on each launch, and a kernel of kernel_us can only start once it is launched, so the
    GPU idles between kernels. Graph replay (bottom): the CPU copies the inputs into the static
    buffers and issues one replay; the GPU runs the kernels back to back."""
    if axes is None:
        _, axes = plt.subplots(2, 1, figsize=(12, 3.6), sharex=True)
    copy_us = launch_us if copy_us is None else copy_us
    colors = plt.get_cmap("tab20").colors
    eager_end = 0.0
    for k in range(num_kernels):  # eager: launch k ends at (k + 1) * launch_us; the kernel starts then, or later
        start = max((k + 1) * launch_us, eager_end)
        axes[0].add_patch(Rectangle((k * launch_us, 1.1), launch_us * 0.95, 0.7, color=colors[k % 20]))
        axes[0].add_patch(Rectangle((start, 0.1), kernel_us, 0.7, color=colors[k % 20]))
        eager_end = start + kernel_us
    axes[0].set_title(f"eager: {num_kernels} launches of ~{launch_us:g} µs each, kernels of ~{kernel_us:g} µs: "
                      f"the GPU is busy {num_kernels * kernel_us / eager_end:.0%} of the step", fontsize=9)
    start = copy_us + launch_us  # graph: copy the inputs, one replay call, then the kernels back to back
    axes[1].add_patch(Rectangle((0, 1.1), copy_us * 0.95, 0.7, color="0.6"))
    axes[1].add_patch(Rectangle((copy_us, 1.1), launch_us * 0.95, 0.7, color="k"))
    axes[1].text(copy_us + launch_us / 2, 1.45, "replay", color="white", ha="center", va="center", fontsize=7)
    for k in range(num_kernels):
        axes[1].add_patch(Rectangle((start + k * kernel_us, 0.1), kernel_us * 0.95, 0.7, color=colors[k % 20]))
    graph_end = start + num_kernels * kernel_us
    axes[1].set_title(f"CUDA graph: copy the inputs, one replay call; the same kernels back to back "
                      f"({graph_end:.0f} µs instead of {eager_end:.0f} µs)", fontsize=9)
    for ax in axes:
        ax.set_yticks([0.45, 1.45], ["GPU", "CPU"])
        ax.set_ylim(0, 1.9)
        ax.set_xlim(0, eager_end * 1.02)
        ax.spines[["top", "right"]].set_visible(False)
    axes[1].set_xlabel("µs")
    plt.tight_layout()
    return axes
