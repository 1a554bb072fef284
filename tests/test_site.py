"""The course site: `mkdocs build --strict` succeeds, and in headless Chromium a chapter page, a
rendered notebook with its plots, the math on both and the chapters' mermaid diagrams actually render,
with no network beyond the site itself (MathJax and mermaid are served by the site)."""

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
                  "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", "--virtual-time-budget=20000"]
# Material draws each mermaid diagram into a closed shadow root, which --dump-dom does not print. A page
# asked for with this query gets, first thing in its <head>, a shim that makes attachShadow hand back the
# host element itself, so the diagram's SVG lands in the DOM that --dump-dom prints.
LIGHT_DOM = "light-dom"
LIGHT_DOM_SHIM = b"<script>Element.prototype.attachShadow = function () { return this; };</script>"


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.fail("headless Chromium is needed for the site test: `make chromium` (apt-get install chromium)")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
                          cwd=ROOT, capture_output=True, text=True, env={**_env(), "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    handler = functools.partial(_SiteHandler, directory=str(out))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield out, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


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
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        proc = subprocess.run([_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


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
    _, base = site
    dom = _dom(f"{base}/notebooks/09_speculative_decoding/")
    assert re.search(r"\.jp-OutputArea-output pre[^{]*\{[^}]*white-space: pre !important", dom)


def test_home_page_shows_outputs_status(site):
    _, base = site
    dom = _dom(f"{base}/")
    for n in ("00", "09", "12"):
        # the run cell may hold the commit as inline code: "H100 · 2026-11-25 · <code>d828ef7</code>"
        assert re.search(rf"<td>{n}</td>\s*<td><a [^>]*>[^<]+</a></td>\s*<td>(?:[^<]|<code>[^<]*</code>)*</td>\s*"
                         rf"<td>(current|stale|unknown)",
                         dom), f"chapter {n}'s outputs status missing from the home page"
