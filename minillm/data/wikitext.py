"""Wiki markup to plain text: a small parser for the Wikipedia dump the corpus comes from.

An article's source is wikitext. What a reader sees is prose; what the source holds besides is markup
that would teach a model nothing about English and would skew a perplexity:

    {{cite web |url=...}}  {{Infobox ...}}     templates (nested)           -> dropped
    <ref>...</ref>  <ref name="x"/>           footnotes                     -> dropped
    {| class="wikitable" ... |}               tables (nested)               -> dropped
    [[Paris]]  [[France|French]]              links                         -> their text: Paris, French
    [[File:x.jpg|thumb|caption [[y]]]]        images, categories, languages -> dropped
    [http://example.org Example]              external links                -> Example
    == History ==                             headings                      -> History (a line of its own)
    '''bold''' ''italic''  <sub>2</sub>  &nbsp; emphasis, HTML, entities    -> the text alone
    * item  # item  : indent                  list and indent marks         -> the item's text

Templates are removed by counting `{{` and `}}`, so a template inside another's argument goes with
it; tables and links, from the inside out: each pass takes the innermost `[[...]]` (one with no `[[`
inside), so a link inside an image caption goes first and the image then matches. Sections that are lists of sources (References, External links, ...) are cut whole.
"""

from __future__ import annotations

import html
import re

_COMMENT = re.compile(r"<!--.*?-->", re.S)
_REF = re.compile(r"<ref[^>/]*/>|<ref[^>]*>.*?</ref>", re.S | re.I)
_DROP_TAGS = re.compile(r"<(math|gallery|timeline|score|syntaxhighlight|source|pre|imagemap)\b[^>]*>.*?</\1>",
                        re.S | re.I)
_TABLE = re.compile(r"\{\|(?:(?!\{\|).)*?\|\}", re.S)  # innermost: no table opening inside
_LINK = re.compile(r"\[\[((?:(?!\[\[|\]\]).)*)\]\]", re.S)  # innermost: no [[ or ]] inside (single brackets may be)
_EXTERNAL = re.compile(r"\[(?:https?:)?//[^\s\]]+\s*([^\]]*)\]")
_TAG = re.compile(r"</?[a-zA-Z][^>]*>")
_HEADING = re.compile(r"^(=+)\s*(.*?)\s*\1\s*$", re.M)
_EMPHASIS = re.compile(r"'{2,}")
_LIST = re.compile(r"^[*#:;]+\s*", re.M)
_SPACES = re.compile(r"[ \t\u00a0]+")
_BLANKS = re.compile(r"\n{3,}")

# A link to one of these namespaces is not prose (an image, a category, another language's article).
_NON_TEXT_LINKS = ("file:", "image:", "category:", "media:", "wikt:", "wiktionary:", ":category:")
_INTERLANGUAGE = re.compile(r"^[a-z]{2,3}(-[a-z]+)?:")
# Sections that list sources, not prose: cut from their heading to the next heading of any level.
CUT_SECTIONS = ("references", "external links", "see also", "further reading", "notes", "bibliography",
                "sources", "footnotes", "citations")


def _innermost(pattern: re.Pattern, repl, text: str) -> str:
    """Apply `pattern` until nothing matches: each pass removes one level of nesting."""
    while True:
        new = pattern.sub(repl, text)
        if new == text:
            return text
        text = new


def _drop_templates(text: str) -> str:
    """Remove every outermost {{...}} span, counting '{{' and '}}' (a template's arguments may hold
    lone braces, so a regex for 'no braces inside' misses some). An unclosed '{{' loses only itself."""
    spans, opens, i = [], [], 0
    while i < len(text) - 1:
        pair = text[i:i + 2]
        if pair == "{{":
            opens.append(i)
            i += 2
        elif pair == "}}" and opens:
            start = opens.pop()
            if not opens:
                spans.append((start, i + 2))
            i += 2
        else:
            i += 1
    spans += [(o, o + 2) for o in opens]  # unclosed
    out, last = [], 0
    for start, end in sorted(spans):
        out.append(text[last:start])
        last = end
    return "".join(out) + text[last:]


def _link_text(m: re.Match) -> str:
    target, _, label = m.group(1).partition("|")
    low = target.strip().lower()
    if low.startswith(_NON_TEXT_LINKS) or _INTERLANGUAGE.match(low):
        return ""
    text = label.rsplit("|", 1)[-1] if label else target
    return text.split("#")[0] if not label and "#" in text and not text.startswith("#") else text


def _cut_sections(text: str) -> str:
    out, skipping = [], False
    for line in text.split("\n"):
        m = _HEADING.match(line)
        if m:
            skipping = m.group(2).strip().lower() in CUT_SECTIONS
        if not skipping:
            out.append(line)
    return "\n".join(out)


def strip_markup(wikitext: str) -> str:
    """An article's wikitext -> its plain text: paragraphs separated by blank lines, headings as lines."""
    text = _COMMENT.sub("", wikitext)
    text = _REF.sub("", text)
    text = _DROP_TAGS.sub("", text)
    text = _drop_templates(text)
    text = _innermost(_TABLE, "", text)
    text = _cut_sections(text)
    text = _innermost(_LINK, _link_text, text)
    text = _EXTERNAL.sub(r"\1", text)
    text = _TAG.sub("", text)
    text = html.unescape(text)  # &nbsp; &ndash; ... (the XML layer already decoded &lt; &amp; &quot;)
    text = _HEADING.sub(r"\2", text)
    text = _EMPHASIS.sub("", text)
    text = _LIST.sub("", text)
    lines = []
    for line in text.split("\n"):
        line = _SPACES.sub(" ", line).strip()
        # leftovers of removed constructs: table rows, a lone closing brace, a bare "thumb|..."
        if line.startswith(("|", "!", "{", "}")) or line in ("()", "( )"):
            continue
        lines.append(line.replace(" ,", ",").replace("( ", "(").replace(" )", ")").replace("()", "").strip())
    return _BLANKS.sub("\n\n", "\n".join(lines)).strip()
