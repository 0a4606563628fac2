"""Where an engine step's time goes: torch.profiler around `llm.generate`, per engine step.

    from benchmarks.profiling import profile_generate
    report = profile_generate(llm, prompts, sampling, active_steps=range(0, 40))

Each engine step (`llm.engine.step`) is wrapped in a profiler annotation, and so is the
sampler's forward (`llm.engine.model_runner.sampler`), when the engine has them. Every GPU
activity (kernel, copy, memset) is charged to the step whose host code launched it, found
through the profiler's correlation ids (kernels replayed from a CUDA graph carry the graph
launch's id). Per step:

    wall_ms      the step's host wall time (under the profiler: somewhat inflated)
    gpu_ms       GPU busy time: the union of its activities' intervals
    sampling_ms  GPU time of what the sampler launched
    idle_ms      wall_ms - gpu_ms: the GPU waiting for the host (synchronous engines)
    before_ms    from the step's start to its first GPU activity (host work nothing overlaps)
    after_ms     from its last GPU activity's end to the step's end (reading and resolving; 0
                 where the GPU ran past it, as an overlapped step's does)
    kernels      number of GPU activities

Each step also keeps the GPU's idle gaps between its activities, each gap charged to the pair
of activities around it ("previous -> next": the gap before a CUDA graph's first kernel is its
launch). Per kind of step (prefill: any sequence feeds more than one token; decode): the
means, the kernels that take the most GPU time and the largest gaps.
"""

import bisect
import collections
import contextlib
import statistics

import torch
from torch.profiler import ProfilerActivity, profile, record_function

STEP, SAMPLE = "nanovllm_step_", "nanovllm_sample"


class _Counter:
    value = 0
    on_step = None


@contextlib.contextmanager
def annotated(llm):
    """Wrap llm.engine.step and the sampler's forward in profiler annotations (undone on exit)."""
    engine = getattr(llm, "engine", None)
    runner = getattr(engine, "model_runner", None)
    sampler = getattr(runner, "sampler", None)
    counter = _Counter()
    patched = []
    if engine is not None and hasattr(engine, "step"):
        step = engine.step

        def annotated_step(*args, **kwargs):
            with record_function(f"{STEP}{counter.value}"):
                counter.value += 1
                out = step(*args, **kwargs)
            if counter.on_step is not None:
                counter.on_step()  # advance the profiler's schedule
            return out

        engine.step = annotated_step
        patched.append((engine, "step"))
    if isinstance(sampler, torch.nn.Module):
        forward = sampler.forward

        def annotated_forward(*args, **kwargs):
            with record_function(SAMPLE):
                return forward(*args, **kwargs)

        sampler.forward = annotated_forward
        patched.append((sampler, "forward"))
    try:
        yield counter
    finally:
        for obj, name in patched:
            delattr(obj, name)  # the instance attribute goes; the class's method shows again


def _is_gpu(event) -> bool:
    return event.device_type() == torch.autograd.DeviceType.CUDA


def _union_ms(intervals: list[tuple[int, int]]) -> float:
    busy, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy / 1e6


def short_name(name: str) -> str:
    """A kernel's name without its template and argument lists."""
    return name.split("(")[0].split("<")[0].strip()[:60]


def _gaps(
    intervals: list[tuple[int, int, str]],
) -> tuple[int | None, int | None, collections.Counter]:
    """(first start, last end, idle ns per "previous -> next" pair) of a step's activities."""
    gaps, end, previous = collections.Counter(), None, None
    for start, stop, name in sorted(intervals):
        if end is not None and start > end:
            gaps[f"{previous} -> {name}"] += start - end
        if end is None or stop > end:
            end, previous = stop, name
    return (min(intervals)[0] if intervals else None), end, gaps


def analyze(events) -> list[dict]:
    """Per-step rows from the profiler's raw (kineto) events; see the module docstring."""
    steps, samples, launches, gpu = {}, [], {}, []
    for e in events:
        name = e.name()
        if _is_gpu(e):
            if not name.startswith(
                (STEP, SAMPLE)
            ):  # the profiler mirrors annotations onto the GPU timeline
                gpu.append(e)
        elif name.startswith(STEP):
            steps[int(name[len(STEP) :])] = (e.start_ns(), e.end_ns())
        elif name == SAMPLE:
            samples.append((e.start_ns(), e.end_ns()))
        elif name.startswith("cu"):  # CUDA runtime/driver calls: kernel and graph launches, copies
            launches[e.correlation_id()] = e.start_ns()
    order = sorted(steps, key=lambda i: steps[i][0])
    starts = [steps[i][0] for i in order]

    def step_of(t: int) -> int | None:
        k = bisect.bisect_right(starts, t)  # the last step that started at or before t
        return order[k - 1] if k and t <= steps[order[k - 1]][1] else None

    per_step = {
        i: {"intervals": [], "sampling_ns": 0, "kernels": 0, "names": collections.Counter()}
        for i in steps
    }
    for e in gpu:
        launched = launches.get(e.correlation_id(), e.start_ns())  # fallback: when it ran
        i = step_of(launched)
        if i is None:
            continue
        rec = per_step[i]
        rec["intervals"].append((e.start_ns(), e.end_ns(), short_name(e.name())))
        rec["kernels"] += 1
        rec["names"][e.name()] += e.duration_ns()
        if any(a <= launched <= b for a, b in samples):
            rec["sampling_ns"] += e.duration_ns()
    rows = []
    for i in order:
        rec, (a, b) = per_step[i], steps[i]
        gpu_ms = _union_ms([(start, stop) for start, stop, _ in rec["intervals"]])
        first, last, gaps = _gaps(rec["intervals"])
        rows.append(
            {
                "step": i,
                "wall_ms": (b - a) / 1e6,
                "gpu_ms": gpu_ms,
                "sampling_ms": rec["sampling_ns"] / 1e6,
                "idle_ms": max(0.0, (b - a) / 1e6 - gpu_ms),
                "before_ms": ((first if first is not None else b) - a) / 1e6,
                "after_ms": max(0, b - (last if last is not None else b)) / 1e6,
                "kernels": rec["kernels"],
                "names": rec["names"],
                "gaps": gaps,
            }
        )
    return rows


def summarize(rows: list[dict], kinds: dict[int, str], top: int = 12) -> dict:
    """Means per kind of step, the kernels taking the most GPU time and the largest idle gaps;
    drops the rows' kernel names and gaps."""
    summary, top_kernels, top_gaps = {}, {}, {}
    for row in rows:
        row["kind"] = kinds.get(row["step"], "?")
    for kind in sorted({r["kind"] for r in rows}):
        mine = [r for r in rows if r["kind"] == kind]
        summary[kind] = {"steps": len(mine)} | {
            f"mean_{key}": statistics.fmean(r[key] for r in mine)
            for key in (
                "wall_ms",
                "gpu_ms",
                "sampling_ms",
                "idle_ms",
                "before_ms",
                "after_ms",
                "kernels",
            )
        }
        names, gaps = collections.Counter(), collections.Counter()
        for r in mine:
            names.update(r["names"])
            gaps.update(r["gaps"])
        top_gaps[kind] = [
            {"between": pair, "ms_per_step": ns / 1e6 / len(mine)}
            for pair, ns in gaps.most_common(top)
        ]
        total = sum(names.values()) or 1
        top_kernels[kind] = [
            {"name": n[:120], "ms_per_step": ns / 1e6 / len(mine), "share": ns / total}
            for n, ns in names.most_common(top)
        ]
    return {
        "steps": [{k: v for k, v in r.items() if k not in ("names", "gaps")} for r in rows],
        "summary": summary,
        "top_kernels": top_kernels,
        "top_gaps": top_gaps,
    }


def prefill_or_decode(stats_row: dict) -> str:
    return "prefill" if stats_row.get("is_prefill") else "decode"


def profile_generate(
    llm,
    prompts,
    sampling,
    every: int | None = None,
    active: int = 10,
    top: int = 12,
    kind_of=prefill_or_decode,
) -> dict:
    """Run llm.generate(prompts, sampling) under torch.profiler; return `summarize`'s report.
    every=None profiles every step (keep such runs short); every=N profiles `active` steps
    out of each N (windows, each analysed as it closes), so that long runs stay cheap.
    `kind_of`: a step's kind from its llm.stats row."""
    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    )
    before, rows = len(llm.stats), []
    schedule = None
    if every is not None:
        assert every >= active + 2
        schedule = torch.profiler.schedule(wait=every - active - 1, warmup=1, active=active)
    with (
        annotated(llm) as counter,
        profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=lambda p: rows.extend(analyze(p.profiler.kineto_results.events())),
        ) as prof,
    ):
        counter.on_step = prof.step if schedule is not None else None
        llm.generate(prompts, sampling, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    if schedule is None:
        rows = analyze(prof.profiler.kineto_results.events())
    stats = list(llm.stats)[before:]
    kinds = {i: kind_of(s) for i, s in enumerate(stats)}
    return summarize(rows, kinds, top) | {"num_steps": len(stats), "profiled_steps": len(rows)}
