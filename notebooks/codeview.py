"""Put a stage's code on screen: the diff against the previous stage, one file's hunks, or the
source of a function, rendered as Markdown with links to the files (relative to notebooks/).

    import codeview
    codeview.diff_table("02_kvcache", "03_paged")        # what changed, file by file, with links
    codeview.diff("02_kvcache", "03_paged", "engine/block_manager.py")       # one file's diff
    codeview.diff("03_paged", "04_prefix_cache", "engine/block_manager.py", only=["def allocate"])
    codeview.source(BlockManager.allocate)                # a function or class, as the stage has it

The diff is `python -m tools.stages diff` (tools/stages.py), the same one instructors run. Its
output follows the stages' code, so cells that show code carry NBVAL_IGNORE_OUTPUT: a fix carried
forward by `tools.stages sync` must not break the notebooks' checks. What keeps the committed
listings true instead is the hidden last line of each one, `<!-- codeview: CALL -->`: the call that
made it, by value. `python -m tools.listings check` renders every such call again and fails on a
listing that differs (tests/test_listings.py runs it); `python -m tools.listings write` rewrites
the stale ones in place, without re-running the notebooks.
"""

import importlib
import inspect
import pathlib
import textwrap

from IPython.display import Markdown

from tools import stages as stage_tool

REPO = pathlib.Path(__file__).resolve().parent.parent
LINK_BASE = ".."  # the notebooks live one folder below the repo root


def _marked(text: str, call: str) -> Markdown:
    """The listing, ending with the call that renders it again (an HTML comment: nothing on screen)."""
    return Markdown(f"{text}\n\n<!-- codeview: {call} -->")


def _args(*args, **kwargs) -> str:
    return ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])


def _name(text: str) -> str:
    """A file name as Markdown shows it literally (`__init__.py`, not a bold "init.py")."""
    return f"`{text}`"


def link(path: str | pathlib.Path, text: str | None = None) -> str:
    """A Markdown link to a repo file, relative to notebooks/ (Jupyter and GitHub both follow it)."""
    rel = pathlib.Path(path).resolve().relative_to(REPO).as_posix() if pathlib.Path(path).is_absolute() else str(path)
    return f"[{text or rel}]({LINK_BASE}/{rel})"


def _pair(a: str, b: str):
    return stage_tool.resolve(REPO, a), stage_tool.resolve(REPO, b)


def diff_table(a: str, b: str) -> Markdown:
    """Every file that differs between stages a and b: status, lines added and removed, links."""
    old, new = _pair(a, b)
    diffs = stage_tool.diff_stages(old, new)
    rows = ["| file | status | lines |", "|---|---|--:|"]  # three columns: narrow enough for a phone
    for d in diffs:
        target = f"{new.rel}/{d.path}" if d.status != "removed" else f"{old.rel}/{d.path}"
        rows.append(f"| {link(target, _name(d.path))} | {d.status} | +{d.added} −{d.removed} |")
    added, removed = sum(d.added for d in diffs), sum(d.removed for d in diffs)
    head = (f"`python -m tools.stages diff {old.name} {new.name}`: {len(diffs)} files, +{added} −{removed} lines "
            f"({link(new.rel + '/README.md', new.name + ' README')})")
    return _marked(head + "\n\n" + "\n".join(rows), f"diff_table({_args(a, b)})")


def _hunks(lines: list[str]) -> list[list[str]]:
    """Split a unified diff (past its ---/+++ header) into hunks, each starting with its @@ line."""
    hunks: list[list[str]] = []
    for line in lines[2:]:
        if line.startswith("@@"):
            hunks.append([])
        if hunks:
            hunks[-1].append(line)
    return hunks


def diff(a: str, b: str, path: str, *, only: list[str] | None = None, context: int = 3) -> Markdown:
    """The diff of one file between stages a and b. `only`: keep the hunks that mention one of
    these strings (e.g. ["def allocate", "block_hash"]); by default every hunk."""
    old, new = _pair(a, b)
    before = (old.path / path).read_bytes() if (old.path / path).exists() else None
    after = (new.path / path).read_bytes() if (new.path / path).exists() else None
    lines = list(stage_tool.difflib.unified_diff(stage_tool._text_lines(before), stage_tool._text_lines(after),
                                                 f"a/{old.rel}/{path}", f"b/{new.rel}/{path}", n=context))
    hunks = _hunks(lines)
    if only:
        hunks = [h for h in hunks if any(s in line for line in h for s in only)]
    body = "".join(line if line.endswith("\n") else line + "\n" for h in hunks for line in h)
    shown = "" if not only else f" (the hunks that mention {', '.join(f'`{s}`' for s in only)})"
    text = f"{link(f'{new.rel}/{path}', _name(f'{new.name}/{path}'))}{shown}:\n\n```diff\n{body}```"
    return _marked(text, f"diff({_args(a, b, path, only=only, context=context)})")


def _address(obj) -> str:
    """'module:qualname' of a function or class, the form `resolve` reads back."""
    module = obj.__module__.removeprefix("notebooks.")  # notebooks/ is the kernel's folder: exercises.ex04
    return f"{module}:{obj.__qualname__}"


def resolve(address: str):
    """The function or class at 'module:qualname' (a Triton kernel: its Python function)."""
    module, _, qualname = address.partition(":")
    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError:  # exercises.exkernels, imported from notebooks/, is notebooks.exercises... here
        obj = importlib.import_module(f"notebooks.{module}")
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return getattr(obj, "fn", obj) if not inspect.isroutine(obj) and not inspect.isclass(obj) else obj


def source(obj, *, title: str | None = None) -> Markdown:
    """The source of a function, method or class, with a link to the file and line it comes from.
    `obj` may also be its address, 'module:qualname'."""
    obj = resolve(obj) if isinstance(obj, str) else obj
    obj = inspect.unwrap(obj)  # past decorators such as torch.inference_mode
    lines, start = inspect.getsourcelines(obj)
    path = pathlib.Path(inspect.getsourcefile(obj)).resolve()
    rel = path.relative_to(REPO).as_posix()
    name = title or getattr(obj, "__qualname__", getattr(obj, "__name__", "source"))
    code = textwrap.dedent("".join(lines))
    text = f"`{name}` in {link(rel)}, line {start}:\n\n```python\n{code.rstrip()}\n```"
    return _marked(text, f"source({_args(_address(obj), title=title)})")
