"""MkDocs hooks for the course book (mkdocs.yml names this file).

1. The table of contents is the syllabus table of notebooks/README.md: every row whose first
   cell links to a notebook, in the table's order, titled with the link's text.
2. A page may link to any file of the repository (a stage's README, a source file, a figure):
   each such target is added to the book under repo/<its path> (Markdown as a page, source
   files as a page holding the code, directories as their README or a file listing, images as
   they are), and the link is rewritten to point there. Targets are followed from the pages
   they are linked from, so the book holds what the course links to and nothing more.
3. Search: the theme's search worker bundles lunr, whose token set names a state by its edges'
   labels and target ids run together ("a12b3"), so with digits among the labels (the index
   holds terms such as "10472,") two different states can get one name and be merged: a query
   then expands to a term that is in no document, and the search fails ("No matching
   documents"). After the build, a comma ends each id in those names.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

PREFIX = "repo"  # where files from outside notebooks/ land in the book
IMAGES = {".png", ".svg", ".jpg", ".jpeg", ".gif"}
LANGUAGES = {
    ".py": "python",
    ".json": "json",
    ".toml": "toml",
    ".yml": "yaml",
    ".yaml": "yaml",
    ".sh": "bash",
    ".txt": "text",
    ".cfg": "ini",
    "": "text",
}
MAX_BYTES = 400_000  # larger files are not copied into the book
LINK = re.compile(r"(\]\(\s*<?)([^)\s>]+)(>?(?:\s+\"[^\"]*\")?\s*\))|((?:href|src)=\")([^\"]+)(\")")
ROW_LINK = re.compile(r"^\|\s*\[([^\]]+)\]\(([^)#\s]+\.ipynb)\)")

WORKER = (
    "assets/iframe-worker.js"  # docs/iframe-worker.js: mkdocs.yml names it among extra.polyfills
)
_state: dict = {}
log = logging.getLogger("mkdocs.plugins.book_hooks")
# lunr's TokenSet.prototype.toString as the theme's minified worker has it, and with the comma
TOKEN_SET_NAME = re.compile(r"(\w)=\1\+(\w)\+(\w)\.id\}return \1")


def _relative(target: str) -> bool:
    return not (target.startswith(("#", "/")) or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target))


def _split(target: str) -> tuple[str, str]:
    path, _, anchor = target.partition("#")
    return path, f"#{anchor}" if anchor else ""


def syllabus(readme: Path) -> list[dict[str, str]]:
    """The notebooks of the syllabus table, in order: [{link text: notebook file}]."""
    return [
        {m.group(1).strip("`* "): m.group(2)}
        for line in readme.read_text().splitlines()
        if (m := ROW_LINK.match(line.strip()))
    ]


def on_config(config):
    root = Path(config.config_file_path).parent.resolve()
    docs = Path(config.docs_dir).resolve()
    _state.update(root=root, docs=docs)
    config.nav = [{"Start here": "README.md"}, *syllabus(docs / "README.md")]
    return config


def _links(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".ipynb":
        import json

        cells = json.loads(text)["cells"]
        parts = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
        parts += [
            "".join(o["data"][kind])
            for c in cells
            for o in c.get("outputs", [])  # links drawn by code
            for kind in ("text/html", "text/markdown")
            if kind in o.get("data", {})
        ]
        text = "\n".join(parts)
    return [m.group(2) or m.group(5) for m in LINK.finditer(text)]


def _text(path: Path) -> str | None:
    if path.stat().st_size > MAX_BYTES:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def _listed(path: Path) -> list[Path]:
    return sorted(
        p
        for p in path.iterdir()
        if not p.name.startswith((".", "__pycache__")) and not p.name.endswith(".egg-info")
    )


class _Collector:
    """Adds the repository files the pages link to, following links from Markdown it adds."""

    def __init__(self, config, files: Files):
        self.config, self.files = config, files
        self.root, self.docs = _state["root"], _state["docs"]
        self.by_path: dict[Path, File] = {}  # a repository path -> the book's file for it
        for f in files:
            if f.abs_src_path and not f.inclusion.is_excluded():
                self.by_path[Path(f.abs_src_path).resolve()] = f

    def uri(self, path: Path) -> str:
        return f"{PREFIX}/{path.relative_to(self.root).as_posix()}"

    def add(self, path: Path) -> File | None:
        """The book's file for a repository path (added now if needed), or None if it has none."""
        path = path.resolve()
        if path in self.by_path:
            return self.by_path[path]
        if not path.exists() or not path.is_relative_to(self.root) or path == self.root:
            return None
        if path.is_dir():
            if (path / "README.md").exists():
                f = self.add(path / "README.md")
            else:
                f = self._new(self.uri(path) + "/index.md", content=self._listing(path))
        elif path.suffix == ".md":
            f = self._new(self.uri(path), abs_src_path=str(path))
        elif path.suffix.lower() in IMAGES and path.stat().st_size <= MAX_BYTES:
            f = self._new(self.uri(path), abs_src_path=str(path))
        elif (text := _text(path)) is not None:
            f = self._new(self.uri(path) + ".md", content=self._code_page(path, text))
        else:
            return None
        self.by_path[path] = f
        return f

    def _new(self, src_uri: str, **kwargs) -> File:
        f = File.generated(self.config, src_uri, **kwargs)
        self.files.append(f)
        return f

    def _code_page(self, path: Path, text: str) -> str:
        fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", text)), default=0))
        lang = LANGUAGES.get(path.suffix, "text")
        return f"# `{path.relative_to(self.root).as_posix()}`\n\n{fence}{lang}\n{text.rstrip()}\n{fence}\n"

    def _listing(self, path: Path) -> str:
        here, rows = os.path.dirname(self.uri(path) + "/index.md"), []
        for p in _listed(path):
            if (f := self.add(p)) is not None:
                rows.append(
                    f"- [`{p.name}{'/' if p.is_dir() else ''}`]({os.path.relpath(f.src_uri, here)})"
                )
        return f"# `{path.relative_to(self.root).as_posix()}/`\n\n" + "\n".join(rows) + "\n"

    def follow(self, start: list[Path]) -> None:
        todo, seen = list(start), set()
        while todo:
            page = todo.pop()
            if page in seen:
                continue
            seen.add(page)
            for target in _links(page):
                if not _relative(target):
                    continue
                path = (page.parent / _split(target)[0]).resolve()
                f = self.add(path)
                if f is not None and f.abs_src_path and f.src_uri.endswith(".md"):
                    todo.append(Path(f.abs_src_path).resolve())


def on_files(files: Files, config) -> Files:
    files.append(
        File.generated(
            config, WORKER, abs_src_path=str(_state["root"] / "docs" / "iframe-worker.js")
        )
    )
    collector = _Collector(config, files)
    pages = [
        Path(f.abs_src_path).resolve()
        for f in files
        if f.abs_src_path and f.src_uri.endswith((".md", ".ipynb"))
    ]
    collector.follow(pages)
    _state["collector"] = collector
    return files


def _target(page, target: str) -> tuple[File, str] | None:
    """The book's file a page's relative link points to, and its anchor."""
    if not _relative(target) or not page.file.abs_src_path:
        return None
    path, anchor = _split(target)
    if not path:
        return None
    f = _state["collector"].by_path.get((Path(page.file.abs_src_path).parent / path).resolve())
    return (f, anchor) if f is not None else None


def _rewrite(text: str, page, to) -> str:
    def sub(m: re.Match) -> str:
        groups = (1, 2, 3) if m.group(2) else (4, 5, 6)
        found = _target(page, m.group(groups[1]))
        if found is None:
            return m.group(0)
        return m.group(groups[0]) + to(*found) + m.group(groups[2])

    return LINK.sub(sub, text)


def on_page_markdown(markdown: str, page, config, files):
    # Markdown pages: point links at the book's source files; MkDocs then turns them into URLs.
    here = os.path.dirname(page.file.src_uri)
    return _rewrite(
        markdown, page, lambda f, anchor: os.path.relpath(f.src_uri, here or ".") + anchor
    )


def on_page_content(html: str, page, config, files):
    # Notebooks arrive as HTML (mkdocs-jupyter): point their links at the pages' URLs.
    if not page.file.src_uri.endswith(".ipynb"):
        return html
    headings = re.findall(r"<h([1-6])[^>]*\sid=\"([^\"]+)\"[^>]*>(.*?)</h\1>", html, re.S)
    _match_toc(page.toc, [(id_, _plain(inner)) for _, id_, inner in headings])
    return _rewrite(html, page, lambda f, anchor: f.url_relative_to(page.file) + anchor)


def _plain(inner_html: str) -> str:
    text = re.sub(
        r"<a class=\"anchor-link\".*?</a>", "", inner_html, flags=re.S
    )  # the heading's permalink
    return re.sub(
        r"<[^>]+>", "", text
    ).strip()  # entities stay escaped: the theme inserts titles as HTML


def _match_toc(toc, headings: list[tuple[str, str]]) -> None:
    """Point the page's table of contents at the headings as the notebook's HTML has them: their
    ids and their text (mkdocs-jupyter derives the contents from Markdown, and drops code spans)."""
    anchors, todo = [], list(toc)
    while todo:
        anchor = todo.pop(0)
        anchors.append(anchor)
        todo[:0] = anchor.children
    if len(anchors) == len(headings):
        for anchor, (id_, title) in zip(anchors, headings):
            anchor.id, anchor.title = id_, title or anchor.title


def on_post_build(config):
    """Patch the search worker's token-set names (3. above); a worker without that code is a
    warning, which fails a strict build: search must be checked again."""
    workers = sorted(Path(config["site_dir"], "assets/javascripts/workers").glob("search.*.js"))
    for worker in workers:
        code = worker.read_text(encoding="utf-8")
        patched, count = TOKEN_SET_NAME.subn(r'\1=\1+\2+\3.id+","}return \1', code)
        if count != 1:
            log.warning(f"{worker.name}: lunr's TokenSet.toString not found once ({count})")
        worker.write_text(patched, encoding="utf-8")
    if not workers:
        log.warning("no search worker found to patch")
