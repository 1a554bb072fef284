"""The course site: `mkdocs build --strict` succeeds, and in headless Chromium a chapter page, a
rendered notebook with its plots, the math on both and the chapters' mermaid diagrams actually render,
with no network beyond the site itself (MathJax and mermaid are served by the site). The test_site_*
tests open every page and measure it as a reader sees it: diagrams at their size, no raw TeX, no stderr
or progress bars, real titles, anchors that land, nothing clipped or shrunk, no outside request.

    MINILLM_SITE=site pytest tests/test_site.py    # a site built before (make docs), as is"""

from __future__ import annotations

import functools
import http.server
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Every host but the test's own server fails to resolve, so a page that reaches for a CDN fails here
# even on a machine with a network.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]
# Material draws each mermaid diagram into a closed shadow root, which the page's HTML (_dom) does not
# include. A page asked for with this query gets, first thing in its <head>, a shim that makes attachShadow
# hand back the host element itself, so the diagram's SVG lands in the HTML that _dom returns.
LIGHT_DOM = "light-dom"
LIGHT_DOM_SHIM = b"<script>Element.prototype.attachShadow = function () { return this; };</script>"


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.fail("headless Chromium is needed for the site test: `make chromium` (apt-get install chromium)")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built into a temporary folder and served on a free port (MINILLM_SITE=<folder>: a site
    built before, as is)."""
    import os

    if built := os.environ.get("MINILLM_SITE"):
        yield from _serve(Path(built))
        return
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
                          cwd=ROOT, capture_output=True, text=True, env={**_env(), "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    yield from _serve(out)


def _serve(out: Path):
    handler = functools.partial(_SiteHandler, directory=str(out))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _SITE.append((out, f"http://127.0.0.1:{server.server_address[1]}"))
    yield _SITE[0]
    while _BROWSER:
        _BROWSER.pop().close()
    _SITE.clear()
    _SWEPT.clear()
    _dom.cache_clear()
    server.shutdown()


_SITE: list = []  # (folder, URL) of the site the module's tests are looking at


NOT_FOUND: list[str] = []  # every path the test server answered 404, in order


class _SiteHandler(http.server.SimpleHTTPRequestHandler):
    """The built site, as is; an HTML page asked for with ?light-dom gets LIGHT_DOM_SHIM."""

    def send_error(self, code, message=None, explain=None):
        if code == 404:
            NOT_FOUND.append(self.path)
        super().send_error(code, message, explain)

    def log_message(self, *args):
        pass

    def do_GET(self):
        path, _, query = self.path.partition("?")
        if query != LIGHT_DOM:
            return super().do_GET()
        file = Path(self.translate_path(path))
        if file.is_dir():
            file = file / "index.html"
        body = file.read_bytes().replace(b"<head>", b"<head>" + LIGHT_DOM_SHIM, 1)
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _env():
    import os

    return dict(os.environ)


@functools.cache
def _dom(url: str) -> str:
    """The page's DOM once its math is typeset and its diagrams drawn (as --dump-dom prints it): from the
    sweep of every page (test_site_as_a_reader_sees_it) if this worker has made it, else loaded now."""
    if "?" not in url and _SITE and (page := url.removeprefix(_SITE[0][1] + "/")) in _SWEPT:
        return _SWEPT[page]["html"]
    return _browser().dom(url)


@pytest.mark.slow
def test_site_as_a_reader_sees_it(site, browsed):
    """Every page of the site, opened in headless Chromium and measured (the checks below, one per defect
    class of the site review): fails naming every class that any page shows, with counts and examples. One
    test, so that one xdist worker opens the pages; tests after it in that worker reuse their DOMs."""
    failures = []
    for check in SITE_CHECKS:
        try:
            check(site, browsed)
        except (pytest.fail.Exception, AssertionError) as e:
            failures.append(f"{check.__name__}: {e}")
    if failures:
        pytest.fail(f"{len(failures)} of {len(SITE_CHECKS)} checks failed:\n" + "\n".join(failures), pytrace=False)


def test_course_map_lists_all_chapters(site):
    _, base = site
    dom = _dom(f"{base}/")
    for n in range(13):
        assert f"<td>{n:02d}</td>" in dom, f"chapter {n:02d} missing from the course map"
    for title in ("Why inference is different", "Tokenizer", "The model", "The KV cache", "FlashAttention in Triton",
                  "Paged KV blocks", "Prefix caching", "Continuous batching", "Quantization", "MLA and MoE",
                  "Serving"):
        assert title in dom, f"{title!r} missing from the course map"


def _math_ok(dom: str) -> bool:
    return 'class="MathJax' in dom and 'class="merror"' not in dom and "Math Processing Error" not in dom


def _math_texts(dom: str) -> list[str]:
    """The text of each typeset formula, from the MathML that MathJax puts beside it for screen readers."""
    return [re.sub(r"<[^>]+>", "", m) for m in re.findall(r"<math\b.*?</math>", dom, flags=re.S)]


def _stray_escapes(dom: str) -> list[str]:
    """Formulas that show a backslash: a TeX escape that MathJax took as text (`\\_` inside `\\text{}`
    stays `\\_`, since MathJax 2 reads \\text's argument verbatim: write `\\text{max_len}`)."""
    texts = _math_texts(dom)
    assert len(texts) == dom.count('class="arithmatex"'), "MathJax did not typeset every formula"
    return [t for t in texts if "\\" in t]


@pytest.mark.parametrize("page", ["00-why-inference-is-different/", "01-tokenizer/", "02-the-model/", "03-kv-cache/",
                                  "04-flash-attention/", "05-paged-kv/", "06-prefix-caching/",
                                  "07-continuous-batching/", "08-quantization/", "09-speculative-decoding/",
                                  "11-tensor-parallelism/", "12-serving/"])
def test_chapter_page_renders(site, page):
    _, base = site
    dom = _dom(f"{base}/{page}")
    assert "<h1" in dom and "md-content" in dom
    assert "arithmatex" not in dom or _math_ok(dom), "MathJax did not typeset the chapter's math"
    assert not (stray := _stray_escapes(dom)), f"math renders a TeX escape as text: {stray}"


def test_chapter_math_renders(site):
    _, base = site
    dom = _dom(f"{base}/00-why-inference-is-different/")
    assert "arithmatex" in dom and _math_ok(dom), "MathJax did not typeset the chapter's math"


def test_chapter_05_slot_row_formula_has_no_stray_backslash(site):
    _, base = site
    dom = _dom(f"{base}/05-paged-kv/")
    assert _math_ok(dom) and not _stray_escapes(dom)
    assert "s\u22c5max_len+p" in _math_texts(dom), "chapter 05's $s \\cdot \\text{max_len} + p$ is not typeset"


def _mermaid_pages() -> list:
    """(page URL, number of diagrams) for every page of chapters/ with a ```mermaid fence."""
    pages = []
    for md in sorted((ROOT / "chapters").glob("*.md")):
        if n := len(re.findall(r"^\s*```mermaid\s*$", md.read_text(), flags=re.M)):
            pages.append(pytest.param("" if md.stem == "index" else f"{md.stem}/", n, id=md.stem))
    return pages


@pytest.mark.parametrize(("page", "diagrams"), _mermaid_pages())
def test_mermaid_diagrams_render_offline(site, page, diagrams):
    out, base = site
    assert (out / "assets" / "mermaid" / "mermaid.min.js").is_file(), "the site does not serve mermaid"
    dom = _dom(f"{base}/{page}?{LIGHT_DOM}")
    assert re.search(r'<script [^>]*src="[./]*assets/mermaid/mermaid\.min\.js"', dom), \
        "the page does not load mermaid from the site"
    drawn = re.findall(r'<div class="mermaid"><svg id="__mermaid_\d+"[^>]*aria-roledescription=', dom)
    assert len(drawn) == diagrams, f"{len(drawn)} of {diagrams} mermaid diagrams drawn as SVG (offline)"
    assert "Syntax error in text" not in dom


@pytest.mark.parametrize("page", ["notebooks/00_why_inference_is_different/", "notebooks/01_tokenizer/",
                                  "notebooks/02_model/", "notebooks/03_kv_cache/", "notebooks/04_flash_attention/",
                                  "notebooks/05_paged_kv/", "notebooks/06_prefix_caching/",
                                  "notebooks/07_continuous_batching/"])
def test_notebook_page_renders_plots_and_math(site, page):
    out, base = site
    assert (out / "assets" / "mathjax" / "MathJax.js").is_file()
    dom = _dom(f"{base}/{page}")
    assert "jp-Notebook" in dom or "jupyter-wrapper" in dom
    assert dom.count("data:image/png;base64") >= 1, "no plot rendered"
    assert _math_ok(dom), "MathJax did not typeset the notebook's $...$ math"
    assert "nb.widget(" not in dom, "widget cells should be hidden on the site"
    assert " | GPU " in dom, "the notebook on the site should show the outputs of a GPU run"


@pytest.mark.parametrize("page", ["", "08-quantization/", "09-speculative-decoding/", "notebooks/08_quantization/",
                                  "notebooks/09_speculative_decoding/"])
def test_page_requests_nothing_missing(site, page):
    """Every asset a page asks for exists: MathJax asks for the fonts the site serves (STIX-Web), not its
    default TeX fonts (which would 404 and fall back to plain glyphs)."""
    _, base = site
    before = len(NOT_FOUND)
    dom = _dom(f"{base}/{page}?fresh")  # (not the cached DOM of another test: this load's requests count)
    assert NOT_FOUND[before:] == [], f"{page or 'home'} requested missing files: {NOT_FOUND[before:]}"
    if 'class="MathJax' in dom:  # the page has typeset math
        assert "STIXMathJax_" in dom, "MathJax did not typeset with the STIX-Web fonts the site serves"


def test_pages_are_titled_by_chapter(site):
    out, _ = site
    for path, title in [("09-speculative-decoding/index.html", "09 · Speculative decoding — text"),
                        ("notebooks/09_speculative_decoding/index.html", "09 · Speculative decoding — notebook")]:
        assert f"<title>{title} - minillm</title>" in (out / path).read_text(), path


def test_wide_diagrams_keep_legible_labels(site):
    """A left-to-right flowchart is drawn at its natural size (the page scrolls sideways), not shrunk to
    the column: its SVG has a width in pixels and no max-width that scales it down."""
    _, base = site
    dom = _dom(f"{base}/08-quantization/?{LIGHT_DOM}")
    svgs = re.findall(r'<svg id="__mermaid_\d+"[^>]*>', dom)
    assert svgs, "no diagram drawn"
    for svg in svgs:
        assert re.search(r'width="\d+(\.\d+)?"', svg) and "max-width" not in svg, svg


def test_notebook_output_does_not_wrap(site):
    """print_table's rows stay one line each: notebook output blocks scroll sideways instead of wrapping."""
    out, base = site
    dom = _dom(f"{base}/notebooks/09_speculative_decoding/")
    assert re.search(r'<link rel="stylesheet" href="[./]*assets/minillm\.css">', dom), "the site's styles are not loaded"
    css = (out / "assets" / "minillm.css").read_text()
    assert re.search(r"\.jp-OutputArea-output pre[^{]*\{[^}]*white-space: pre !important", css)


def test_home_page_shows_outputs_status(site):
    _, base = site
    dom = _dom(f"{base}/")
    for n in ("00", "09", "12"):
        # the run cell may hold the commit as inline code: "H100 · 2026-11-25 · <code>d828ef7</code>"
        assert re.search(rf"<td>{n}</td>\s*<td><a [^>]*>[^<]+</a></td>\s*<td>(?:[^<]|<code>[^<]*</code>)*</td>\s*"
                         rf"<td>(current|stale|unknown)",
                         dom), f"chapter {n}'s outputs status missing from the home page"


# ---------------------------------------------------------------------------------------------------------
# The site as a reader sees it. One headless Chromium, driven over the DevTools protocol (a pipe: no
# package beyond the standard library), opens every page of the built site at 1280x900 and measures what
# --dump-dom cannot: drawn sizes, overflow, console errors, every request the page makes. Each test below
# is one defect class of the site review (research/site-review-t4.md) and names the pages that show it.
# ---------------------------------------------------------------------------------------------------------

VIEWPORT = (1280, 900)
# Material draws mermaid into a closed shadow root: open it, so the measurement can read the SVG (layout
# and styles stay exactly as the reader gets them, unlike the light-DOM shim above).
OPEN_SHADOW = """(() => { const orig = Element.prototype.attachShadow;
  Element.prototype.attachShadow = function (init) { return orig.call(this, Object.assign({}, init, {mode: 'open'})); };
})();"""
# Wait until MathJax has typeset and every mermaid host holds an SVG, then measure.
SETTLE = r"""
  const t0 = Date.now();
  const drawn = () => [...document.querySelectorAll('.mermaid')].every(h => (h.shadowRoot || h).querySelector('svg'));
  while (!drawn() && Date.now() - t0 < 20000) await new Promise(r => setTimeout(r, 100));
  if (window.MathJax && MathJax.Hub && MathJax.Hub.Queue) await new Promise(r => MathJax.Hub.Queue(r));
  await document.fonts.ready;
  await new Promise(r => setTimeout(r, 200));
"""
DOM = "(async () => {" + SETTLE + "return document.documentElement.outerHTML; })()"
MEASURE = "(async () => {" + SETTLE + r"""
  const content = document.querySelector('.md-content') || document.body;
  const r = {url: location.pathname};
  // the page's own title in the header (Material shows it once the reader scrolls)
  const topics = [...document.querySelectorAll('.md-header__topic .md-ellipsis')].map(e => e.textContent.trim());
  r.headerTitle = topics[topics.length - 1] || '';
  r.h1 = (content.querySelector('h1') || {textContent: ''}).textContent.replace('¶', '').trim();
  // raw TeX: text outside code, scripts and MathJax's own nodes
  const walker = document.createTreeWalker(content, NodeFilter.SHOW_TEXT);
  r.rawTex = [];
  for (let n; (n = walker.nextNode());) {
    const p = n.parentElement;
    if (!p || p.closest('code, pre, script, style, textarea, .MathJax_Preview, .MJX_Assistive_MathML, .MathJax, .MathJax_Display, .highlight, .jp-InputArea')) continue;
    if (/\\\(|\\\)|\\\[|\\\]|\\frac|\\text\{|\\mathrm|\\cdot|\\times|\$\$|(^|[^\w$])\$[^$\s][^$]*\$/.test(n.textContent))
      r.rawTex.push(n.textContent.trim().slice(0, 100));
  }
  r.untypeset = [...content.querySelectorAll('.arithmatex')].filter(a => !a.querySelector('.MathJax, .MathJax_Display, .MathJax_SVG, mjx-container')).length;
  r.mathErrors = content.querySelectorAll('.merror, .MathJax_Error').length;
  // mermaid: drawn width over natural width, and the host's box against the drawing (letterboxing)
  r.diagrams = [...document.querySelectorAll('.mermaid')].map(h => {
    const svg = (h.shadowRoot || h).querySelector('svg');
    if (!svg) return {drawn: false};
    const b = svg.getBoundingClientRect(), vb = (svg.getAttribute('viewBox') || '0 0 0 0').split(/[\s,]+/).map(Number);
    const labels = [...svg.querySelectorAll('.nodeLabel, text')].map(e => e.getBoundingClientRect().height).filter(x => x > 0).sort((a, c) => a - c);
    return {drawn: true, kind: svg.getAttribute('aria-roledescription'), natural: Math.round(vb[2]),
            width: Math.round(b.width), scale: vb[2] ? +(b.width / vb[2]).toFixed(2) : 0,
            boxHeight: Math.round(h.getBoundingClientRect().height), height: Math.round(b.height),
            label: labels.length ? +labels[Math.floor(labels.length / 2)].toFixed(1) : 0};
  });
  // notebook outputs: stderr streams and progress-bar text the reader can see
  const visible = e => e.getClientRects().length > 0 && getComputedStyle(e).visibility !== 'hidden';
  r.stderr = [...content.querySelectorAll('[data-mime-type="application/vnd.jupyter.stderr"]')].filter(visible).length;
  r.bars = [...content.querySelectorAll('.jp-OutputArea-output')].filter(visible)
    .map(e => e.innerText).filter(t => /\d+%\|.*\|\s*\d+\/\d+ \[/.test(t)).map(t => t.trim().slice(0, 80));
  // anchors: every id, and every link with a fragment (the TOC's included)
  r.ids = [...document.querySelectorAll('[id]')].map(e => e.id);
  r.links = [...document.querySelectorAll('a[href*="#"]')].map(a => ({href: a.href, text: a.textContent.trim().slice(0, 60),
                                                                      toc: !!a.closest('.md-nav')}));
  // overflow: code blocks and tables that scroll sideways, plots drawn under half their width, the page
  const column = (document.querySelector('.md-content__inner') || content).clientWidth;
  r.column = column;
  // (Material scrolls a block's <code>, nbconvert its <pre>: either counts)
  const scrolls = e => e.scrollWidth > e.clientWidth + 1;
  r.codeClipped = [...content.querySelectorAll('pre')].filter(p => !p.closest('.jp-OutputArea') && visible(p))
    .filter(p => scrolls(p) || [...p.querySelectorAll(':scope > code')].some(scrolls))
    .map(p => (p.textContent.split('\n').sort((a, c) => c.length - a.length)[0] || '').trim().slice(0, 60));
  r.tablesScrolling = [...content.querySelectorAll('table')].filter(t => !t.closest('.jp-OutputArea, .highlight, .highlighttable') && visible(t))
    .filter(t => { const w = t.closest('.md-typeset__scrollwrap') || t.parentElement; return t.getBoundingClientRect().width > w.clientWidth + 1 || w.scrollWidth > w.clientWidth + 1; })
    .map(t => `${t.rows[0] ? t.rows[0].cells.length : 0} cols, ${Math.round(t.scrollWidth)} px: ` + (t.rows[0] ? t.rows[0].textContent.trim().replace(/\s+/g, ' ') : '').slice(0, 50));
  r.plotsSmall = [...content.querySelectorAll('img')].filter(i => i.naturalWidth > 0 && visible(i))
    .map(i => ({natural: i.naturalWidth, width: Math.round(i.getBoundingClientRect().width)}))
    .filter(i => i.width < 0.5 * i.natural);
  r.pageScrolls = document.documentElement.scrollWidth > window.innerWidth + 1;
  r.html = document.documentElement.outerHTML;
  return r;
})()"""


class _Chromium:
    """Headless Chromium over the DevTools protocol on a pipe (--remote-debugging-pipe: commands in on fd 3,
    replies and events out on fd 4, each a JSON message ended by a NUL byte)."""

    def __init__(self):
        import json
        import os

        self._json = json
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()
        self._profile = tempfile.TemporaryDirectory(ignore_cleanup_errors=True)

        def pipes_on_3_and_4():
            import fcntl

            a, b = (fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (cmd_r, out_w))
            os.dup2(a, 3)
            os.dup2(b, 4)

        self._proc = subprocess.Popen(
            [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={self._profile.name}", "--remote-debugging-pipe",
             "--hide-scrollbars", f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=pipes_on_3_and_4, close_fds=False)  # (Python opens its own files non-inheritable)
        os.close(cmd_r)
        os.close(out_w)
        self._buf, self._next_id, self.events = b"", 0, []
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Network", "Log"):
            self.send(f"{domain}.enable", session=self.session)
        self.send("Page.addScriptToEvaluateOnNewDocument", source=OPEN_SHADOW, session=self.session)
        # every load asks the server for every file (test_page_requests_nothing_missing counts its 404s)
        self.send("Network.setCacheDisabled", cacheDisabled=True, session=self.session)
        self.send("Emulation.setDeviceMetricsOverride", width=VIEWPORT[0], height=VIEWPORT[1], deviceScaleFactor=1,
                  mobile=False, session=self.session)

    def _read(self, timeout: float = 120.0):
        import os
        import select

        while b"\0" not in self._buf:
            assert select.select([self._out_r], [], [], timeout)[0], f"Chromium said nothing for {timeout} s"
            chunk = os.read(self._out_r, 1 << 20)
            assert chunk, "Chromium closed its DevTools pipe"
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return self._json.loads(msg)

    def send(self, method, session=None, **params):
        import os

        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self._cmd_w, self._json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._next_id:
                assert "error" not in reply, f"{method}: {reply['error']}"
                return reply["result"]
            self.events.append(reply)

    def wait_for(self, method, timeout=60.0):
        import time

        deadline = time.monotonic() + timeout
        while not any(e.get("method") == method for e in self.events):
            assert time.monotonic() < deadline, f"no {method} within {timeout} s"
            self.events.append(self._read())

    def _load(self, url: str, expression: str):
        self.events = []
        self.send("Page.navigate", url=url, session=self.session)
        self.wait_for("Page.loadEventFired")
        result = self.send("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True,
                           timeout=60000, session=self.session)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"]["value"]

    def dom(self, url: str) -> str:
        return self._load(url, DOM)

    def visit(self, url: str) -> dict:
        """The page's measurements (MEASURE), with every request it made and every console error."""
        page = self._load(url, MEASURE)
        params = [(e["method"], e.get("params", {})) for e in self.events]
        page["requests"] = [p["request"]["url"] for m, p in params if m == "Network.requestWillBeSent"]
        page["errors"] = [p["exceptionDetails"].get("text", "") for m, p in params if m == "Runtime.exceptionThrown"]
        page["errors"] += [f'{p["entry"]["text"]} {p["entry"].get("url", "")}'.strip() for m, p in params
                           if m == "Log.entryAdded" and p["entry"]["level"] == "error"]
        return page

    def close(self):
        import os

        try:
            self.send("Browser.close")
        except (AssertionError, OSError):
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        os.close(self._cmd_w)
        os.close(self._out_r)
        self._profile.cleanup()


def _site_pages(out: Path) -> list[str]:
    """Every HTML page of the built site, as a path under its root ("" for the home page)."""
    pages = [str(p.parent.relative_to(out)) + "/" for p in sorted(out.rglob("index.html"))]
    return ["" if p == "./" else p for p in pages if not p.startswith("assets/")] + ["404.html"]


_BROWSER: list = []  # the module's one headless Chromium, started by the first page it opens


def _browser() -> _Chromium:
    if not _BROWSER:
        _BROWSER.append(_Chromium())
    return _BROWSER[0]


_SWEPT: dict = {}  # {page: measurements}, once _sweep has opened every page


def _sweep(out: Path, base: str) -> dict:
    """{page: measurements, and its DOM under "html"} for every page of the site, each opened once."""
    if not _SWEPT:
        _SWEPT.update({page: _browser().visit(f"{base}/{page}") for page in _site_pages(out)})
    return _SWEPT


@pytest.fixture(scope="module")
def browsed(site):
    """{page: measurements} for every page of the site."""
    return _sweep(*site)


def _expect_none(found: dict[str, list], what: str, head: str = "") -> None:
    """Fail with "N <what> on M pages:" and, per page, up to three of them, if any page has one."""
    found = {page or "(home)": items for page, items in found.items() if items}
    if found:
        lines = [f"{head}{sum(map(len, found.values()))} {what} on {len(found)} pages:"]
        lines += [f"  {page}: {len(items)}: {items[:3]}" for page, items in found.items()]
        pytest.fail("\n".join(lines), pytrace=False)


def _check_diagrams_are_drawn_at_their_size(site, browsed):
    """Every mermaid diagram is drawn at its natural size, labels and all (not shrunk to the column inside a
    box of its natural height), and is at most two columns wide (a wider one is redrawn top-down)."""
    bad = {page: [f"{d.get('kind')} {d.get('natural')} px drawn at {d.get('scale')} (labels {d.get('label')} px)"
                  for d in r["diagrams"]
                  if not d["drawn"] or d["scale"] < 0.95 or d["label"] < 10 or d["natural"] > 2 * r["column"]]
           for page, r in browsed.items()}
    assert sum(len(r["diagrams"]) for r in browsed.values()) >= 10, "the chapters' diagrams are not on the site"
    _expect_none(bad, "diagrams shrunk or unreadable")


def _check_math_is_typeset(site, browsed):
    """No TeX is left as text: no \\( \\) \\[ \\] $$ or $...$ outside code, every arithmatex span typeset,
    no MathJax error."""
    raw = {page: r["rawTex"] + [f"{r['untypeset']} formulas not typeset"] * bool(r["untypeset"])
           + [f"{r['mathErrors']} MathJax errors"] * bool(r["mathErrors"]) for page, r in browsed.items()}
    _expect_none(raw, "raw TeX texts")


def _check_notebooks_show_no_stderr_or_progress_bars(site, browsed):
    """Stored outputs as the reader sees them: no stderr stream, no progress bar (a tqdm bar stored without
    its widget state renders as its first frame, 0 %, forever)."""
    noise = {page: [f"{r['stderr']} stderr blocks"] * bool(r["stderr"]) + r["bars"] for page, r in browsed.items()}
    assert any(p.startswith("notebooks/") for p in browsed), "no notebook page on the site"
    _expect_none(noise, "stderr blocks and progress bars")


def _check_titles_name_the_page(site, browsed):
    """The header (shown once the reader scrolls) and search name the page ("05 · Paged KV blocks —
    notebook"), not its nav label ("Chapter", "Notebook")."""
    import json

    generic = {"Chapter", "Notebook", "Text", ""}
    bad = {page: [r["headerTitle"]] for page, r in browsed.items() if page != "404.html" and r["headerTitle"] in generic}
    out, _ = site
    docs = json.loads((out / "search" / "search_index.json").read_text())["docs"]
    bad["search"] = [d["location"] for d in docs if "#" not in d["location"] and d["title"].strip() in generic]
    _expect_none(bad, "generic titles")


def _check_anchor_links_resolve(site, browsed):
    """Every link to a place on a page of the site (the table of contents' included) finds an element with
    that id there."""
    from urllib.parse import unquote, urlsplit

    ids = {urlsplit("/" + page).path: set(r["ids"]) for page, r in browsed.items()}
    dead = {}
    for page, r in browsed.items():
        dead[page] = sorted({f"{link['text']!r} -> {link['href'].split('/', 3)[-1]}" for link in r["links"]
                             if (u := urlsplit(link["href"])).hostname == "127.0.0.1" and u.fragment
                             and u.path in ids and unquote(u.fragment) not in ids[u.path]})
    _expect_none(dead, "dead anchor links")


def _check_content_fits_the_column(site, browsed):
    """At 1280 px nothing hides behind a sideways scroll: code blocks (chapters and notebook inputs) show
    whole lines, tables fit, no plot is drawn at less than half its width, the page itself does not scroll
    sideways. (Notebook *outputs* keep their lines and may scroll: they are print_table's columns.)"""
    over = {page: [f"code: {c}" for c in r["codeClipped"]] + [f"table: {t}" for t in r["tablesScrolling"]]
            + [f"plot {p['natural']} px drawn at {p['width']} px" for p in r["plotsSmall"]]
            + ["the page scrolls sideways"] * r["pageScrolls"] for page, r in browsed.items()}
    counts = {kind: sum(x.startswith(kind) for items in over.values() for x in items) for kind in ("code", "table", "plot")}
    _expect_none(over, "overflowing blocks", head=f"{counts}: ")


def _check_is_offline(site, browsed):
    """No page asks any host but the site for anything (fonts, scripts, styles), and no page logs an error
    or throws. (MathJax 2's HTML-CSS output declares an `about:blank` font, which Chromium refuses with a
    console error: harmless, and the only error allowed.)"""
    from urllib.parse import urlsplit

    outside = {page: [q for q in r["requests"] if urlsplit(q).scheme not in ("data", "blob", "about")
                      and urlsplit(q).hostname != "127.0.0.1"] for page, r in browsed.items()}
    _expect_none(outside, "requests to outside hosts")
    errors = {page: [e for e in r["errors"] if "about:blank" not in e] for page, r in browsed.items()}
    _expect_none(errors, "console errors")


SITE_CHECKS = [_check_diagrams_are_drawn_at_their_size, _check_math_is_typeset,
               _check_notebooks_show_no_stderr_or_progress_bars, _check_titles_name_the_page,
               _check_anchor_links_resolve, _check_content_fits_the_column, _check_is_offline]
