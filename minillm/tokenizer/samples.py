"""Texts that exercise a tokenizer: fixed samples of many kinds, plus fresh random Unicode.

Used by the parity tests, the chapter 01 notebook and its lab. The fixed samples cover prose, code,
numbers, whitespace runs, emoji and ZWJ sequences, many scripts, combining marks and added tokens.
"""

from __future__ import annotations

import random
import unicodedata

PROSE = [
    "The quick brown fox jumps over the lazy dog.",
    "Inference is different from training: one request at a time, one token at a time, and the memory "
    "of every past token kept around so the next one can attend to it.",
    "It's what they'd said: we'll see, you're sure, I've done it, she'll go, HE'S HERE, they'LL come.",
    "Dr. Smith (née Jones) paid $1,234.56 on 2024-03-15 at 09:41 -- 12% more than in Q3!",
    "«Bonjour», dit-elle. Über den Fluß; naïve café; São Paulo; Ærøskøbing; İstanbul; ﬁnance.",
]
CODE = [
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    '{"model": "smollm2", "layers": 30, "heads": [9, 3], "rope": {"theta": 1e5}}',
    "<div class=\"note\"><a href='https://example.com/?q=a&b=c'>link</a></div>",
    "SELECT name, COUNT(*) FROM t WHERE x >= 10 GROUP BY name;  -- trailing comment",
    "x=[i**2 for i in range(10)if i%2];print(x)#done",
]
NUMBERS = ["0 1 12 123 1234 12345 123456789", "3.14159265358979", "-0.5e-10 +7E+3 0xDEADbeef 0b1010",
           "1,000,000 and 1.000.000 and 1 000 000", "٣٤٥ ४२ 五十六 ½ ² Ⅻ"]
WHITESPACE = ["   leading", "trailing   ", "a  b   c    d", "\n\n\nnew\r\nlines\r\r", "\t\ttabs\t and \t spaces",
              "   \n   \n", " ", "\u00a0non-breaking\u2009thin\u3000ideographic", "\x0bvertical\x0cfeed"]
EMOJI = ["😀😃😄", "👍🏽 thumbs", "👩‍👩‍👧‍👦 family", "🏳️‍🌈 flag", "🇫🇷🇯🇵 flags", "❤️‍🔥", "🧑🏿‍💻 coder"]
SCRIPTS = [
    "北京是中国的首都。", "東京は日本の首都です。", "서울은 한국의 수도입니다.", "Москва — столица России.",
    "القاهرة عاصمة مصر", "ירושלים", "नई दिल्ली भारत की राजधानी है।", "กรุงเทพมหานคร", "Αθήνα",
]
COMBINING = ["e\u0301 vs é", "n\u0303", "a\u0308\u0304", "Z̤͔ͧ̑̓ä͖̭̈̇lͮ̒ͫǧ̗͚̚o̙̔ͮ̇͐̇", "\u0915\u094d\u0937", "ñ" * 3]
SPECIAL = ["<|im_start|>user\nHi<|im_end|>", "a<|endoftext|>b", "<|im_end|><|im_end|>", "<|im_start", "<repo_name>x"]

FIXED = PROSE + CODE + NUMBERS + WHITESPACE + EMOJI + SCRIPTS + COMBINING + SPECIAL

# Code point ranges to draw random characters from, weighted toward what text contains.
_RANGES = [(0x20, 0x7E, 6), (0x00, 0x20, 1), (0xA0, 0x24F, 2), (0x370, 0x52F, 1), (0x600, 0x6FF, 1),
           (0x900, 0x97F, 1), (0x2000, 0x2BFF, 2), (0x3000, 0x30FF, 1), (0x4E00, 0x9FFF, 2),
           (0xAC00, 0xD7A3, 1), (0x1F300, 0x1FAFF, 2), (0x10000, 0x10FFFF, 1)]


def random_unicode(rng: random.Random, max_len: int = 40) -> str:
    """A random string of characters whose Unicode category every current Unicode version agrees on.

    HF tokenizers' regex engine and the `regex` package carry Unicode tables of different versions, so
    a code point assigned only recently (a letter in one, unassigned in the other) is cut differently.
    We therefore draw characters that Python's own (older) table already assigns, plus code points in
    the planes no version assigns (4-13), and never surrogates.
    """
    weights = [w for *_, w in _RANGES]
    out, n = [], rng.randint(1, max_len)
    while len(out) < n:
        lo, hi, _ = rng.choices(_RANGES, weights)[0]
        cp = rng.randint(lo, hi)
        if 0xD800 <= cp <= 0xDFFF:
            continue
        c = chr(cp)
        if unicodedata.category(c) != "Cn" or 0x40000 <= cp <= 0xDFFFF:
            out.append(c)
    return "".join(out)


def random_texts(seed: int, n: int = 400) -> list[str]:
    rng = random.Random(seed)
    texts = [random_unicode(rng) for _ in range(n)]
    # glue fixed samples together at random, so chunks meet in new ways
    texts += [" ".join(rng.sample(FIXED, 3)) for _ in range(n // 4)]
    return texts
