"""Put a stage's code on screen: the diff against the previous stage, one file's hunks, or the
source of a function, rendered as Markdown with links to the files (relative to notebooks/).

    import codeview
    codeview.diff_table("02_kvcache", "03_paged")        # what changed, file by file, with links
    codeview.diff("02_kvcache", "03_paged", "engine/block_manager.py")       # one file's diff
    codeview.diff("03_paged", "04_prefix_cache", "engine/block_manager.py", only=["def allocate"])
    codeview.source(BlockManager.allocate)                # a function or class, as the stage has it

The diff is `python -m tools.stages diff` (tools/stages.py), the same one instructors run. Its
output follows the stages' code, so cells that show code carry NBVAL_IGNORE_OUTPUT: a fix carried
forward by `tools.stages sync` must not break the notebooks' checks.
"""

import inspect
import pathlib
import textwrap

from IPython.display import Markdown

from tools import stages as stage_tool

REPO = pathlib.Path(__file__).resolve().parent.parent
LINK_BASE = ".."  # the notebooks live one folder below the repo root


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
    rows = ["| file | status | + | − |", "|---|---|--:|--:|"]
    for d in diffs:
        target = f"{new.rel}/{d.path}" if d.status != "removed" else f"{old.rel}/{d.path}"
        rows.append(f"| {link(target, d.path)} | {d.status} | +{d.added} | −{d.removed} |")
    added, removed = sum(d.added for d in diffs), sum(d.removed for d in diffs)
    head = (f"`python -m tools.stages diff {old.name} {new.name}`: {len(diffs)} files, +{added} −{removed} lines "
            f"({link(new.rel + '/README.md', new.name + ' README')})")
    return Markdown(head + "\n\n" + "\n".join(rows))


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
    return Markdown(f"{link(f'{new.rel}/{path}', f'{new.name}/{path}')}{shown}:\n\n```diff\n{body}```")


def source(obj, *, title: str | None = None) -> Markdown:
    """The source of a function, method or class, with a link to the file and line it comes from."""
    obj = inspect.unwrap(obj)  # past decorators such as torch.inference_mode
    lines, start = inspect.getsourcelines(obj)
    path = pathlib.Path(inspect.getsourcefile(obj)).resolve()
    rel = path.relative_to(REPO).as_posix()
    name = title or getattr(obj, "__qualname__", getattr(obj, "__name__", "source"))
    code = textwrap.dedent("".join(lines))
    return Markdown(f"`{name}` in {link(rel)}, line {start}:\n\n```python\n{code.rstrip()}\n```")
