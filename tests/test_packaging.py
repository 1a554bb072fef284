"""The distribution ships every package: a wheel built from pyproject.toml imports everything."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "minillm").rglob("__init__.py")}
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
    assert "minillm.kernels" in listed and not (ROOT / "minillm" / "kernels").exists()


@pytest.mark.slow
def test_a_plain_install_imports(tmp_path):
    """Install (not editable) into a folder and import every module from there."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(target), str(ROOT)], check=True, capture_output=True, cwd=tmp_path)
    code = ("import minillm, minillm.kernels, minillm.labs.ch02, minillm.loader.gguf_loader, minillm.bench.ceilings;"
            "print(minillm.__file__)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert out.stdout.startswith(str(target))
