"""The course map's module lists, the modules hash a notebook records, and `minillm labs stale`'s verdicts:
current when the stored hash equals today's, stale (since the first commit that changed a module) when
it differs, unknown when the stored header has none."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from minillm import course, course_status
from minillm.notebook import header_line

ROOT = Path(__file__).resolve().parent.parent


def test_every_chapter_names_files_that_exist():
    for c in course.CHAPTERS:
        assert (ROOT / "chapters" / c.text).is_file(), c.text
        assert (ROOT / "notebooks" / f"{c.notebook}.ipynb").is_file(), c.notebook
        assert (ROOT / "notebooks" / "labs" / f"{c.lab}.py").is_file(), c.lab
        assert course.module_files(c, course.repo_roots(ROOT)), f"chapter {c.number} has no module files"


def test_installed_and_checkout_hashes_agree():
    """The notebook hashes the installed package; `labs stale` the checkout: the same files, the same hash."""
    for c in course.CHAPTERS:
        assert course.modules_hash(c) == course.modules_hash(c, course.repo_roots(ROOT))


def test_header_records_commit_and_modules_hash():
    line = header_line("09")
    assert f"modules {course.modules_hash(course.chapter('09'))}" in line and " · " in line and "commit " in line


def _notebook(path: Path, header: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cells": [{"cell_type": "code", "source": "nb.header('09')", "metadata": {},
                                           "outputs": [{"output_type": "stream", "name": "stdout",
                                                        "text": [header + "\n"]}]}],
                                "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A git repository holding chapter 09's module files and its notebook."""
    c = course.chapter("09")
    for rel, f in course.module_files(c, course.repo_roots(ROOT)).items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, tmp_path / rel)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "modules")
    return tmp_path


def test_current_stale_unknown(repo):
    c = course.chapter("09")
    nb = repo / "notebooks" / f"{c.notebook}.ipynb"
    run_commit = _git(repo, "rev-parse", "--short=12", "HEAD")
    h = course.modules_hash(c, course.repo_roots(repo))
    head = "minillm 0.1.0 · chapter 09 | GPU NVIDIA H100 80GB HBM3 (sm_90, 132 SMs, 79 GiB), CUDA 13.0 | 2026-11-25"
    _notebook(nb, f"{head} | commit {run_commit} · modules {h}")
    s = course_status.chapter_status(repo, c)
    assert (s.state, s.device, s.date, s.commit) == ("current", "H100 80GB HBM3", "2026-11-25", run_commit)

    # an unrelated commit keeps it current; a commit that changes a module file makes it stale since then
    (repo / "README.md").write_text("x")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "add", "README.md")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "unrelated")
    assert course_status.chapter_status(repo, c).state == "current"
    rs = repo / "minillm" / "sampling" / "rejection_sampler.py"
    rs.write_text(rs.read_text() + "\n# changed\n")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "change the sampler")
    changed = _git(repo, "rev-parse", "--short", "HEAD")
    (repo / "README.md").write_text("y")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "later")
    s = course_status.chapter_status(repo, c)
    assert (s.state, s.since, s.words) == ("stale", changed, f"stale since {changed}")

    _notebook(nb, head)  # a run from before hashes were recorded
    assert course_status.chapter_status(repo, c).state == "unknown"


def test_block_is_written_between_markers(tmp_path):
    rows = course_status.course_status(ROOT)
    f = tmp_path / "README.md"
    f.write_text(f"before\n{course_status.BEGIN}\nold\n{course_status.END}\nafter\n")
    course_status.write(tmp_path, [f], rows)
    text = f.read_text()
    assert text.startswith("before\n") and text.endswith("\nafter\n") and "old" not in text
    assert "| 09 | [Speculative decoding](chapters/09-speculative-decoding.md) |" in text
    with pytest.raises(ValueError, match="outputs-status"):
        course_status.replace_block("no markers", "x")


def test_readme_and_home_page_carry_the_block():
    for f in (ROOT / "README.md", ROOT / "chapters" / "index.md"):
        text = f.read_text()
        assert course_status.BEGIN in text and course_status.END in text, f


def test_labs_stale_command(repo, capsys):
    from minillm.cli import main

    c = course.chapter("09")
    _notebook(repo / "notebooks" / f"{c.notebook}.ipynb", "minillm 0.1.0 · chapter 09 | CPU x | 2026-11-25")
    assert main(["labs", "stale", "--repo", str(repo)]) == 0
    out = capsys.readouterr().out
    assert "09  09_speculative_decoding" in out and "unknown" in out and "re-run" in out
    assert main(["labs", "stale", "--repo", str(repo), "--check"]) == 1  # CI can demand current outputs


def test_a_run_without_git_is_placed_by_its_hash(repo):
    """A GPU machine's copy has no git: the header says "commit unknown", and the run's commit is found by
    the modules hash among the commits that changed the module files."""
    c = course.chapter("09")
    first = _git(repo, "rev-parse", "--short", "HEAD")
    h = course.modules_hash(c, course.repo_roots(repo))
    assert course_status.hashes_by_commit(repo, c) == [(first, h)]
    _notebook(repo / "notebooks" / f"{c.notebook}.ipynb", f"minillm · chapter 09 | CPU x | commit unknown · modules {h}")
    rs = repo / "minillm" / "spec_decode" / "ngram.py"
    rs.write_text(rs.read_text() + "\n# changed\n")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "change the proposer")
    changed = _git(repo, "rev-parse", "--short", "HEAD")
    s = course_status.chapter_status(repo, c)
    assert (s.state, s.commit, s.since) == ("stale", first, changed)
