"""The course's map: the ladder of notebooks and the engine's components, drawn with matplotlib.

    import course_map
    course_map.you_are_here("03_paged")   # the strip at the top of every notebook
    course_map.architecture()             # the engine's components and what flows between them

`LADDER` is the learning path (kernels.ipynb sits between 03 and 04); `TOUCHES` says which
components each notebook changes, the same names as `COMPONENTS`.
"""

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

LADDER = [  # (notebook, short title): the learning path, in order
    ("01_naive", "01\nnaive"),
    ("02_kvcache", "02\nKV cache"),
    ("03_paged", "03\npaged"),
    ("kernels", "kernels\nTriton"),
    ("04_prefix_cache", "04\nprefix cache"),
    ("05_chunked_prefill", "05\nchunked prefill"),
    ("06_cudagraph", "06\nCUDA graphs"),
    ("07_tensor_parallel", "07\ntensor parallel"),
    ("final", "final\nengine"),
]

COMPONENTS = [  # (name, what it does), in the order a request meets them
    ("LLM", "generate()"),
    ("scheduler", "who runs a step"),
    ("block manager", "KV blocks"),
    ("model runner", "step tensors"),
    ("model", "the layers"),
    ("kernels", "attention, K/V"),
]

TOUCHES = {  # the components each notebook's stage changes
    "01_naive": {"LLM", "scheduler", "model runner", "model"},
    "02_kvcache": {"scheduler", "model runner", "model"},
    "03_paged": {"scheduler", "block manager", "model runner", "kernels"},
    "kernels": {"kernels"},
    "04_prefix_cache": {"block manager", "scheduler"},
    "05_chunked_prefill": {"scheduler", "model runner"},
    "06_cudagraph": {"model runner"},
    "07_tensor_parallel": {"model runner", "model"},
    "final": {name for name, _ in COMPONENTS},
}

CURRENT, DONE, AHEAD, TOUCHED = "tab:orange", "#f6d7b0", "0.93", "tab:blue"


def _box(ax, x, y, w, h, text, face, edge="0.35", color="black", weight="normal", fontsize=8.5, lw=1.0):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", facecolor=face,
                                edgecolor=edge, lw=lw))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=color, weight=weight)


def _arrow(ax, a, b, color="0.45", rad=0.0):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=9, color=color, lw=1.0,
                                 connectionstyle=f"arc3,rad={rad}", shrinkA=2, shrinkB=2))


def you_are_here(notebook: str, ax=None):
    """Top: the ladder of notebooks, this one highlighted (the ones before it done, the ones
    after it ahead). Bottom: the engine's components, the ones this notebook changes in blue."""
    names = [n for n, _ in LADDER]
    if notebook not in names:
        raise ValueError(f"unknown notebook {notebook!r}: one of {', '.join(names)}")
    here = names.index(notebook)
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 1.9))
    ax.set_axis_off()
    w, gap = 1.3, 0.12
    for i, (name, title) in enumerate(LADDER):
        x = i * (w + gap)
        face = CURRENT if i == here else DONE if i < here else AHEAD
        _box(ax, x, 1.0, w, 0.66, title, face, color="white" if i == here else "black",
             weight="bold" if i == here else "normal", lw=1.6 if i == here else 0.8, fontsize=7.8)
        if i:
            _arrow(ax, (x - gap, 1.32), (x, 1.32))
    ax.text(here * (w + gap) + w / 2, 1.72, "you are here", ha="center", va="bottom", fontsize=8, color=CURRENT,
            weight="bold")
    cw = (len(LADDER) * (w + gap) - gap - (len(COMPONENTS) - 1) * 0.3) / len(COMPONENTS)
    touched = TOUCHES[notebook]
    for i, (name, what) in enumerate(COMPONENTS):
        x = i * (cw + 0.3)
        on = name in touched
        _box(ax, x, 0.0, cw, 0.68, f"{name}\n{what}", TOUCHED if on else "white", edge=TOUCHED if on else "0.6",
             color="white" if on else "0.35", weight="bold" if on else "normal", fontsize=8, lw=1.4 if on else 0.8)
        if i:
            _arrow(ax, (x - 0.3, 0.34), (x, 0.34))
    ax.text(-0.1, 0.34, "changes:", ha="right", va="center", fontsize=8, color=TOUCHED)
    ax.set_xlim(-1.0, len(LADDER) * (w + gap))
    ax.set_ylim(-0.05, 1.98)
    return ax


def architecture(ax=None):
    """The engine in one picture: a request's path from LLM.generate through the scheduler (with
    the block manager) and the model runner to the model and its kernels, and what each hands on."""
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 3.2))
    ax.set_axis_off()
    boxes = {  # name: (x, y, w, h)
        "LLM": (0.0, 1.2, 1.8, 0.9), "scheduler": (2.6, 1.2, 2.0, 0.9), "block manager": (2.6, -0.2, 2.0, 0.9),
        "model runner": (5.5, 1.2, 1.9, 0.9), "model": (8.5, 1.2, 1.9, 0.9), "kernels": (8.5, -0.2, 1.9, 0.9),
        "sampler": (11.1, 1.2, 1.5, 0.9),
    }
    what = {"LLM": "generate(prompts)", "scheduler": "who runs this step", "block manager": "KV blocks\nper sequence",
            "model runner": "builds the\nstep's tensors", "model": "linear, norm,\nattention layers",
            "kernels": "store K/V,\nattention", "sampler": "greedy or\nGumbel-max"}
    for name, (x, y, w, h) in boxes.items():
        _box(ax, x, y, w, h, f"{name}\n{what[name]}", "white", fontsize=8)
    flows = [("LLM", "scheduler", "requests"), ("scheduler", "model runner", "the step's sequences"),
             ("model runner", "model", "token ids, positions,\ncontext"), ("model", "sampler", "logits")]
    for a, b, label in flows:
        (xa, ya, wa, ha), (xb, yb, _, hb) = boxes[a], boxes[b]
        _arrow(ax, (xa + wa, ya + ha / 2), (xb, yb + hb / 2))
        ax.text((xa + wa + xb) / 2, ya + ha + 0.05, label, ha="center", va="bottom", fontsize=7.5, color="0.3")
    x, y, w, h = boxes["scheduler"]
    _arrow(ax, (x + w / 2 - 0.3, y), (x + w / 2 - 0.3, y - 0.5))
    _arrow(ax, (x + w / 2 + 0.3, y - 0.5), (x + w / 2 + 0.3, y))
    ax.text(x + w / 2 + 0.45, y - 0.25, "blocks, block tables", fontsize=7.5, color="0.3", va="center")
    x, y, w, h = boxes["model"]
    _arrow(ax, (x + w / 2, y), (x + w / 2, y - 0.5))
    ax.text(x + w / 2 + 0.12, y - 0.25, "attention: paged K/V", fontsize=7.5, color="0.3", va="center")
    x, y, w, h = boxes["sampler"]
    xs, ys, ws, hs = boxes["scheduler"]
    ax.add_patch(FancyArrowPatch((x + w / 2, y + h), (xs + ws / 2, ys + hs), arrowstyle="-|>", mutation_scale=9,
                                 color="0.45", lw=1.0, connectionstyle="arc3,rad=0.18", shrinkA=2, shrinkB=2))
    ax.text((x + xs + ws) / 2 + 0.5, 2.75, "one new token per sequence: the scheduler appends it, and the next step begins",
            ha="center", fontsize=7.5, color="0.3")
    ax.set_xlim(-0.2, 12.8)
    ax.set_ylim(-0.4, 3.0)
    return ax
