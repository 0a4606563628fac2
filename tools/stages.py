"""Keep the copy-forward stage ladder honest: list, diff, check and sync stages.

Every stage under ``stages/NN_name/`` is a full copy of the engine; ``nanovllm_final/`` comes after
the last stage with the same layout. A stage's README.md declares the files its lesson touches::

    ## Files changed

    - `engine/scheduler.py` — admits requests while blocks are free
    - `engine/block_manager.py` — new: the block table

Usage (every command also takes ``--root PATH``, default: the repo root)::

    python -m tools.stages list
    python -m tools.stages diff 03 04 [--stat] [--raw]  # names: 03_paged, 03, 3, paged, stages/03_paged, final
    python -m tools.stages check                        # the listings and the marker rule, rung by rung
    python -m tools.stages sync 02 [--to 07] [--ref HEAD] [--dry-run]   # carry 02's edits into 03.. (and final)

The final engine's README may hold the same section: then `check` compares it with the last
stage too, so its list of the files final adds or changes cannot go stale.

Stage markers. A `NEW in NN_name:` comment, or a docstring that opens with it, marks a block
that is the lesson of stage NN_name. The rule: a stage carries markers naming itself only, and
nanovllm_final carries none. So each stage marks only what it adds and the stage after it drops
them: `# NEW in 04_prefix_cache: now shareable` in 04 reads `# now shareable` in 05, a
docstring's `NEW in 03_paged: the cache is ...` reads `The cache is ...`, and a bare trailing
`# NEW in 04_prefix_cache` goes. `check` fails on any other marker. Dropping the previous
rung's markers is not part of a lesson: `diff` and `check` read the earlier rung with its own
markers dropped (`diff --raw` shows the files as they are), and `sync` drops the source
stage's markers from what it carries into later rungs.
"""

import argparse
import ast
import difflib
import re
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stages import FINAL  # the one stage-name resolver, shared with stages.load
from stages import resolve as resolve_name

REPO_ROOT = Path(__file__).resolve().parents[1]
STAGES_DIR = "stages"
FINAL_DIR = "nanovllm_final"
STAGE_NAME = re.compile(r"\d\d_.+")
IGNORED_DIRS = {"__pycache__", ".ipynb_checkpoints"}
IGNORED_SUFFIXES = (".pyc",)
README = "README.md"
SECTION = "## Files changed"
SECTION_END = re.compile(r"#{1,2}\s")  # the next level-1 or level-2 heading ends the section
LISTED_FILE = re.compile(r"- `([^`]+)`")
MARKER = re.compile(r"NEW in (\d\d_\w+)")
BARE_MARKER = re.compile(
    r"\s*#\s*NEW in (\d\d_\w+)\s*$"
)  # "code  # NEW in 04_prefix_cache", nothing after
LEADING_MARKER = re.compile(r"NEW in (\d\d_\w+): ?")
DOCSTRING_QUOTES = ('"""', "'''")


class StageError(Exception):
    """A problem the user must fix (unknown stage, bad git ref, ...); printed without a traceback."""


@dataclass(frozen=True)
class Stage:
    name: str  # folder name ("03_paged"), or "final"
    rel: str  # folder relative to the root, posix ("stages/03_paged", "nanovllm_final")
    root: Path

    @property
    def path(self) -> Path:
        return self.root / self.rel


# ---------------------------------------------------------------------------------------- the ladder


def ladder(root: Path) -> list[Stage]:
    """The stages in ladder order (final not included)."""
    folder = root / STAGES_DIR
    if not folder.is_dir():
        return []
    names = sorted(p.name for p in folder.iterdir() if p.is_dir() and STAGE_NAME.fullmatch(p.name))
    return [Stage(name, f"{STAGES_DIR}/{name}", root) for name in names]


def final_stage(root: Path) -> Stage | None:
    return Stage(FINAL, FINAL_DIR, root) if (root / FINAL_DIR).is_dir() else None


def full_ladder(root: Path) -> list[Stage]:
    """The stages followed by final, where it exists."""
    final = final_stage(root)
    return ladder(root) + ([final] if final else [])


def resolve(root: Path, name: str) -> Stage:
    """Find a stage by any name stages.load accepts: folder name ("03_paged"), number ("03", "3"),
    bare name ("paged"), path ("stages/03_paged"), module ("stages.03_paged") or "final"."""
    choices = full_ladder(root)
    if not choices:
        raise StageError(f"unknown stage {name!r}: no {STAGES_DIR}/NN_name folders under {root}")
    try:
        found = resolve_name(name, [stage.name for stage in choices])
    except ValueError as err:
        raise StageError(str(err)) from None
    return next(stage for stage in choices if stage.name == found)


def is_ignored(rel: str) -> bool:
    parts = rel.split("/")
    return any(part in IGNORED_DIRS for part in parts) or parts[-1].endswith(IGNORED_SUFFIXES)


def read_tree(folder: Path) -> dict[str, bytes]:
    """Every file under folder, keyed by its posix path relative to folder."""
    files = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and not is_ignored(rel):
            files[rel] = path.read_bytes()
    return files


def compare(old: dict[str, bytes], new: dict[str, bytes]) -> dict[str, str]:
    """The files that differ, as {path: "added" | "removed" | "modified"}, sorted by path."""
    status = {}
    for path in sorted(old.keys() | new.keys()):
        if path not in old:
            status[path] = "added"
        elif path not in new:
            status[path] = "removed"
        elif old[path] != new[path]:
            status[path] = "modified"
    return status


# ------------------------------------------------------------------------------------------- markers


def _unmark_line(line: str, drop: Callable[[str], bool]) -> str | None:
    """`line` (no line ending) without the markers `drop(name)` selects; None: nothing is left."""
    bare = BARE_MARKER.search(line)
    if bare and drop(bare[1]):
        kept = line[: bare.start()]
        return kept if kept.strip() else None
    out, pos = [], 0
    for match in LEADING_MARKER.finditer(line):
        if not drop(match[1]):
            continue
        before = line[: match.start()]
        out.append(line[pos : match.start()])
        pos = match.end()
        opens_prose = "#" not in before and (
            not before.strip() or before.rstrip().endswith(DOCSTRING_QUOTES)
        )
        if (
            opens_prose and line[pos : pos + 1].islower()
        ):  # a docstring's first word: now a sentence's
            out.append(line[pos].upper())
            pos += 1
    return "".join(out) + line[pos:]


def drop_markers(text: str, keep: str | None = None) -> str:
    """`text` without the stage markers that name a stage other than `keep` (None: all of them)."""
    drop = lambda name: name != keep
    if not any(drop(m[1]) for m in MARKER.finditer(text)):
        return text
    lines = []
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        kept = _unmark_line(body, drop) if MARKER.search(body) else body
        if kept is not None:
            lines.append(kept + line[len(body) :])
    return "".join(lines)


def drop_markers_bytes(data: bytes | None, keep: str | None = None) -> bytes | None:
    if data is None or b"NEW in " not in data:
        return data
    try:
        return drop_markers(data.decode("utf-8"), keep).encode("utf-8")
    except UnicodeDecodeError:
        return data


def read_tree_unmarked(stage: Stage) -> dict[str, bytes]:
    """A rung's files as the next rung inherits them: its own markers dropped."""
    return {path: drop_markers_bytes(data) for path, data in read_tree(stage.path).items()}


def marker_problems(stage: Stage) -> list[str]:
    """Markers in `stage` that name another stage (in final: any marker). READMEs are prose, not code."""
    own = None if stage.name == FINAL else stage.name
    why = (
        "the final engine carries no stage markers"
        if own is None
        else f"{stage.name} marks only what it adds"
    )
    problems = []
    for path, data in read_tree(stage.path).items():
        if path.endswith(".md"):
            continue
        for lineno, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            problems += [
                f"{stage.rel}/{path}:{lineno}: marker 'NEW in {m[1]}' ({why}; drop it)"
                for m in MARKER.finditer(line)
                if m[1] != own
            ]
    return problems


# ---------------------------------------------------------------------------------------------- diff


@dataclass
class FileDiff:
    path: str
    status: str
    added: int
    removed: int
    lines: list[str]


def _text_lines(data: bytes | None) -> list[str]:
    return [] if data is None else data.decode("utf-8", errors="replace").splitlines(keepends=True)


def _terminated(line: str) -> str:
    return line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"


def file_diff(
    a: Stage, b: Stage, path: str, status: str, old: bytes | None, new: bytes | None
) -> FileDiff:
    fromfile = "/dev/null" if old is None else f"a/{a.rel}/{path}"
    tofile = "/dev/null" if new is None else f"b/{b.rel}/{path}"
    lines = list(difflib.unified_diff(_text_lines(old), _text_lines(new), fromfile, tofile))
    body = lines[2:]  # past the ---/+++ header
    added = sum(line.startswith("+") for line in body)
    removed = sum(line.startswith("-") for line in body)
    return FileDiff(path, status, added, removed, [_terminated(line) for line in lines])


def diff_stages(a: Stage, b: Stage, raw: bool = False) -> list[FileDiff]:
    """b against a; unless raw, a is read with its own markers dropped, as the rung after it inherits it."""
    old, new = (read_tree(a.path) if raw else read_tree_unmarked(a)), read_tree(b.path)
    return [
        file_diff(a, b, path, status, old.get(path), new.get(path))
        for path, status in compare(old, new).items()
    ]


def print_table(a: Stage, b: Stage, diffs: list[FileDiff]) -> None:
    if not diffs:
        print(f"{a.rel} and {b.rel} are identical")
        return
    width = max(len("path"), *(len(d.path) for d in diffs))
    print(f"{'path':<{width}}  {'status':<8}  {'+lines':>7}  {'-lines':>7}")
    for d in diffs:
        print(
            f"{d.path:<{width}}  {d.status:<8}  {'+' + str(d.added):>7}  {'-' + str(d.removed):>7}"
        )
    added, removed = sum(d.added for d in diffs), sum(d.removed for d in diffs)
    print(f"{a.rel} -> {b.rel}: {len(diffs)} file(s) changed, +{added} -{removed}")


def cmd_diff(args: argparse.Namespace) -> int:
    a, b = resolve(args.root, args.a), resolve(args.root, args.b)
    diffs = diff_stages(a, b, raw=args.raw)
    print_table(a, b, diffs)
    if not args.stat:
        for d in diffs:
            sys.stdout.writelines(d.lines)
    return 0


# --------------------------------------------------------------------------------------------- check


def parse_files_changed(readme: str) -> set[str] | None:
    """The paths listed under '## Files changed', or None when the README has no such section."""
    lines = readme.splitlines()
    starts = [i for i, line in enumerate(lines) if line.rstrip() == SECTION]
    if not starts:
        return None
    listed = set()
    for line in lines[starts[0] + 1 :]:
        if SECTION_END.match(line):
            break
        if LISTED_FILE.match(line):  # "- `a.py` — why", or "- `a.py`, `b.py` — why"
            names = line.split(" — ", 1)[0]
            listed.update(
                name.strip().removeprefix("./") for name in re.findall(r"`([^`]+)`", names)
            )
    return listed - {README}


def declared_files(stage: Stage) -> set[str] | None:
    """The stage README's listing; None when the README or its section is missing."""
    readme = stage.path / README
    return parse_files_changed(readme.read_text(encoding="utf-8")) if readme.is_file() else None


def missing_listing(stage: Stage) -> str:
    """Why declared_files(stage) is None."""
    return f"has no '{SECTION}' section" if (stage.path / README).is_file() else "is missing"


def check_pair(prev: Stage, stage: Stage) -> list[str]:
    """Problems with stage's README listing, compared with what really changed since prev."""
    listed = declared_files(stage)
    if listed is None:
        return [
            f"{stage.rel}/{README} {missing_listing(stage)}: it must list the files that differ from {prev.rel}"
        ]
    changed = compare(read_tree_unmarked(prev), read_tree(stage.path))
    changed.pop(README, None)
    unlisted = [
        f"{stage.rel}/{p}: {s} vs {prev.name} but not listed in {README}"
        for p, s in changed.items()
        if p not in listed
    ]
    stale = [
        f"{stage.rel}/{p}: listed in {README} but identical to {prev.name} (stale listing)"
        for p in sorted(listed - changed.keys())
    ]
    return unlisted + stale


def pairs_to_check(root: Path) -> list[tuple[Stage, Stage]]:
    stages = ladder(root)
    pairs = list(zip(stages, stages[1:]))
    final = final_stage(root)
    if final and stages:
        if (
            declared_files(final) is None
        ):  # the ladder's end: a product written once, not a copy of the last stage
            print(
                f"skip final: {FINAL_DIR}/{README} {missing_listing(final)} (the ladder's end, not compared with {stages[-1].name})"
            )
        else:
            pairs.append((stages[-1], final))
    return pairs


def print_problems(stage: Stage, found: list[str]) -> None:
    print(f"FAIL {stage.name}:")
    print("\n".join(f"  {problem}" for problem in found))


def cmd_check(args: argparse.Namespace) -> int:
    stages = ladder(args.root)
    if not stages:
        raise StageError(f"no {STAGES_DIR}/NN_name folders under {args.root}")
    problems = []
    first, final, compared = stages[0], final_stage(args.root), pairs_to_check(args.root)
    unpaired = [first] + ([final] if final and all(stage != final for _, stage in compared) else [])
    for stage in unpaired:  # compared with nothing, but the marker rule holds for them too
        if found := marker_problems(stage):
            problems += found
            print_problems(stage, found)
        elif stage == first:
            print(f"skip {first.name}: first stage, nothing to compare with")
    for prev, stage in compared:
        if found := check_pair(prev, stage) + marker_problems(stage):
            problems += found
            print_problems(stage, found)
        else:
            marks = (
                "carries no stage markers" if stage.name == FINAL else "marks only its own lesson"
            )
            print(
                f"OK   {stage.name}: differs from {prev.name} only in the files its README lists, {marks}"
            )
    if problems:
        print(f"check failed: {len(problems)} problem(s)")
        return 1
    return 0


# ---------------------------------------------------------------------------------------------- sync


def git(root: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True)


def files_at_ref(src: Stage, ref: str) -> dict[str, bytes]:
    """src's files as committed at ref (paths relative to src)."""
    if git(src.root, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}").returncode != 0:
        raise StageError(f"{ref!r} is not a commit in a git repository at {src.root}")
    listing = git(
        src.root, "ls-tree", "-r", "-z", "--name-only", ref, "--", f"{src.rel}/"
    ).stdout.decode()
    prefix = f"{src.rel}/"
    paths = [p.removeprefix(prefix) for p in listing.split("\0") if p]
    return {
        p: git(src.root, "show", f"{ref}:./{prefix}{p}").stdout for p in paths if not is_ignored(p)
    }


def source_changes(src: Stage, ref: str) -> dict[str, tuple[bytes | None, bytes | None]]:
    """{path: (base at ref, new in the working tree)} for every file of src that changed; None = absent."""
    base, new = files_at_ref(src, ref), read_tree(src.path)
    return {path: (base.get(path), new.get(path)) for path in compare(base, new)}


@dataclass
class Action:
    status: str  # copied | merged | up-to-date | CONFLICT | kept | skipped
    content: bytes | None = None  # what to write, for copied and merged
    note: str = ""


def merge3(ours: bytes, base: bytes, theirs: bytes) -> subprocess.CompletedProcess[bytes]:
    """git merge-file -p: stdout is the merge, returncode the number of conflicts (>127: error)."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / name for name in ("ours", "base", "theirs")]
        for path, data in zip(paths, (ours, base, theirs)):
            path.write_bytes(data)
        return subprocess.run(["git", "merge-file", "-p", *map(str, paths)], capture_output=True)


def plan(current: bytes | None, base: bytes | None, new: bytes | None, src: Stage) -> Action:
    """What to do with one target file, given the source change base -> new (both read as the
    target inherits them: without the source's markers)."""
    base, new = drop_markers_bytes(base), drop_markers_bytes(new)
    if current == new:
        return Action("up-to-date")
    if new is None:
        return Action("kept", note=f"deleted in {src.name}; delete it here by hand if that applies")
    if current == base:  # untouched by the target (or a file new in the source)
        return Action("copied", new)
    if current is None:
        return Action(
            "skipped", note="this stage has no such file; apply the change by hand if needed"
        )
    result = merge3(current, base or b"", new)
    if result.returncode == 0:
        return Action("up-to-date") if result.stdout == current else Action("merged", result.stdout)
    reason = (
        f"{result.returncode} conflict(s)"
        if result.returncode <= 127
        else result.stderr.decode().strip()
    )
    return Action("CONFLICT", note=f"{reason}; left untouched")


def inherited_from(earlier: list[Stage], path: str, content: bytes) -> Stage | None:
    """The first stage of the unbroken run at the end of `earlier` whose `path` holds `content`."""
    origin = None
    for stage in reversed(earlier):
        file = stage.path / path
        if not file.is_file() or file.read_bytes() != content:
            break
        origin = stage
    return origin


def placement_hints(src: Stage, changes: dict[str, tuple[bytes | None, bytes | None]]) -> list[str]:
    """For each change that `check` will reject (src now differs from the stage before it in a file
    its README does not list): where the change belongs instead."""
    rungs = full_ladder(src.root)
    earlier = rungs[: rungs.index(src)]
    if not earlier:
        return []
    prev, listed = earlier[-1], declared_files(src) or set()
    hints = []
    for path, (base, new) in changes.items():
        prev_file = prev.path / path
        if (
            path == README
            or path in listed
            or (prev_file.read_bytes() if prev_file.is_file() else None) == new
        ):
            continue
        origin = inherited_from(earlier, path, base) if base is not None else None
        if origin:
            hints.append(
                f"{src.rel}/{path} is inherited unchanged from {origin.name}: make the change there "
                f"and run `sync {origin.name[:2]}` (as it is, check will fail for {src.name})"
            )
        else:
            hints.append(
                f"{src.rel}/{path} is not listed under '{SECTION}' in {src.rel}/{README}: "
                f"list it there, or check will fail for {src.name}"
            )
    return hints


def cmd_sync(args: argparse.Namespace) -> int:
    src = resolve(args.root, args.src)
    stages = full_ladder(args.root)
    last = resolve(args.root, args.to) if args.to else stages[-1]
    if stages.index(last) <= stages.index(src):
        raise StageError(
            f"there is nothing to sync into: {last.name} does not come after {src.name}"
        )
    targets = stages[stages.index(src) + 1 : stages.index(last) + 1]
    changes = source_changes(src, args.ref)
    if not changes:
        print(f"nothing to sync: {src.rel} matches {args.ref}")
        return 0
    if args.dry_run:
        print("dry run: nothing is written")
    counts = Counter()
    for target in targets:
        for path, (base, new) in changes.items():
            dest = target.path / path
            current = dest.read_bytes() if dest.is_file() else None
            action = plan(current, base, new, src)
            if action.content is not None and not args.dry_run:
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(action.content)
            counts[action.status] += 1
            print(
                f"{action.status:<10} {target.rel}/{path}"
                + (f" ({action.note})" if action.note else "")
            )
    print(
        f"sync {src.name} (vs {args.ref}): "
        + ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    )
    for hint in placement_hints(src, changes):
        print(f"note: {hint}")
    return 1 if counts["CONFLICT"] else 0


# ---------------------------------------------------------------------------------------------- list


def summary(stage: Stage) -> str:
    init = stage.path / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) if init.is_file() else None
    return doc.splitlines()[0] if doc else "(no __init__.py docstring)"


def cmd_list(args: argparse.Namespace) -> int:
    stages = full_ladder(args.root)
    if not stages:
        raise StageError(f"no {STAGES_DIR}/NN_name folders under {args.root}")
    width = max(len(stage.name) for stage in stages)
    for stage in stages:
        print(f"{stage.name:<{width}}  {summary(stage)}")
    return 0


# ---------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--root",
        type=Path,
        default=REPO_ROOT,
        help="repo root holding stages/ (default: %(default)s)",
    )
    parser = argparse.ArgumentParser(
        prog="python -m tools.stages", description=__doc__.splitlines()[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)

    diff = commands.add_parser(
        "diff", parents=[common], help="per-file summary and unified diff between two stages"
    )
    diff.add_argument("a", help="stage name or number (03_paged, 03, 3, paged) or final")
    diff.add_argument("b", help="stage name or number, or final")
    diff.add_argument("--stat", action="store_true", help="print only the per-file summary")
    diff.add_argument(
        "--raw",
        action="store_true",
        help="keep the first stage's own markers (by default they are dropped, as the rung after it drops them)",
    )
    diff.set_defaults(func=cmd_diff)

    check = commands.add_parser(
        "check",
        parents=[common],
        help=f"each stage differs from the previous one only in its README's '{SECTION}' and marks only its own lesson",
    )
    check.set_defaults(func=cmd_check)

    sync = commands.add_parser(
        "sync",
        parents=[common],
        help="carry a stage's uncommitted change into every later stage and final",
    )
    sync.add_argument("src", help="the stage whose change to carry forward")
    sync.add_argument(
        "--to", help="the last rung to write into (default: final, or the last stage without it)"
    )
    sync.add_argument(
        "--ref", default="HEAD", help="git ref the change is measured against (default: HEAD)"
    )
    sync.add_argument(
        "--dry-run", action="store_true", help="print what would happen, write nothing"
    )
    sync.set_defaults(func=cmd_sync)

    listing = commands.add_parser(
        "list", parents=[common], help="the ladder, with each stage's one-line summary"
    )
    listing.set_defaults(func=cmd_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.root = args.root.resolve()
    try:
        return args.func(args)
    except StageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
