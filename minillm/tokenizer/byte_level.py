"""The byte-level alphabet: every byte spelled as one printable character.

A byte-level BPE works on raw UTF-8 bytes, so it never meets an unknown character. GPT-2 stores its
vocabulary as text, though, and a byte like 0x20 (space) or 0x0A (newline) would make the vocab file
hard to read and hard to split on whitespace. So each of the 256 bytes gets a stand-in character:
the printable Latin-1 bytes stand for themselves, and the 68 others (control codes, space, and a few
Latin-1 gaps) are shifted up to U+0100 and beyond, in byte order. That is why a leading space shows
up as 'Ġ' (U+0120, byte 0x20) and a newline as 'Ċ' (U+010A) in GPT-2, Llama-3, Qwen and SmolLM vocabs.
"""

from functools import cache


@cache
def byte_to_char() -> dict[int, str]:
    """byte value (0..255) -> the character that spells it in a byte-level vocab."""
    printable = (
        list(range(ord("!"), ord("~") + 1))  # 33..126: ASCII without space and DEL
        + list(range(ord("¡"), ord("¬") + 1))  # 161..172
        + list(range(ord("®"), ord("ÿ") + 1))  # 174..255 (173 is the soft hyphen, invisible)
    )
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


@cache
def char_to_byte() -> dict[str, int]:
    """The inverse of byte_to_char."""
    return {c: b for b, c in byte_to_char().items()}


def spell(data: bytes) -> str:
    """bytes -> their byte-level spelling, e.g. b' hi' -> 'Ġhi'."""
    table = byte_to_char()
    return "".join(table[b] for b in data)


def unspell(token: str) -> bytes:
    """A vocab entry -> the bytes it stands for.

    An entry with characters outside the alphabet (some files store added tokens as plain text) is
    taken as UTF-8 text, which is also what Hugging Face does with such entries.
    """
    table = char_to_byte()
    if all(c in table for c in token):
        return bytes(table[c] for c in token)
    return token.encode("utf-8")
