"""Mermaid's JavaScript for the site, so the chapters' diagrams render without a network.

Material for MkDocs draws a ```mermaid fence with the global `mermaid` if the page has one, and
otherwise fetches mermaid from a CDN. No pinned PyPI package ships mermaid's own browser build for
this project's Pythons, so it comes from the npm registry's `mermaid` package: pinned by version and
by the tarball's sha512 (the `dist.integrity` npm records), and installed into the virtual
environment, out of git (dist/mermaid.min.js is 3.5 MB), as <venv>/share/minillm-site/mermaid-<version>/.
The mkdocs hook copies it into the site at build time; overrides/main.html loads it on the pages that
have a diagram.

    python chapters/_site/vendor_mermaid.py    # what `make mermaid` runs; does nothing once installed

To move to another release: set VERSION, and INTEGRITY from `npm view mermaid@VERSION dist.integrity`.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "11.17.2"  # the major that Material 9.x's own loader asks for (mermaid@11)
INTEGRITY = "sha512-V6K3C8EBdEsPFZXSKMJe6ppQOENxuHARr9GvHX4hh47lAbhMRD9qf4oEK7LoaRQxULMa80/qt5gHO73aCleBBg=="
FILES = {"package/dist/mermaid.min.js": "mermaid.min.js", "package/LICENSE": "LICENSE"}  # tarball path -> name


def installed_dir() -> Path:
    return Path(sys.prefix) / "share" / "minillm-site" / f"mermaid-{VERSION}"


def is_installed() -> bool:
    return all((installed_dir() / name).is_file() for name in FILES.values())


def _integrity(path: Path) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(path.read_bytes()).digest()).decode()


def install() -> Path:
    dest = installed_dir()
    if is_installed():
        return dest
    npm = shutil.which("npm")
    if npm is None:
        raise SystemExit("npm is needed to fetch mermaid for the site: `make mermaid` installs it (apt-get install npm)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        subprocess.run([npm, "pack", f"mermaid@{VERSION}", "--pack-destination", tmp, "--ignore-scripts",
                        "--loglevel=error"], check=True, stdout=subprocess.DEVNULL)
        tgz = Path(tmp) / f"mermaid-{VERSION}.tgz"
        if (got := _integrity(tgz)) != INTEGRITY:
            raise SystemExit(f"mermaid@{VERSION} from npm has {got}, expected {INTEGRITY}: not installing it")
        staging = Path(tmp) / "staging"
        staging.mkdir()
        with tarfile.open(tgz) as tar:
            for member, name in FILES.items():
                (staging / name).write_bytes(tar.extractfile(member).read())
        if dest.exists():  # a partial install: replace it whole
            shutil.rmtree(dest)
        os.replace(staging, dest)  # same filesystem: the folder appears complete or not at all
    return dest


if __name__ == "__main__":
    print(f"mermaid {VERSION}: {install()}")
