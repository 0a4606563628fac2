"""Where the checks get the stage's own code, and the model they run it on."""

import importlib
from types import ModuleType

import stages


def module(stage: str, name: str) -> ModuleType:
    """A stage's own module, e.g. module("03_paged", "engine.block_manager")."""
    return importlib.import_module(f"{stages.load(stage).__name__}.{name}")


def tiny_model() -> str:
    """The tiny random-weight Qwen3 of the notebooks (built once into .models/)."""
    from tools.tiny_model import cached_model

    return str(cached_model("tiny-qwen3", arch="qwen3"))


load = stages.load  # the stage package itself: load("03_paged").LLM, .SamplingParams


STAT_KEYS = ("num_seqs", "num_tokens", "kv_slots_reserved", "kv_slots_used", "blocks_used", "running", "waiting",
             "preemptions", "prefix_hit_tokens", "chunked_prefills")  # what a step's record says (no timings)
# kv_slots_used adds up each running sequence's cached tokens, so from stage 04 on a block that several sequences
# share counts once per sequence there and once in kv_slots_reserved: used > reserved is sharing, not an error.


def drive(llm, prompts: list[list[int]], params: list, *, max_steps: int, on_step=None):
    """Add the requests to the engine and step it until every one has finished, at most
    `max_steps` steps (a component that never lets a request finish must not hang the
    check). on_step(engine) runs after each step. Returns (completions, per-step records
    without timings); fails (ExerciseFailed) when the engine is not done in time. on_step gets
    the engine and {seq_id: request index}."""
    from .report import fail

    engine = llm.engine
    Sequence = importlib.import_module(f"{type(engine).__module__.rsplit('.', 1)[0]}.sequence").Sequence
    seqs = [Sequence(list(p), sp) for p, sp in zip(prompts, params)]
    for seq in seqs:
        engine.add(seq)
    index = {seq.seq_id: i for i, seq in enumerate(seqs)}
    for _ in range(max_steps):
        if engine.is_finished():
            break
        engine.step()
        if on_step:
            on_step(engine, index)
    else:
        if not engine.is_finished():
            fail(f"the engine had not finished after {max_steps} steps (the stage's own code needs far fewer): "
                 "a request that never gets a token, or blocks that are never given back?",
                 unfinished=[s.seq_id for s in seqs if not s.is_finished])
    records = [{k: r[k] for k in STAT_KEYS if k in r} for r in engine.stats]
    return [s.completion_token_ids for s in seqs], records


def first_difference(mine: list[dict], theirs: list[dict]) -> tuple[int, dict, dict] | None:
    """The first step whose records differ: (step, expected, got), or None."""
    for i, (a, b) in enumerate(zip(theirs, mine)):
        if a != b:
            return i, a, b
    if len(mine) != len(theirs):
        i = min(len(mine), len(theirs))
        return i, theirs[i] if i < len(theirs) else "no step", mine[i] if i < len(mine) else "no step"
    return None


def compare_runs(stage: str, options: dict, prompts: list[list[int]], max_tokens: list[int], install, what: str,
                 *, trace=None, inputs: dict | None = None) -> int:
    """Run one workload twice on the stage's engine (tiny model, greedy, ignore_eos): as the
    stage has it, and with install(llm) having put the learner's component in. The completions,
    every step's record and trace(engine, {seq_id: request index}) after every step (e.g. the block tables) must be the
    same. Exceptions raised inside the learner's code are reported, not re-raised. Returns the
    number of steps compared."""
    from .report import ExerciseFailed, fail

    st = load(stage)
    params = [st.SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    runs = []
    for mine in (False, True):
        traced = []
        with st.LLM(tiny_model(), device="cpu", **options) as llm:
            if mine:
                install(llm)
            on_step = (lambda engine, index: traced.append(trace(engine, index))) if trace else None
            try:
                outs, records = drive(llm, prompts, params, max_steps=4 * len(runs[0][1]) + 20 if runs else 10_000,
                                      on_step=on_step)
            except (ExerciseFailed, NotImplementedError):
                raise
            except Exception as exc:
                if not mine:
                    raise
                fail(f"the engine stopped with an error in {what}: {type(exc).__name__}: {exc}", **(inputs or {}))
        runs.append((outs, records, traced))
    (ref_outs, ref_records, ref_traced), (outs, records, traced) = runs
    diff = first_difference(records, ref_records)
    if diff:
        step, expected, got = diff
        changed = {k for k in expected if isinstance(got, dict) and got.get(k) != expected[k]} if isinstance(expected, dict) else set()
        fail(f"step {step} differs from the stage's run with its own {what}" + (f" ({', '.join(sorted(changed))})" if changed else ""),
             **(inputs or {}), expected=expected, got=got)
    diff = first_difference(traced, ref_traced)
    if diff:
        step, expected, got = diff
        fail(f"after step {step} the state differs from the stage's run with its own {what}", **(inputs or {}),
             expected=expected, got=got)
    if outs != ref_outs:
        i = next(i for i, (a, b) in enumerate(zip(outs, ref_outs)) if a != b)
        fail(f"the same schedule, but request {i}'s greedy tokens differ from the stage's run", **(inputs or {}),
             expected=ref_outs[i], got=outs[i])
    return len(ref_records)
