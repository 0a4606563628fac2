"""Diagrams of the engine's data structures, drawn from what a live engine holds (never engine code).

    import figures
    figures.block_tables(seqs, num_blocks=12, block_size=4)       # 03: tables -> pool, slot of a token
    figures.hash_chains(rows)                                       # 04: chained hashes, hits and misses
    figures.chunk_schedule(steps, budget=64)                        # 05: who feeds what, step by step
    figures.graph_ladder(sizes)                                     # 06: batch size -> graph, padding
    figures.tp_shards(layers)                                       # 07: how each weight is split
    figures.expert_picks(weights, expert_ids, num_experts=8)        # 01 (MoE): each token's experts, weights
    figures.serve_sweep(points)                                     # final: served against offline, by clients

Each takes plain data (lists and dicts a notebook reads off the engine) and an optional `ax`,
draws, and returns the axes. `record_schedule(llm)` is the one helper that watches an engine: it
records what the scheduler hands the model runner at every step.
"""

import contextlib

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import FancyArrowPatch, Rectangle

COLORS = plt.get_cmap("tab10").colors


def _ax(ax, figsize):
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    ax.set_axis_off()
    return ax


def _box(ax, x, y, w, h, text="", color="white", edge="0.3", lw=1.0, fontsize=8, alpha=1.0, hatch=None, **text_kw):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor=edge, lw=lw, alpha=alpha, hatch=hatch))
    if text != "":
        ax.text(x + w / 2, y + h / 2, str(text), ha="center", va="center", fontsize=fontsize, **text_kw)


def _arrow(ax, start, end, color="0.4", style="-|>", lw=1.0, rad=0.0, **kw):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=9, color=color, lw=lw,
                                 connectionstyle=f"arc3,rad={rad}", shrinkA=1, shrinkB=1, **kw))


# ------------------------------------------------------------------------------ 03: block tables


def block_tables(seqs, num_blocks: int, block_size: int, *, highlight: tuple[str, int] | None = None, ax=None, title=None):
    """seqs: [(name, block_table, num_tokens)]. Top: each sequence's block table; bottom: the pool
    of blocks, each slot showing the position of the token whose K/V it holds; an arrow from
    every table entry to its block. highlight=(name, position): mark that token's slot and write
    out its slot-mapping arithmetic."""
    rows = len(seqs)
    ax = _ax(ax, (max(8, 0.75 * num_blocks + 2.5), 1.2 + 0.55 * rows + 1.4))
    pool_y, cell = 0.0, 1.0 / block_size
    owner = {}
    for i, (name, table, num_tokens) in enumerate(seqs):
        for j, block in enumerate(table):
            owner[block] = (i, j, min(block_size, num_tokens - j * block_size))
    for b in range(num_blocks):  # the pool: block b spans x in [b, b + 0.9]
        for s in range(block_size):
            i, j, filled = owner.get(b, (None, 0, 0))
            used = i is not None and s < filled
            _box(ax, b, pool_y + (block_size - 1 - s) * cell, 0.9, cell, text=(j * block_size + s) if used else "",
                 color=COLORS[i % 10] if used else ("white" if i is None else "0.93"), alpha=0.55 if used else 1.0,
                 fontsize=7)
        ax.text(b + 0.45, pool_y - 0.12, f"block {b}", ha="center", va="top", fontsize=7)
    ax.text(-0.3, pool_y + 0.5, "KV cache\n(the pool)", ha="right", va="center", fontsize=8)
    for i, (name, table, num_tokens) in enumerate(seqs):
        y = 1.5 + 0.55 * (rows - 1 - i)
        ax.text(-0.3, y + 0.2, f"{name}: {num_tokens} tokens", ha="right", va="center", fontsize=8, color=COLORS[i % 10])
        for j, block in enumerate(table):
            x = j * 0.6
            _box(ax, x, y, 0.5, 0.4, text=block, color=COLORS[i % 10], alpha=0.35, fontsize=8)
            _arrow(ax, (x + 0.25, y), (block + 0.45, pool_y + 1.0), color=COLORS[i % 10], lw=0.7, alpha=0.7)
    if highlight is not None:
        name, position = highlight
        i = [s[0] for s in seqs].index(name)
        table = seqs[i][1]
        block, offset = table[position // block_size], position % block_size
        ax.add_patch(Rectangle((block, pool_y + (block_size - 1 - offset) * cell), 0.9, cell, fill=False, edgecolor="k", lw=2.5))
        ax.text(num_blocks + 0.2, pool_y + 0.5,
                f"{name}'s token {position}:\nblock_table[{position} // {block_size}] = {block}\n"
                f"slot = {block} * {block_size} + {position} % {block_size} = {block * block_size + offset}",
                ha="left", va="center", fontsize=8, family="monospace")
    ax.set_xlim(-3.2, num_blocks + (4.5 if highlight else 0.5))
    ax.set_ylim(-0.5, 1.5 + 0.55 * rows + 0.2)
    ax.set_title(title or f"block tables and the pool: {num_blocks} blocks of {block_size} slots", fontsize=10)
    return ax


# ------------------------------------------------------------------------------ 04: hash chains


def hash_chains(rows, *, block_size: int, ax=None, title=None):
    """rows: [(name, blocks)], blocks: [{"block_id", "tokens", "hash" (int, or -1 for a block not
    hashed), "hit" (True: shared from the cache, False: computed), and optionally "text" (shown
    instead of the token ids)}]. One row of boxes per
    sequence; an arrow carries each block's hash into the next block's."""
    width = max(len(blocks) for _, blocks in rows)
    ax = _ax(ax, (max(8, 2.3 * width + 2), 1.25 * len(rows) + 0.8))
    legend = {True: ("tab:green", "found in the cache: shared"), False: ("tab:orange", "computed, then registered"),
              None: ("0.85", "partly filled: not hashed")}
    for r, (name, blocks) in enumerate(rows):
        y = 1.25 * (len(rows) - 1 - r)
        ax.text(-0.15, y + 0.45, name, ha="right", va="center", fontsize=9)
        for j, block in enumerate(blocks):
            x = 2.3 * j
            state = block["hit"] if block["hash"] != -1 else None
            color = legend[state][0]
            tokens = block["tokens"]
            shown = ", ".join(map(str, tokens)) if len(tokens) <= 4 else f"{tokens[0]}, {tokens[1]}, …, {tokens[-1]}"
            text = block.get("text")
            shown = f"[{shown}]" if text is None else repr(text if len(text) <= 20 else text[:18] + "…")
            hashed = f"hash {block['hash']:016x}"[:13] + "…" if block["hash"] != -1 else "no hash yet"
            _box(ax, x, y, 1.8, 0.9, color=color, alpha=0.45)
            ax.text(x + 0.9, y + 0.72, f"block {block['block_id']}", ha="center", fontsize=8, weight="bold")
            ax.text(x + 0.9, y + 0.45, shown, ha="center", va="center", fontsize=7)
            ax.text(x + 0.9, y + 0.15, hashed, ha="center", va="center", fontsize=6.5, family="monospace")
            if j:
                _arrow(ax, (x - 0.5, y + 0.45), (x, y + 0.45), color="0.3")
    handles = [Rectangle((0, 0), 1, 1, facecolor=c, alpha=0.45, edgecolor="0.3") for c, _ in legend.values()]
    ax.legend(handles, [label for _, label in legend.values()], loc="upper left", bbox_to_anchor=(0, 0), ncol=3,
              fontsize=8, frameon=False)
    ax.set_xlim(-2.2, 2.3 * width)
    ax.set_ylim(-0.3, 1.25 * len(rows))
    ax.set_title(title or f"chained block hashes (blocks of {block_size} tokens): "
                 "hash(block i) = xxh64(hash(block i-1) ‖ tokens of block i)", fontsize=10)
    return ax


# ------------------------------------------------------------------------------ 05: the schedule


@contextlib.contextmanager
def record_schedule(llm):
    """While active, each engine step appends [(seq_id, tokens fed, tokens cached before, length)]
    for the sequences the stage's scheduler hands the model runner (wraps this engine's
    scheduler.schedule; stages 05+, where each sequence carries num_scheduled_tokens)."""
    scheduler = llm.engine.scheduler
    steps, schedule = [], scheduler.schedule

    def recorded():
        seqs = schedule()
        steps.append([(s.seq_id, s.num_scheduled_tokens, s.num_cached_tokens, len(s)) for s in seqs])
        return seqs

    scheduler.schedule = recorded
    try:
        yield steps
    finally:
        del scheduler.schedule


def chunk_schedule(steps, *, budget: int, names: dict | None = None, ax=None, title=None):
    """steps: record_schedule's list. A cell per (step, sequence): a decode token (small, blue) or
    a prompt chunk (orange, labelled with its tokens; darker when it completes the prompt)."""
    ids = sorted({sid for step in steps for sid, *_ in step})
    names = names or {sid: f"seq {k}" for k, sid in enumerate(ids)}
    ax = _ax(ax, (max(8, 0.32 * len(steps) + 2), 0.42 * len(ids) + 1.6))
    for x, step in enumerate(steps):
        total = sum(n for _, n, _, _ in step)
        for sid, n, cached, length in step:
            y = len(ids) - 1 - ids.index(sid)
            decode = n == 1 and cached == length - 1 and cached > 0
            last = cached + n == length
            color = "tab:blue" if decode else ("tab:red" if last else "tab:orange")
            _box(ax, x, y, 0.9, 0.8, text="" if decode else n, color=color, alpha=0.35 if decode else 0.6, fontsize=6.5)
        ax.text(x + 0.45, len(ids) + 0.1, total, ha="center", va="bottom", fontsize=6.5,
                color="k" if total <= budget else "tab:red", rotation=90)
    for k, sid in enumerate(ids):
        ax.text(-0.2, len(ids) - 1 - k + 0.4, names.get(sid, sid), ha="right", va="center", fontsize=8)
    ax.text(-0.2, len(ids) + 0.4, "tokens in the step", ha="right", va="center", fontsize=7)
    for x in range(0, len(steps), 5):
        ax.text(x + 0.45, -0.25, x, ha="center", va="top", fontsize=7)
    ax.text(len(steps) / 2, -0.9, "step", ha="center", fontsize=8)
    handles = [Rectangle((0, 0), 1, 1, facecolor=c, alpha=a, edgecolor="0.3")
               for c, a in (("tab:blue", 0.35), ("tab:orange", 0.6), ("tab:red", 0.6))]
    ax.legend(handles, ["decode: 1 token", "prompt chunk (tokens)", "last chunk: the prompt is in, a token is sampled"],
              loc="upper left", bbox_to_anchor=(0, -0.02), ncol=3, fontsize=8, frameon=False)
    ax.set_xlim(-3, len(steps) + 0.2)
    ax.set_ylim(-1.2, len(ids) + 1.3)
    ax.set_title(title or f"what the scheduler feeds each step (budget {budget} tokens)", fontsize=10)
    return ax


# ------------------------------------------------------------------------------ 06: the ladder


def graph_ladder(sizes: list[int], *, graph_for=None, ax=None, title=None):
    """For every decode batch of n = 1..max(sizes) sequences: the captured size it replays
    (graph_for(n, sizes), the stage's function) and the padding rows above n."""
    ns = list(range(1, sizes[-1] + 1))
    padded = [graph_for(n, sizes) if graph_for else min(s for s in sizes if s >= n) for n in ns]
    if ax is None:
        _, ax = plt.subplots(figsize=(max(7, 0.11 * len(ns) + 3), 3.4))
    ax.bar(ns, ns, color="tab:blue", width=0.85, label="sequences in the decode step")
    ax.bar(ns, [p - n for p, n in zip(padded, ns)], bottom=ns, color="tab:orange", alpha=0.45, width=0.85,
           hatch="///", label="padding rows (slot -1, context 0)")
    for s in sizes:
        ax.axhline(s, color="0.6", lw=0.6, ls=":")
    ticks = [sizes[0]]
    for s in sizes[1:]:  # a label per rung, but none closer than a twentieth of the axis to the one below
        if s - ticks[-1] >= sizes[-1] / 20 or s == sizes[-1]:
            ticks.append(s)
    if len(ticks) > 1 and ticks[-1] - ticks[-2] < sizes[-1] / 20:
        del ticks[-2]
    ax.set_yticks(ticks)
    ax.set(xlabel="sequences in the decode step (n)", ylabel="rows of the graph replayed", xlim=(0.3, ns[-1] + 0.7))
    ax.legend(loc="upper left", fontsize=8)
    wasted = sum(p - n for p, n in zip(padded, ns)) / sum(padded)
    ax.set_title(title or f"the ladder {sizes}: each n replays the next captured size up "
                 f"({wasted:.0%} of the rows are padding, over n = 1..{ns[-1]})", fontsize=10)
    return ax


# ------------------------------------------------------------------------------ 07: shards


def tp_shards(layers, *, tp: int, ax=None, title=None):
    """layers: [(name, full shape (out, in), split dim (0: rows/outputs, 1: columns/inputs, None:
    replicated), what follows ("all-reduce", "gather", or None))], in data-flow order. Each weight is
    a rectangle (height: outputs, width: inputs, to scale), cut into its ranks' shares."""
    scale = 1.6 / max(max(s) for _, s, _, _ in layers)
    ax = _ax(ax, (2.0 * len(layers) + 1, 3.6))
    x = 0.0
    for name, (out, inp), dim, after in layers:
        h, w = max(out * scale, 0.08), max(inp * scale, 0.08)
        y0 = 1.0 - h / 2
        for r in range(tp):
            if dim == 0:
                part = (x, y0 + h - (r + 1) * h / tp, w, h / tp)
            elif dim == 1:
                part = (x + r * w / tp, y0, w / tp, h)
            else:
                part = (x, y0, w, h)
            _box(ax, *part, color=COLORS[r] if dim is not None else "0.8", alpha=0.55, lw=0.6)
            if dim is None:
                break
        how = {0: "rows split\n(column-parallel)", 1: "columns split\n(row-parallel)", None: "whole on every rank"}[dim]
        if dim == 0 and ("embed" in name or "lm_head" in name):
            how = "vocabulary split\n(rows)"
        ax.text(x + w / 2, y0 + h + 0.08, f"{name}\n{out}×{inp}", ha="center", va="bottom", fontsize=7.5)
        ax.text(x + w / 2, y0 - 0.08, how, ha="center", va="top", fontsize=7)
        nxt = x + w + 0.55
        if after:
            ax.text(x + w + 0.27, 1.0, "Σ" if after == "all-reduce" else "⇢0", ha="center", va="center", fontsize=11,
                    color="tab:red", weight="bold")
            ax.text(x + w + 0.27, 0.72, after, ha="center", va="top", fontsize=6.5, color="tab:red", rotation=90)
        x = nxt
    handles = [Rectangle((0, 0), 1, 1, facecolor=COLORS[r], alpha=0.55) for r in range(tp)]
    ax.legend(handles, [f"rank {r}" for r in range(tp)], loc="lower right", fontsize=8, frameon=False)
    ax.set_xlim(-0.2, x)
    ax.set_ylim(-0.4, 2.4)
    ax.set_title(title or f"TP={tp}: who holds what (each weight to scale: height = outputs, width = inputs)", fontsize=10)
    return ax


# ------------------------------------------------------------------------------ 01: mixture of experts


def expert_picks(weights, expert_ids, num_experts: int, *, labels=None, ax=None, title=None):
    """weights, expert_ids: (tokens, top_k), as a router's route returns them. One row per token,
    one column per expert: the experts a token picked are coloured by their routing weight (the
    weight written in), the others left blank; labels: one name per token for the rows."""
    expert_ids, weights = torch.as_tensor(expert_ids).long(), torch.as_tensor(weights).float()  # lists work too
    tokens, top_k = expert_ids.shape
    grid = torch.zeros(tokens, num_experts).scatter(1, expert_ids, weights)  # (tokens, experts)
    if ax is None:
        _, ax = plt.subplots(figsize=(max(4.0, 0.5 * num_experts + 2), 0.3 * tokens + 1.2))
    shown = grid.masked_fill(grid == 0, float("nan"))  # unpicked experts stay blank
    image = ax.imshow(shown, cmap="Blues", vmin=0, vmax=1, aspect="auto")
    for t in range(tokens):
        for e in range(num_experts):
            if grid[t, e] > 0:
                ax.text(e, t, f"{grid[t, e]:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if grid[t, e] > 0.55 else "black")
    ax.set_xticks(range(num_experts))
    ax.set_yticks(range(tokens), labels if labels is not None else range(tokens), fontsize=7.5)
    ax.set_xticks([x - 0.5 for x in range(1, num_experts)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, tokens)], minor=True)
    ax.grid(which="minor", color="0.85", lw=0.5)
    ax.tick_params(which="minor", length=0)
    ax.set(xlabel="expert", ylabel="token")
    plt.colorbar(image, ax=ax, fraction=0.04, pad=0.02, label="routing weight")
    ax.set_title(title or f"each token's {top_k} experts of {num_experts}, and their weights", fontsize=10)
    return ax
# ------------------------------------------------------------------------------ final: the served sweep


def serve_sweep(points, *, axes=None, title=None):
    """points: benchmarks.tables.serve_point dicts, one per serve record (any number, any order).
    Three panels against the clients (log scale): served and offline output tok/s; TTFT p50 and
    p90; TPOT p50 and p90 beside the offline run's mean decode step at the server's batch. A
    field a record lacks (None) is left out of its line."""
    points = sorted(points, key=lambda p: p["concurrency"])
    if axes is None:
        _, axes = plt.subplots(1, 3, figsize=(13, 3.6))

    def line(ax, key, label, **kw):
        xy = [(p["concurrency"], p[key]) for p in points if p.get(key) is not None]
        if xy:
            ax.plot(*zip(*xy), marker="o", label=label, **kw)

    line(axes[0], "served_tok_s", "served (streaming clients)", color="tab:blue")
    line(axes[0], "offline_tok_s", "offline LLM.generate, same requests", color="0.5", ls="--")
    axes[0].set(ylabel="output tokens/s")
    for ax, metric, name in ((axes[1], "ttft", "TTFT"), (axes[2], "tpot", "TPOT")):
        line(ax, f"{metric}_p50_ms", f"{name} p50", color="tab:orange")
        line(ax, f"{metric}_p90_ms", f"{name} p90", color="tab:red", ls=":")
        ax.set(ylabel=f"{name} (ms)")
    line(axes[2], "decode_step_at_batch_ms", "offline decode step at the server's batch", color="0.5", ls="--")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks([p["concurrency"] for p in points], [str(p["concurrency"]) for p in points])
        ax.set_xlabel("concurrent streaming clients")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7.5)
    axes[0].figure.suptitle(title or "the server against the offline engine, by clients", fontsize=10)
    axes[0].figure.tight_layout()
    return axes
