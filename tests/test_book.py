"""The course book (`make book`): built from the executed notebooks, then every page opened in
headless Chromium, which must render it with all its figures loaded; no internal link may be broken.
The book is read both ways, over http and from disk (file://): its links name files, never folders
(a folder from disk is a directory listing), and its search works from either.

Chromium is driven over the DevTools protocol on a pipe (--remote-debugging-pipe: JSON messages
ending in NUL on file descriptors 3 and 4), so nothing beyond the Debian package is needed.
Skipped when Chromium or the book's packages (the `book` extra) are missing, unless REQUIRE_BOOK=1
(CI sets it), which makes their absence a failure.
"""

from __future__ import annotations

import fcntl
import functools
import html.parser
import http.server
import importlib.util
import json
import os
import select
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")
PAGE_TIMEOUT_S = 30.0
pytestmark = pytest.mark.xdist_group("book")  # one worker builds the book once for all its tests


def _requirements() -> str | None:
    """Why the book cannot be tested here, or None."""
    missing = [
        m for m in ("mkdocs", "material", "mkdocs_jupyter") if importlib.util.find_spec(m) is None
    ]
    if missing:
        return f"the book extra is not installed (missing {', '.join(missing)}): pip install -e '.[book]'"
    if not any(shutil.which(b) for b in BROWSERS):
        return "no Chromium on PATH: apt-get install -y chromium"
    return None


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    reason = _requirements()
    if reason:
        if os.environ.get("REQUIRE_BOOK") == "1":
            pytest.fail(f"REQUIRE_BOOK=1 but {reason}")
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("book") / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    return out


def _pages(site: Path) -> list[Path]:
    return sorted(p for p in site.rglob("*.html") if p.name != "404.html")


def _url_path(site: Path, page: Path) -> str:
    return "/" + page.relative_to(site).as_posix()


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "a" and "name" in a:
            self.ids.add(a["name"])
        for key in ("href", "src"):
            if a.get(key) and tag in ("a", "link", "img", "script", "source"):
                self.links.append(a[key])


def _parse(page: Path) -> _Links:
    p = _Links()
    p.feed(page.read_text(encoding="utf-8"))
    return p


def _file_for(site: Path, url_path: str) -> Path | None:
    target = site / unquote(url_path).lstrip("/")
    if target.is_dir():
        target = target / "index.html"
    return target if target.is_file() else None


def test_book_has_the_syllabus(site: Path):
    spec = importlib.util.spec_from_file_location("book_hooks", ROOT / "docs" / "book_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    listed = [file for entry in hooks.syllabus(NOTEBOOKS / "README.md") for file in entry.values()]
    assert listed[0] == "01_naive.ipynb" and listed[-1] == "final.ipynb", listed
    unlisted = sorted({p.name for p in NOTEBOOKS.glob("*.ipynb")} - set(listed))
    assert not unlisted, (
        f"not in the syllabus table of notebooks/README.md (its rows are the book's contents): {unlisted}"
    )
    for nb in listed:
        assert (NOTEBOOKS / nb).exists(), f"the syllabus lists {nb}, which is not in notebooks/"
        assert (site / nb.replace(".ipynb", ".html")).exists(), f"{nb} has no page in the book"
    index = (site / "index.html").read_text(encoding="utf-8")
    for nb in listed:  # the navigation lists every notebook, in the syllabus' order
        assert f'href="{nb.replace(".ipynb", ".html")}"' in index, (
            f"{nb} is not in the book's navigation"
        )
    positions = [index.index(f'href="{nb.replace(".ipynb", ".html")}"') for nb in listed]
    assert positions == sorted(positions), "the navigation is not in the syllabus' order"


def test_no_internal_link_is_broken(site: Path):
    parsed = {page: _parse(page) for page in _pages(site)}
    ids = {page: p.ids for page, p in parsed.items()}
    broken = []
    for page, p in parsed.items():
        base = _url_path(site, page)
        for link in p.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "data:", "javascript:")):
                continue
            url = urlsplit(urljoin(base, link))
            target = (
                _file_for(site, url.path) if url.path != base or not link.startswith("#") else page
            )
            if url.path.endswith("/") or (site / unquote(url.path).lstrip("/")).is_dir():
                broken.append(
                    f"{_url_path(site, page)}: {link} (a folder: read from disk, a directory listing)"
                )
            elif target is None:
                broken.append(f"{_url_path(site, page)}: {link} (no such file in the book)")
            elif (
                url.fragment
                and target.suffix == ".html"
                and unquote(url.fragment) not in ids.get(target, set())
            ):
                broken.append(
                    f"{_url_path(site, page)}: {link} (no element with id {url.fragment!r})"
                )
    assert not broken, f"{len(broken)} broken internal links:\n" + "\n".join(broken[:50])
    assert len(parsed) > 10, f"only {len(parsed)} pages were built"


# What a loaded page shows, once its images have loaded or failed (run in the page).
REPORT = """(async () => {
  await Promise.all([...document.images].map(i => i.complete ? null :
    new Promise(done => { i.addEventListener('load', done); i.addEventListener('error', done); })));
  const main = document.querySelector('article') || document.body;
  const search = document.querySelector('.md-search');
  return {title: document.title, text: main.innerText.length,
          search: !!search && getComputedStyle(search).display !== 'none' && search.offsetParent !== null,
          images: [...main.querySelectorAll('img')].map(i => ({src: i.currentSrc.slice(0, 120),
                  width: i.naturalWidth, height: i.naturalHeight})),
          code: main.querySelectorAll('pre').length,
          clipped: [...main.querySelectorAll('table')].filter(t => {  // wider than the page, and nothing scrolls it
            if (t.getBoundingClientRect().right <= main.getBoundingClientRect().right + 1) return false;
            for (let e = t; e && e !== main; e = e.parentElement) {
              if (['auto', 'scroll'].includes(getComputedStyle(e).overflowX)) return false;
            }
            return true;
          }).length};
})()"""


class _Chromium:
    """One headless Chromium, spoken to through the DevTools protocol on a pipe."""

    def __init__(self, binary: str, profile: Path):
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def fds():  # the protocol reads fd 3 and writes fd 4 (close_fds=False keeps them: other fds are
            # not inheritable, PEP 446); moved above 10 first, as the pipes may themselves be fds 3 to 6
            read, write = (
                fcntl.fcntl(to_child_r, fcntl.F_DUPFD, 10),
                fcntl.fcntl(from_child_w, fcntl.F_DUPFD, 10),
            )
            os.dup2(read, 3)
            os.dup2(write, 4)

        self.proc = subprocess.Popen(
            [
                binary,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--disable-extensions",
                "--mute-audio",
                "--remote-debugging-pipe",
                f"--user-data-dir={profile}",
                "about:blank",
            ],
            preexec_fn=fds,
            close_fds=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._buffer, self._events, self._next_id = b"", [], 0

    def new_tab(self) -> str:
        """A new page; returns its session id."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"
        ]
        self.call("Page.enable", session=session)
        self.call("Runtime.enable", session=session)
        return session

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_child], [], [], left)[0]:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._from_child, 1 << 20)
            if not chunk:
                raise RuntimeError(f"Chromium closed the pipe (exit code {self.proc.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(
        self,
        method: str,
        params: dict | None = None,
        session: str | None = None,
        timeout: float = PAGE_TIMEOUT_S,
    ) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self._events.append(reply)

    def _next_event(self, method: str, sessions: set[str], timeout: float = PAGE_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for i, event in enumerate(self._events):
                if event.get("method") == method and event.get("sessionId") in sessions:
                    return self._events.pop(i)
            self._events.append(self._read(deadline))

    def take_events(self, method: str, session: str) -> list[dict]:
        taken = [
            e for e in self._events if e.get("method") == method and e.get("sessionId") == session
        ]
        self._events = [
            e
            for e in self._events
            if not (e.get("method") == method and e.get("sessionId") == session)
        ]
        return taken

    def open_all(self, urls: list[str], tabs: int = 4) -> dict[str, dict]:
        """Load every page, several tabs at a time; once a page and its images have loaded, report
        what the browser shows: {url: {title, text, images, code, errors}}."""
        todo, shown, loading = list(urls), {}, {}  # loading: session -> url
        idle = [self.new_tab() for _ in range(min(tabs, len(urls)))]
        while todo or loading:
            while todo and idle:
                session, url = idle.pop(), todo.pop(0)
                self.take_events("Page.loadEventFired", session)
                self.take_events("Runtime.exceptionThrown", session)
                self.call("Page.navigate", {"url": url}, session=session)
                loading[session] = url
            session = self._next_event("Page.loadEventFired", set(loading))["sessionId"]
            url = loading.pop(session)
            result = self.call(
                "Runtime.evaluate",
                {"expression": REPORT, "awaitPromise": True, "returnByValue": True},
                session=session,
            )
            if "exceptionDetails" in result:
                raise RuntimeError(f"{url}: {result['exceptionDetails']}")
            errors = [
                e["params"]["exceptionDetails"].get("text")
                for e in self.take_events("Runtime.exceptionThrown", session)
            ]
            shown[url] = {**result["result"]["value"], "errors": errors}
            idle.append(session)
        return shown

    def close(self):
        try:
            self.call("Browser.close", timeout=10)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_child)
        os.close(self._from_child)


def _image_outputs(notebook: Path) -> int:
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    return sum(
        1
        for c in cells
        for o in c.get("outputs", [])
        if {"image/png", "image/jpeg"} & set(o.get("data", {}))
    )


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


# Type a query into the search box; the titles of the results it lists (run in the page).
SEARCH = """(async () => {
  const input = document.querySelector('input.md-search__input');
  if (!input) return {error: 'no search box'};
  input.focus();
  input.value = %s;
  input.dispatchEvent(new Event('input', {bubbles: true}));
  input.dispatchEvent(new KeyboardEvent('keyup', {bubbles: true}));
  for (let i = 0; i < 100; i++) {
    const items = document.querySelectorAll('.md-search-result__item');
    if (items.length) return {results: [...items].slice(0, 5).map(e => e.innerText.split('\\n')[0])};
    await new Promise(done => setTimeout(done, 100));
  }
  return {results: [], meta: (document.querySelector('.md-search-result__meta') || {}).innerText};
})()"""


def _search(browser: "_Chromium", url: str, query: str) -> dict:
    session = browser.new_tab()
    browser.call("Page.navigate", {"url": url}, session=session)
    browser._next_event("Page.loadEventFired", {session})
    result = browser.call(
        "Runtime.evaluate",
        {"expression": SEARCH % json.dumps(query), "awaitPromise": True, "returnByValue": True},
        session=session,
    )
    return result["result"].get("value") or {"error": str(result.get("exceptionDetails"))}


@pytest.mark.parametrize("mode", ["http", "file"])
def test_every_page_renders_with_its_figures(site: Path, tmp_path: Path, mode: str):
    binary = next(shutil.which(b) for b in BROWSERS if shutil.which(b))
    browser = _Chromium(
        binary, tmp_path / "profile"
    )  # started before the server's thread (it forks)
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Quiet, directory=str(site))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}" if mode == "http" else site.as_uri()
    problems, figures = [], 0
    try:
        paths = [_url_path(site, page) for page in _pages(site)]
        shown_all = browser.open_all([base + path for path in paths])
        found = _search(browser, base + "/index.html", "block table")
        if not found.get("results"):
            problems.append(f"search over {mode} found nothing for 'block table': {found}")
        for path in paths:
            shown = shown_all[base + path]
            if not shown["search"]:
                problems.append(f"{path}: no search box shown")
            if not shown["title"] or shown["text"] < 20:
                problems.append(
                    f"{path}: blank (title {shown['title']!r}, {shown['text']} characters of text)"
                )
            for img in shown["images"]:
                if not img["src"] or img["width"] == 0 or img["height"] == 0:
                    problems.append(f"{path}: image not loaded: {img['src']!r}")
            problems += [f"{path}: script error: {error}" for error in shown["errors"]]
            if shown["clipped"]:
                problems.append(
                    f"{path}: {shown['clipped']} tables wider than the page, clipped (no scrolling)"
                )
            notebook = NOTEBOOKS / (path.strip("/").removesuffix(".html") + ".ipynb")
            if notebook.exists() and path.count("/") == 1:
                expected = _image_outputs(notebook)
                loaded = sum(1 for i in shown["images"] if i["width"] > 0)
                figures += loaded
                if loaded < expected:
                    problems.append(f"{path}: {loaded} figures shown, the notebook has {expected}")
                if shown["code"] == 0:
                    problems.append(f"{path}: no code cells rendered")
    finally:
        browser.close()
        server.shutdown()
        server.server_close()
    assert not problems, "\n".join(problems[:50])
    assert figures > 0, "no notebook page showed a figure"
