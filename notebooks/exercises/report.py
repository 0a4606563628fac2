"""The reporting helper every check shares: run a check, print its verdict, explain a failure."""

import importlib
import os
from collections.abc import Callable, Sequence

import torch


class ExerciseFailed(AssertionError):
    """A check found a wrong answer. Jupyter shows the message alone, without a traceback."""

    def _render_traceback_(self) -> list[str]:  # IPython calls this instead of printing a traceback
        return [f"\N{BALLOT X} {line}" if i == 0 else f"  {line}" for i, line in enumerate(str(self).splitlines())]


NOT_WRITTEN = "\N{WHITE CIRCLE}"  # the verdict of an exercise not written yet: never the tick of a pass


def run(check: Callable[[Callable], str], fn: Callable) -> Callable:
    """Run `check(fn)` and print its verdict; return the function that passed.

    A stub that raises NotImplementedError is not written yet. The verdict says so, with a mark
    of its own (never the tick of a pass): "not written yet — reference shown". The check then
    runs on the reference solution (solutions/exNN.py, same name), so that the cells below have
    a working function and the notebook runs top to bottom unattended; EXERCISES_STRICT=1 makes
    an unwritten stub an error instead."""
    try:
        summary = check(fn)
    except NotImplementedError:
        if os.environ.get("EXERCISES_STRICT") == "1":
            raise ExerciseFailed(f"{fn.__name__} is not written yet: it raises NotImplementedError") from None
        solution = reference(check, fn.__name__)
        module = check.__module__.rsplit(".", 1)[-1]
        summary = check(solution)
        print(f"{NOT_WRITTEN} {fn.__name__}: not written yet \N{EM DASH} reference shown. Your stub raises "
              f"NotImplementedError, so nothing of yours was checked; the cells below use the reference solution "
              f"(notebooks/exercises/solutions/{module}.py), on which the check says: {summary}")
        return solution
    print(f"\N{CHECK MARK} {fn.__name__}: {summary}")
    return fn


def reference(check: Callable, name: str | None = None) -> Callable:
    """The reference solution a check belongs to: check_NAME in exNN.py -> NAME in solutions/exNN.py,
    or, for a class (check_block_manager -> BlockManager), the stub's own name."""
    package, module = check.__module__.rsplit(".", 1)
    solutions = importlib.import_module(f"{package}.solutions.{module}")
    found = getattr(solutions, check.__name__.removeprefix("check_"), None)
    return found if found is not None else getattr(solutions, name)


# ---- what the checks use to say what is wrong ----


def fail(what: str, **details) -> None:
    """Stop the check: `what` went wrong; each detail (input=..., expected=..., got=...) on its own line."""
    width = max((len(k) for k in details), default=0)
    lines = [what] + [f"{k.replace('_', ' ') + ':':<{width + 1}} {show(v)}" for k, v in details.items()]
    raise ExerciseFailed("\n".join(lines))


def expect_equal(got, expected, what: str, **inputs) -> None:
    """Fail unless got == expected (lists, ints, tensors compared exactly)."""
    if isinstance(expected, torch.Tensor):
        same = isinstance(got, torch.Tensor) and got.shape == expected.shape and torch.equal(got.to(expected.dtype), expected)
    else:
        same = _plain(got) == _plain(expected)
    if not same:
        details = dict(inputs, expected=expected, got=got)
        mine, theirs = _plain(got), _plain(expected)
        if isinstance(mine, list) and isinstance(theirs, list) and max(len(mine), len(theirs)) > 8:
            i = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            details["first_difference"] = (f"at index {i}: expected {theirs[i] if i < len(theirs) else 'nothing'}, "
                                           f"got {mine[i] if i < len(mine) else 'nothing'} "
                                           f"(lengths {len(theirs)} and {len(mine)})")
        fail(what, **details)


def expect_close(got, expected: torch.Tensor, what: str, atol: float = 1e-4, **inputs) -> None:
    """Fail unless got is a tensor of expected's shape, equal to it within atol."""
    if not isinstance(got, torch.Tensor):
        fail(what, **inputs, expected=f"a tensor of shape {tuple(expected.shape)}", got=type(got).__name__)
    if got.shape != expected.shape:
        fail(what, **inputs, expected=f"shape {tuple(expected.shape)}", got=f"shape {tuple(got.shape)}")
    err = (got.float() - expected.float()).abs()
    if not torch.isfinite(got.float()).all() or err.max() > atol:
        where = tuple(int(i) for i in (err.nan_to_num(float("inf")).flatten().argmax().item(),))
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(where[0]), expected.shape))
        fail(what, **inputs, largest_error=f"{err.nan_to_num(float('inf')).max().item():.3g} at index {index} "
             f"(expected {expected[index].item():.4f}, got {got[index].item():.4f})")


def _plain(value):
    """Tensors and tuples as lists, so that a learner may return either."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def show(value, limit: int = 24) -> str:
    """A short, readable rendering of an input or a result."""
    if isinstance(value, tuple) and all(isinstance(v, int) for v in value):
        return str(value)  # a shape
    value = _plain(value)
    if isinstance(value, Sequence) and not isinstance(value, str) and len(value) > limit:
        return f"[{', '.join(map(str, value[:limit]))}, ...] ({len(value)} items)"
    return str(value)
