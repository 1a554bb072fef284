"""mkdocs hook: serve MathJax and mermaid from the site itself, so math and diagrams render without a network.

MathJax's files come from the `jupyter-server-mathjax` package (MathJax 2.7, in the docs extra). Notebook
pages load it through mkdocs-jupyter's `custom_mathjax_url`; chapter pages through overrides/main.html.

Mermaid's come from the npm registry's `mermaid` package, pinned in vendor_mermaid.py, which `make mermaid`
installs into the virtual environment. overrides/main.html loads it on the pages that have a diagram, and
Material for MkDocs, finding `mermaid` already there, draws the diagrams with it instead of fetching it.
"""

import importlib.util
import shutil
from pathlib import Path

from mkdocs.exceptions import PluginError


def _vendor_mermaid():
    path = Path(__file__).with_name("vendor_mermaid.py")
    spec = importlib.util.spec_from_file_location("minillm_site_vendor_mermaid", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_config(config, **kwargs):
    mermaid = _vendor_mermaid()
    if not mermaid.is_installed():
        raise PluginError(f"mermaid {mermaid.VERSION} is not installed in {mermaid.installed_dir()}: run `make mermaid` "
                          "(python chapters/_site/vendor_mermaid.py), which fetches it from the npm registry")
    return config


def _copy_tree(src: Path, dst: Path, **kwargs) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, **kwargs)


def on_post_build(config, **kwargs):
    import jupyter_server_mathjax

    assets = Path(config["site_dir"]) / "assets"
    _copy_tree(Path(jupyter_server_mathjax.__file__).parent / "static", assets / "mathjax",
               ignore=shutil.ignore_patterns("localization", "*.md", "unpacked"))
    _copy_tree(_vendor_mermaid().installed_dir(), assets / "mermaid")
