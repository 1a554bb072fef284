"""mkdocs hook: serve MathJax from the site itself, so math renders without a network.

The files come from the `jupyter-server-mathjax` package (MathJax 2.7, in the docs extra). Notebook
pages load it through mkdocs-jupyter's `custom_mathjax_url`; chapter pages through overrides/main.html.
"""

import shutil
from pathlib import Path


def on_post_build(config, **kwargs):
    import jupyter_server_mathjax

    src = Path(jupyter_server_mathjax.__file__).parent / "static"
    dst = Path(config["site_dir"]) / "assets" / "mathjax"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("localization", "*.md", "unpacked"))
