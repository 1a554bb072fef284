"""The course site: `mkdocs build --strict` succeeds, and in headless Chromium a chapter page, a
rendered notebook with its plots, and the math on both actually render (MathJax served offline)."""

from __future__ import annotations

import functools
import http.server
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--virtual-time-budget=20000"]


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
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(out))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield out, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _env():
    import os

    return dict(os.environ)


@functools.cache
def _dom(url: str) -> str:
    with tempfile.TemporaryDirectory() as profile:
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
                  "Paged KV blocks", "Prefix caching", "Continuous batching"):
        assert title in dom, f"{title!r} missing from the course map"


def _math_ok(dom: str) -> bool:
    return 'class="MathJax' in dom and 'class="merror"' not in dom and "Math Processing Error" not in dom


@pytest.mark.parametrize("page", ["00-why-inference-is-different/", "01-tokenizer/", "02-the-model/", "03-kv-cache/",
                                  "04-flash-attention/", "05-paged-kv/", "06-prefix-caching/",
                                  "07-continuous-batching/"])
def test_chapter_page_renders(site, page):
    _, base = site
    dom = _dom(f"{base}/{page}")
    assert "<h1" in dom and "md-content" in dom
    assert "arithmatex" not in dom or _math_ok(dom), "MathJax did not typeset the chapter's math"


def test_chapter_math_renders(site):
    _, base = site
    dom = _dom(f"{base}/00-why-inference-is-different/")
    assert "arithmatex" in dom and _math_ok(dom), "MathJax did not typeset the chapter's math"


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
