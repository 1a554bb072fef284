"""Are a notebook's stored outputs those of today's code? (`minillm labs stale`)

A chapter notebook's first output is `minillm.notebook.header`'s line, which ends with the commit it
ran at and a hash of the chapter's module files (minillm.course). Here the stored line is compared
with the files of the checkout:

    current   the hash equals today's: the stored numbers are those of this code
    stale     the hash differs; "since" is the first commit after the run that changed a module file
    unknown   the stored line has no hash (a run from before hashes were recorded)

A run made from a copy without git records "commit unknown"; its commit is then found by the hash,
among the commits that changed the chapter's module files.

The course map in README.md and on the site carries the same table, between the markers below,
written by `minillm labs stale --write README.md chapters/index.md` (`make outputs-status`) and by the
site's build hook.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .course import CHAPTERS, Chapter, module_files, modules_hash, repo_roots

BEGIN, END = "<!-- outputs-status:begin -->", "<!-- outputs-status:end -->"
_HASH = re.compile(r"\bmodules ([0-9a-f]{12})\b")
_COMMIT = re.compile(r"\bcommit ([0-9a-f]{7,40}|unknown)\b")
_DATE = re.compile(r"\b(\d{4}-\d{2}-\d{2})\b")


@dataclass
class Status:
    chapter: Chapter
    state: str  # current, stale, unknown, no notebook
    device: str = ""
    date: str = ""
    commit: str = ""  # the run's commit, "" when the header has none
    since: str = ""  # stale: the first commit after the run that changed a module file

    @property
    def words(self) -> str:
        if self.state == "stale":
            return f"stale since {self.since}" if self.since else "stale (module files changed since the run)"
        if self.state == "unknown":
            return "unknown (the run recorded no module hash)"
        return self.state


def stored_header(notebook: Path) -> str:
    """The text of the notebook's first output that is a header line ("minillm ... · chapter NN | ..."), or ""."""
    nb = json.loads(notebook.read_text())
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            text = out.get("text") or out.get("data", {}).get("text/plain", "")
            text = "".join(text) if isinstance(text, list) else text
            for line in text.splitlines():
                if line.startswith("minillm ") and " | " in line:
                    return line
    return ""


def _device(header: str) -> str:
    fields = header.split(" | ")
    if len(fields) < 2:
        return ""
    dev = fields[1]
    if dev.startswith("GPU "):
        name = dev[4:].split(" (")[0]
        return name.removeprefix("NVIDIA ")
    return "CPU"


def _git(repo: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def hashes_by_commit(repo: Path, c: Chapter, limit: int = 300) -> list[tuple[str, str]]:
    """[(commit, modules hash)] for the last `limit` commits that changed c's module files, newest first:
    the hash each of them gives (the same hash as `course.modules_hash` on that commit's checkout)."""
    log = _git(repo, "log", f"-n{limit}", "--format=%h", "--", *c.modules)
    if not log:
        return []
    commits, out = log.split(), []
    for commit in commits:
        listing = _git(repo, "ls-tree", "-r", "--name-only", commit, "--", *c.modules) or ""
        names = sorted(n for n in listing.split("\n")
                       if n and (n in c.modules or (n.endswith(".py") and any(
                           n.startswith(m) for m in c.modules if m.endswith("/")))))
        if not names:
            continue
        blobs = subprocess.run(["git", "cat-file", "--batch"], cwd=repo, capture_output=True, timeout=120,
                               input="".join(f"{commit}:{n}\n" for n in names).encode()).stdout
        h, pos = hashlib.sha256(), 0
        for n in names:  # each answer: "<sha> blob <size>\n<content>\n"
            end = blobs.index(b"\n", pos)
            size = int(blobs[pos:end].split()[2])
            content = blobs[end + 1:end + 1 + size]
            pos = end + 1 + size + 1
            h.update(n.encode() + b"\0" + hashlib.sha256(content).digest())
        out.append((commit, h.hexdigest()[:12]))
    return out


def stale_since(repo: Path, c: Chapter, commit: str) -> str:
    """The first commit after `commit` that changed one of c's module files ("" if git cannot tell)."""
    if not commit or commit == "unknown":
        return ""
    files = list(module_files(c, repo_roots(repo)))
    log = _git(repo, "log", "--reverse", "--format=%h", f"{commit}..HEAD", "--", *files)
    if log and log.split():
        return log.split()[0]
    return ""


def chapter_status(repo: Path, c: Chapter) -> Status:
    notebook = repo / "notebooks" / f"{c.notebook}.ipynb"
    if not c.notebook or not notebook.is_file():
        return Status(c, "no notebook")
    header = stored_header(notebook)
    date = _DATE.search(header)
    commit = _COMMIT.search(header)
    s = Status(c, "unknown", _device(header), date.group(1) if date else "", commit.group(1) if commit else "")
    stored = _HASH.search(header)
    if stored is None:
        return s
    if stored.group(1) == modules_hash(c, repo_roots(repo)):
        s.state = "current"
        return s
    s.state = "stale"
    if not s.commit or s.commit == "unknown":  # a run from a copy without git: find its commit by the hash
        history = hashes_by_commit(repo, c)
        found = next((i for i, (_, h) in enumerate(history) if h == stored.group(1)), None)
        if found is not None:
            s.commit = history[found][0]
            s.since = history[found - 1][0] if found > 0 else ""
            return s
    s.since = stale_since(repo, c, s.commit)
    return s


def course_status(repo: Path) -> list[Status]:
    return [chapter_status(repo, c) for c in CHAPTERS]


def markdown(rows: list[Status], link_prefix: str = "") -> str:
    """The per-chapter table that README.md and the site's home page carry between BEGIN and END."""
    lines = ["| # | chapter | notebook outputs from | outputs |", "|---|---|---|---|"]
    for s in rows:
        c = s.chapter
        run = " · ".join(x for x in (s.device, s.date, f"`{s.commit}`" if s.commit else "") if x) or "—"
        lines.append(f"| {c.number} | [{c.title}]({link_prefix}{c.text}) | {run} | {s.words} |")
    return "\n".join(lines)


def block(rows: list[Status], link_prefix: str = "") -> str:
    note = ("<!-- written by `minillm labs stale --write` (make outputs-status); edits here are overwritten -->")
    return f"{BEGIN}\n{note}\n\n{markdown(rows, link_prefix)}\n\n{END}"


def replace_block(text: str, new_block: str, where: str = "the file") -> str:
    """text with its BEGIN..END block replaced by new_block."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{where} has no {BEGIN} ... {END} block to write the outputs status into")
    return text[:start] + new_block + text[end + len(END):]


def write(repo: Path, paths: list[Path], rows: list[Status]) -> None:
    """Rewrite the block in each file; links point at chapters/ from the repository root, at the page itself
    from chapters/."""
    for path in paths:
        prefix = "" if path.resolve().parent == (repo / "chapters").resolve() else "chapters/"
        path.write_text(replace_block(path.read_text(), block(rows, prefix), str(path)))
