"""mkdocs hook: serve MathJax and mermaid from the site itself, so math and diagrams render without a network;
name every page after its chapter; write the home page's outputs-status table from the notebooks themselves.

MathJax's files come from the `jupyter-server-mathjax` package (MathJax 2.7, in the docs extra). Notebook
pages load it through mkdocs-jupyter's `custom_mathjax_url`; chapter pages through overrides/main.html.

Mermaid's come from the npm registry's `mermaid` package, pinned in vendor_mermaid.py, which `make mermaid`
installs into the virtual environment. overrides/main.html loads it on the pages that have a diagram, and
Material for MkDocs, finding `mermaid` already there, draws the diagrams with it instead of fetching it.

The site's styles are site.css (copied to assets/minillm.css): code wraps, tables fit, diagrams are drawn
at their natural size, notebook pages drop the prompt column. Notebook pages lose their stderr streams and
progress bars at render time (the stored outputs stay as the GPU run wrote them) and get a table of
contents built from their headings' own ids.

MathJax 2.7's default font is TeX, which jupyter-server-mathjax does not ship (it ships STIX-Web): the
local configuration written below (config/local/minillm.js) selects STIX-Web, so no font request fails.
"""

import importlib.util
import re
import shutil
from pathlib import Path

from mkdocs.exceptions import PluginError


def _vendor_mermaid():
    path = Path(__file__).with_name("vendor_mermaid.py")
    spec = importlib.util.spec_from_file_location("minillm_site_vendor_mermaid", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Loaded after MathJax's combined configuration (…?config=TeX-AMS-MML_HTMLorMML-full,Safe,local/minillm).
MATHJAX_LOCAL_CONFIG = """MathJax.Hub.Config({
  "HTML-CSS": {availableFonts: ["STIX-Web"], preferredFont: "STIX-Web", webFont: "STIX-Web", imageFont: null}
});
MathJax.Ajax.loadComplete("[MathJax]/config/local/minillm.js");
"""
# Runs after mermaid.min.js and before Material initializes mermaid: flowcharts and sequence diagrams keep
# their natural width (site.css draws the host as a block that scrolls sideways when a diagram is wider).
MERMAID_INIT = """(function () {
  var initialize = mermaid.initialize.bind(mermaid);
  mermaid.initialize = function (cfg) {
    cfg = Object.assign({}, cfg || {});
    cfg.flowchart = Object.assign({}, cfg.flowchart || {}, {useMaxWidth: false});
    cfg.sequence = Object.assign({}, cfg.sequence || {}, {useMaxWidth: false});
    return initialize(cfg);
  };
})();
"""
QUOTED = '<span class="nbfig">'


def on_config(config, **kwargs):
    mermaid = _vendor_mermaid()
    if not mermaid.is_installed():
        raise PluginError(f"mermaid {mermaid.VERSION} is not installed in {mermaid.installed_dir()}: run `make mermaid` "
                          "(python chapters/_site/vendor_mermaid.py), which fetches it from the npm registry")
    return config


def on_page_markdown(markdown, page, config, **kwargs):
    """The home page's outputs-status table, computed now from the stored notebooks and today's modules;
    on a chapter, each quoted figure says where it is checked. Every page of a chapter is titled after it
    ("05 · Paged KV blocks — notebook"), not by its nav label ("Notebook"): the header shows that title
    once the reader scrolls, and search lists it (search reads the title before on_page_context)."""
    if page.parent:
        page.meta.setdefault("title", f"{page.parent.title} — {_kind(page)}")
    if page.file.src_uri == "index.md":
        from minillm import course_status

        repo = Path(config["config_file_path"]).resolve().parent
        markdown = course_status.replace_block(markdown, course_status.block(course_status.course_status(repo)),
                                               "chapters/index.md")
    elif m := re.match(r"(\d\d)-", page.file.src_uri):
        markdown = markdown.replace(QUOTED, f'<span class="nbfig" title="quoted from notebook {m.group(1)}\'s stored output">')
    return markdown


def _kind(page) -> str:
    return "notebook" if page.file.src_uri.endswith(".ipynb") else "text"


def on_page_context(context, page, config, **kwargs):
    """<title>: the chapter and which of its pages this is (mkdocs' default is the nav label, "Chapter")."""
    section = page.parent.title if page.parent else ""
    if section:
        page.meta["site_title"] = f"{section} — {_kind(page)}"
    return context


# One output of a rendered notebook (nbconvert's lab template), up to its closing tag (_div_end).
OUTPUT_START = re.compile(r'<div class="jp-OutputArea-child[" ]')
# tqdm's text: "capturing CUDA graphs:  45%|████▌     | 9/20 [00:01<00:01,  9.39it/s]" (escaped in the HTML)
PROGRESS_LINE = re.compile(r"^[^\n]*\d+%\|[^|\n]*\| *[\d.]+[kMG]?/[\d.]+[kMG]? \[[^\]\n]*\]\s*$")


def _div_end(html: str, start: int) -> int:
    """The index just past the </div> that closes the <div> at `start` (output text is escaped: no raw tags)."""
    depth, pos = 0, start
    for m in re.compile(r"<div\b|</div>").finditer(html, start):
        depth += 1 if m.group() != "</div>" else -1
        pos = m.end()
        if depth == 0:
            return pos
    raise PluginError("unbalanced <div> in a rendered notebook")


def _is_noise(output: str) -> bool:
    """A stderr stream, or an output that is nothing but progress-bar frames. A tqdm bar stored without its
    widget state renders as its text fallback, the first frame ("0%| | 0/300 [00:00<?, ?it/s]"), forever;
    a bar written to stderr renders as a pink block per refresh. Neither is a result."""
    if 'data-mime-type="application/vnd.jupyter.stderr"' in output:
        return True
    if "<img" in output or "<table" in output:
        return False
    import html as htmllib

    text = htmllib.unescape(re.sub(r"<[^>]+>", "", output))
    lines = [line for line in re.split(r"[\r\n]+", text) if line.strip()]
    return bool(lines) and all(PROGRESS_LINE.match(line) for line in lines)


def strip_notebook_noise(html: str) -> tuple[str, int]:
    """The rendered notebook without its stderr streams and progress bars (the stored outputs stay as the
    GPU run wrote them), and how many outputs went."""
    parts, pos, removed = [], 0, 0
    for m in OUTPUT_START.finditer(html):
        if m.start() < pos:
            continue
        end = _div_end(html, m.start())
        if _is_noise(html[m.start():end]):
            parts.append(html[pos:m.start()])
            pos, removed = end, removed + 1
    parts.append(html[pos:])
    return "".join(parts), removed


def _heading_toc(html: str):
    """The table of contents of a rendered notebook, from its headings' own ids. mkdocs-jupyter builds it
    from a markdown conversion of the notebook, which drops inline code from a heading ("HF `tokenizers`,
    token for token" -> "HF , token for token") and so links to an id the page does not have."""
    import html as htmllib

    from mkdocs.structure.toc import get_toc

    tokens, stack = [], []
    for m in re.finditer(r'<h([1-6]) id="([^"]+)"[^>]*>(.*?)</h\1>', html, flags=re.S):
        level, name = int(m.group(1)), re.sub(r'<a class="anchor-link".*?</a>', "", m.group(3), flags=re.S)
        token = {"level": level, "id": htmllib.unescape(m.group(2)),
                 "name": htmllib.unescape(re.sub(r"<[^>]+>", "", name)).strip(), "children": []}
        while stack and stack[-1]["level"] >= level:
            stack.pop()
        (stack[-1]["children"] if stack else tokens).append(token)
        stack.append(token)
    return get_toc(tokens)


def on_page_content(html, page, config, **kwargs):
    """A notebook page: no stderr or progress-bar outputs, and a table of contents whose links land."""
    if page.file.src_uri.endswith(".ipynb"):
        html, _ = strip_notebook_noise(html)
        page.toc = _heading_toc(html)
    return html


def _copy_tree(src: Path, dst: Path, **kwargs) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, **kwargs)


def on_post_build(config, **kwargs):
    import jupyter_server_mathjax

    assets = Path(config["site_dir"]) / "assets"
    _copy_tree(Path(jupyter_server_mathjax.__file__).parent / "static", assets / "mathjax",
               ignore=shutil.ignore_patterns("localization", "*.md", "unpacked"))
    (assets / "mathjax" / "config" / "local").mkdir(parents=True, exist_ok=True)
    (assets / "mathjax" / "config" / "local" / "minillm.js").write_text(MATHJAX_LOCAL_CONFIG)
    _copy_tree(_vendor_mermaid().installed_dir(), assets / "mermaid")
    (assets / "mermaid" / "minillm-init.js").write_text(MERMAID_INIT)
    shutil.copyfile(Path(__file__).with_name("site.css"), assets / "minillm.css")
