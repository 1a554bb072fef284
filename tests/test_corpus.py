"""The Wikipedia corpus (minillm/data/): markup stripping, the dump parser, the cache, the split.

The markup stripper is held to hand-written plain text; the real corpus (fetched once with pip into
~/.cache/minillm/, or read from $MINILLM_CORPUS) to its known size and a disjoint, stable split.
`corpus` is the fixture the perplexity and AWQ/GPTQ tests import: it skips, saying why, only on a
machine with neither a network nor a cached copy.
"""

from __future__ import annotations

import bz2
import hashlib
import zipfile

import pytest

from minillm.data import corpus as corpus_mod
from minillm.data.corpus import Article, corpus_path, format_cache, load_corpus, parse_cache, parse_dump
from minillm.data.wikitext import strip_markup


@pytest.fixture(scope="session")
def corpus():
    try:
        return load_corpus()
    except RuntimeError as e:  # no network and no cache: nothing to test against
        pytest.skip(f"no corpus: {e}")


WIKI = """{{Infobox country |name=Atlantis |capital={{lang|el|Poseidonia}} }}
'''Atlantis''' is a [[fiction]]al [[island|isle]] in [[Plato]]'s works.<ref>Plato, ''Timaeus''.</ref> It sank.<ref name="x"/>
[[File:Atlantis map.jpg|thumb|A map of [[Atlantis]] by [[Athanasius Kircher]]]]
<!-- a hidden comment -->
== History ==
The story is told in ''[[Critias (dialogue)|Critias]]''&nbsp;(360&nbsp;BC), see [http://example.org the text].
{| class="wikitable"
|-
| a || b {{!}} c
|}
* First item with [[link#Section|a link]]
# Second item<sub>2</sub>
=== Names ===
H<sub>2</sub>O &ndash; water.
== References ==
* {{cite book |title=Timaeus}}
* Some source
[[Category:Fictional islands]]
[[de:Atlantis]]
"""

PLAIN = """Atlantis is a fictional isle in Plato's works. It sank.

History
The story is told in Critias\u00a0(360\u00a0BC), see the text.

First item with a link
Second item2
Names
H2O \u2013 water."""


def test_strip_markup_matches_hand_written_text():
    assert strip_markup(WIKI) == PLAIN.replace("\u00a0", " ")


def test_strip_markup_nested_templates_and_tables_go_whole():
    text = "a {{x|{{y|{{z}}}}|w}} b\n{|\n| {|\n| inner\n|}\n| outer\n|}\nc"
    assert strip_markup(text) == "a b\n\nc"  # the table leaves a paragraph break


def _dump(pages: list[tuple[str, str, str, bool]]) -> bytes:
    ns = "http://www.mediawiki.org/xml/export-0.10/"
    redirect = '<redirect title="X" />'
    body = "".join(f"<page><title>{t}</title><ns>{n}</ns>{redirect if r else ''}"
                   f'<revision><text xml:space="preserve">{x}</text></revision></page>' for t, n, x, r in pages)
    return f'<mediawiki xmlns="{ns}">{body}</mediawiki>'.encode()


def test_parse_dump_keeps_articles_only():
    long = "Words about a thing. " * 20
    xml = _dump([("A", "0", f"'''A''' {long}", False), ("Talk:A", "1", long, False),
                 ("B", "0", "#REDIRECT [[A]]", True), ("C", "0", "too short", False),
                 ("D", "0", f"{{{{stub}}}} {long} &lt;ref&gt;src&lt;/ref&gt;", False)])
    articles = parse_dump(xml)
    assert [a.title for a in articles] == ["A", "D"]
    assert articles[1].text == long.strip() and "src" not in articles[1].text


def test_cache_format_round_trip():
    arts = [Article("One", "First para.\n\nSecond para."), Article("Two = Three", "x = y\nz")]
    assert parse_cache(format_cache(arts)) == tuple(arts)
    with pytest.raises(ValueError, match="title line"):
        parse_cache("no title here\n")
    with pytest.raises(ValueError, match="no articles"):
        parse_cache("\n\n")


def test_corpus_path_override(monkeypatch, tmp_path):
    monkeypatch.setenv("MINILLM_CORPUS", str(tmp_path / "c.txt"))
    assert corpus_path() == tmp_path / "c.txt"
    assert corpus_path(tmp_path / "d.txt") == tmp_path / "d.txt"
    monkeypatch.delenv("MINILLM_CORPUS")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert corpus_path() == tmp_path / "minillm" / corpus_mod.CACHE_NAME


def test_offline_without_cache_is_a_clear_error(monkeypatch, tmp_path):
    with pytest.raises(FileNotFoundError, match="MINILLM_CORPUS"):
        load_corpus(tmp_path / "missing.txt", download=False)

    class Failed:
        returncode, stdout, stderr = 1, "", "ERROR: Could not find a version (network unreachable)"

    monkeypatch.setattr(corpus_mod.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(RuntimeError, match="no network.*MINILLM_CORPUS"):
        load_corpus(tmp_path / "missing.txt")
    assert not (tmp_path / "missing.txt").exists()


def test_a_wheel_with_other_data_is_refused(tmp_path):
    wheel = tmp_path / "gensim-4.4.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(corpus_mod.MEMBER, bz2.compress(_dump([("A", "0", "x " * 200, False)])))
    with pytest.raises(ValueError, match="SHA-256"):
        corpus_mod.build_cache(tmp_path / "c.txt", wheel)
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("other.txt", "x")
    with pytest.raises(ValueError, match="no member"):
        corpus_mod.build_cache(tmp_path / "c.txt", wheel)
    assert hashlib.sha256(b"").hexdigest() != corpus_mod.MEMBER_SHA256


def test_real_corpus_and_its_split(corpus):
    arts = corpus.articles
    assert len(arts) == 106 and arts[0].title == "Anarchism"
    titles = [a.title for a in arts]
    assert len(set(titles)) == len(titles)
    cal, ev = corpus.calibration, corpus.evaluation
    assert len(cal) + len(ev) == len(arts) and {a.title for a in cal}.isdisjoint(a.title for a in ev)
    assert len(ev) == len(arts) // corpus_mod.EVAL_EVERY
    # plain prose: no markup survived
    text = corpus.calibration_text() + corpus.eval_text()
    for mark in ("{{", "}}", "[[", "]]", "<ref", "'''", "&nbsp;", "{|"):
        assert mark not in text, mark
    assert 2_000_000 < len(text) < 3_000_000
    assert load_corpus(corpus.path, download=False) == corpus  # the cache reads back the same
