"""A real English corpus for calibration and perplexity: 100 Wikipedia articles, as plain text.

    from minillm.data import load_corpus
    corpus = load_corpus()               # fetched once, then read from the cache
    corpus.calibration_text()            # what AWQ/GPTQ look at
    corpus.eval_text()                   # held out: what perplexity is measured on

The text is the English Wikipedia extract that PyPI's `gensim==4.4.0` wheel ships as test data
(`enwiki-latest-pages-articles1.xml-...-shortened.bz2`, 6 MB of XML, CC BY-SA 3.0, Wikipedia's
contributors). The first use downloads the wheel with `pip download --no-deps` (gensim itself is
never installed), reads that one member with `zipfile`, checks its SHA-256, decompresses it, keeps
the articles (namespace 0, no redirects), strips their markup (wikitext.py) and writes the text to

    $MINILLM_CORPUS                      if set (a file path), else
    ~/.cache/minillm/enwiki-gensim-4.4.0.txt

A machine without a network (the GPU machine) reads a copy of that file: set MINILLM_CORPUS to it.
In the file each article starts with a line `= Title =`; no other line can look like that, because
every heading line inside an article was turned into plain text.

The split is by article, so no paragraph of the evaluation text was seen during calibration:
articles in file order, every `EVAL_EVERY`-th one (the 5th, 10th, ...) held out. It depends on
nothing but the file, so every machine gets the same two parts.
"""

from __future__ import annotations

import bz2
import hashlib
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .wikitext import strip_markup

WHEEL = "gensim==4.4.0"
MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
MEMBER_SHA256 = "a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d"
CACHE_NAME = "enwiki-gensim-4.4.0.txt"
EVAL_EVERY = 5  # every 5th article is held out: 20% of the articles for evaluation
MIN_CHARS = 200  # shorter articles (stubs, lists emptied by the markup stripper) are left out


@dataclass(frozen=True)
class Article:
    title: str
    text: str


@dataclass(frozen=True)
class Corpus:
    articles: tuple[Article, ...]
    path: Path

    @property
    def calibration(self) -> tuple[Article, ...]:
        return tuple(a for i, a in enumerate(self.articles) if i % EVAL_EVERY != EVAL_EVERY - 1)

    @property
    def evaluation(self) -> tuple[Article, ...]:
        return tuple(a for i, a in enumerate(self.articles) if i % EVAL_EVERY == EVAL_EVERY - 1)

    def calibration_text(self) -> str:
        return "\n\n".join(a.text for a in self.calibration)

    def eval_text(self) -> str:
        return "\n\n".join(a.text for a in self.evaluation)


def corpus_path(path: str | os.PathLike | None = None) -> Path:
    """Where the cached text lives: `path`, else $MINILLM_CORPUS, else ~/.cache/minillm/."""
    if path is None:
        path = os.environ.get("MINILLM_CORPUS") or Path(
            os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "minillm" / CACHE_NAME
    return Path(path).expanduser()


def load_corpus(path: str | os.PathLike | None = None, download: bool = True) -> Corpus:
    """The corpus from its cache file, building the file first (a download) if it is not there."""
    file = corpus_path(path)
    if not file.is_file():
        if not download:
            raise FileNotFoundError(f"no corpus at {file} (download=False): run load_corpus() once on a machine "
                                    f"with a network, then copy the file here and set MINILLM_CORPUS to it")
        build_cache(file)
    return Corpus(parse_cache(file.read_text(encoding="utf-8")), file)


def build_cache(file: Path, wheel: str | os.PathLike | None = None) -> Path:
    """Write the corpus's text to `file`, from a gensim wheel on disk or one `pip download` fetches."""
    with tempfile.TemporaryDirectory() as tmp:
        wheel_file = Path(wheel) if wheel is not None else _download_wheel(Path(tmp))
        with zipfile.ZipFile(wheel_file) as z:
            try:
                packed = z.read(MEMBER)
            except KeyError:
                raise ValueError(f"{wheel_file.name} has no member {MEMBER}") from None
    digest = hashlib.sha256(packed).hexdigest()
    if digest != MEMBER_SHA256:
        raise ValueError(f"{MEMBER} has SHA-256 {digest}, expected {MEMBER_SHA256}: not the corpus minillm knows")
    articles = parse_dump(bz2.decompress(packed))
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp_file = file.with_name(file.name + ".part")  # a reader never sees half a file
    tmp_file.write_text(format_cache(articles), encoding="utf-8")
    tmp_file.replace(file)
    return file


def _download_wheel(folder: Path) -> Path:
    # Any platform's wheel carries the same test data; asking for one fixed platform means pip never
    # tries to build the source distribution on a machine with no matching wheel.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--quiet", "-d", str(folder), WHEEL]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(folder.glob("gensim-*.whl"))
    if result.returncode != 0 or not wheels:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"could not download the corpus ({WHEEL}'s wheel with pip; no network?): "
                           f"{' / '.join(tail)}. On a machine without a network, copy the cached text file from "
                           f"one that has it ({corpus_path()}) and set MINILLM_CORPUS to its path")
    return wheels[0]


def parse_dump(xml: bytes) -> list[Article]:
    """A MediaWiki XML export -> its articles (namespace 0, not redirects), markup stripped."""
    articles = []
    for _, elem in ET.iterparse(_as_file(xml)):
        if _local(elem.tag) != "page":
            continue
        fields = {_local(child.tag): child for child in elem}
        ns, title = fields.get("ns"), fields.get("title")
        text = next((c for c in elem.iter() if _local(c.tag) == "text"), None)
        if ns is not None and ns.text == "0" and "redirect" not in fields and text is not None and title is not None:
            plain = strip_markup(text.text or "")
            if len(plain) >= MIN_CHARS:
                articles.append(Article(title.text.strip(), plain))
        elem.clear()
    return articles


def _as_file(data: bytes):
    import io

    return io.BytesIO(data)


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]  # "{http://www.mediawiki.org/xml/export-0.10/}page" -> "page"


def format_cache(articles: list[Article]) -> str:
    return "".join(f"= {a.title} =\n\n{a.text}\n\n" for a in articles)


def parse_cache(text: str) -> tuple[Article, ...]:
    articles, title, body = [], None, []
    for line in text.split("\n"):
        if line.startswith("= ") and line.endswith(" =") and len(line) > 4:
            if title is not None:
                articles.append(Article(title, "\n".join(body).strip()))
            title, body = line[2:-2], []
        elif title is not None:
            body.append(line)
        elif line.strip():
            raise ValueError(f"corpus file does not start with an article title line ('= Title ='): {line[:60]!r}")
    if title is not None:
        articles.append(Article(title, "\n".join(body).strip()))
    if not articles:
        raise ValueError("corpus file holds no articles")
    return tuple(articles)
