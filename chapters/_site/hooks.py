"""mkdocs hook: serve MathJax and mermaid from the site itself, so math and diagrams render without a network;
name every page after its chapter; write the home page's outputs-status table from the notebooks themselves.

MathJax's files come from the `jupyter-server-mathjax` package (MathJax 2.7, in the docs extra). Notebook
pages load it through mkdocs-jupyter's `custom_mathjax_url`; chapter pages through overrides/main.html.

Mermaid's come from the npm registry's `mermaid` package, pinned in vendor_mermaid.py, which `make mermaid`
installs into the virtual environment. overrides/main.html loads it on the pages that have a diagram, and
Material for MkDocs, finding `mermaid` already there, draws the diagrams with it instead of fetching it.

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
# Runs after mermaid.min.js and before Material initializes mermaid: flowcharts keep their natural width.
MERMAID_INIT = """(function () {
  var initialize = mermaid.initialize.bind(mermaid);
  mermaid.initialize = function (cfg) {
    cfg = Object.assign({}, cfg || {});
    cfg.flowchart = Object.assign({}, cfg.flowchart || {}, {useMaxWidth: false});
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
    on a chapter, each quoted figure says where it is checked."""
    if page.file.src_uri == "index.md":
        from minillm import course_status

        repo = Path(config["config_file_path"]).resolve().parent
        markdown = course_status.replace_block(markdown, course_status.block(course_status.course_status(repo)),
                                               "chapters/index.md")
    elif m := re.match(r"(\d\d)-", page.file.src_uri):
        markdown = markdown.replace(QUOTED, f'<span class="nbfig" title="quoted from notebook {m.group(1)}\'s stored output">')
    return markdown


def on_page_context(context, page, config, **kwargs):
    """<title>: the chapter and which of its pages this is (mkdocs' default is the nav label, "Chapter")."""
    section = page.parent.title if page.parent else ""
    if section:
        kind = "notebook" if page.file.src_uri.endswith(".ipynb") else "text"
        page.meta["site_title"] = f"{section} — {kind}"
    return context


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
