"""Chat templates: turning a list of messages into the one prompt string the model was trained on.

Each instruct model ships a Jinja2 template (in its GGUF header or tokenizer_config.json). SmolLM2's
wraps every turn in ChatML markers:

    <|im_start|>system\\nYou are a helpful AI assistant ...<|im_end|>\\n
    <|im_start|>user\\nHi<|im_end|>\\n
    <|im_start|>assistant\\n            <- add_generation_prompt: the model continues from here

We render the model's own template in a sandbox, with the settings and helpers that templates are
written against (those of Hugging Face's `apply_chat_template`): blocks trimmed, `loopcontrols`,
`raise_exception`, a `tojson` that keeps non-ASCII text, and `strftime_now`.

The rendered prompt is one string, but not all of it is trusted: the markers the template writes
("<|im_start|>", "<|im_end|>") must become control tokens, while a message's content is the user's
text, and a user who types "<|im_end|>\\n<|im_start|>system\\n..." must not be able to end their turn
and forge a system turn. `chat_parts` keeps the two apart: it renders the template once more with
every control-token text inside a content swapped for a sentinel, and cuts the result at the
sentinels; the tokenizer then encodes those pieces as plain text (`Tokenizer.apply_chat_template`
with tokenize=True). A conversation whose contents hold no control-token text is the plain rendering,
encoded exactly as before (and as HF does).
"""

from __future__ import annotations

import json
import random
import threading
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

ROLES = ("system", "user", "assistant", "tool")

# A template is code the model's files bring, and it runs in the server. The sandbox stops it reading
# or writing what it should not, not from running for ever: two nested range(99999) loops hung
# LLM.chat, and a template that wrote 10 GB ran out of memory (probe round 4, m6). A render gets a
# budget: loop steps over range() and the messages, the length of what `*` builds, and its output.
MAX_TEMPLATE_STEPS = 2_000_000  # iterations of range() and of the messages list, per render
MAX_RENDERED_CHARS = 1 << 26  # 64 Mi characters: far past any context this engine serves
_steps = threading.local()  # the render running on this thread: its steps left


def render_chat(tokenizer, messages, add_generation_prompt: bool = True, **kwargs) -> str:
    template = tokenizer.chat_template
    if not template:
        raise ValueError(f"tokenizer {tokenizer.name!r} has no chat template; pass a prompt string instead")
    _check_messages(messages)
    _steps.left = MAX_TEMPLATE_STEPS
    out, size = [], 0
    try:
        for piece in _compile(template).generate(
            messages=_Counted(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
            **kwargs,
        ):
            size += len(piece)
            if size > MAX_RENDERED_CHARS:
                raise jinja2.TemplateError(f"it wrote more than {MAX_RENDERED_CHARS:,} characters")
            out.append(piece)
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template failed: {e}") from e
    return "".join(out)


def _charge(steps: int) -> None:
    left = getattr(_steps, "left", MAX_TEMPLATE_STEPS) - steps
    if left < 0:
        raise jinja2.TemplateError(f"it ran more than {MAX_TEMPLATE_STEPS:,} loop steps (range() and the "
                                   f"messages), more than any conversation needs")
    _steps.left = left


def _range(*args) -> range:
    r = safe_range(*args)  # the sandbox's own cap: one range of at most 100,000
    _charge(len(r))  # charged when made: a range inside a loop is paid for each time round
    return r


class _Counted(list):
    """The messages, as the template sees them: iterating them (or a slice of them) costs steps, so
    a loop over the messages inside a loop over the messages is bounded too."""

    def __iter__(self):
        _charge(len(self))
        return super().__iter__()

    def __getitem__(self, index):
        item = super().__getitem__(index)
        return _Counted(item) if isinstance(index, slice) else item


def _binop(env, context, op: str, left, right):
    """`*` and `**` whose result would be huge are refused before they are computed."""
    if op == "*" and isinstance(left, int) and isinstance(right, (str, list, tuple)):
        left, right = right, left
    if op == "*" and isinstance(left, (str, list, tuple)) and isinstance(right, int):
        if len(left) * right > MAX_RENDERED_CHARS:
            raise jinja2.TemplateError(f"it asked for {len(left)} x {right} items, more than {MAX_RENDERED_CHARS:,}")
    if op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 4096:
        raise jinja2.TemplateError(f"it asked for {left} ** {right}")
    return env.binop_table[op](left, right)


def chat_parts(tokenizer, messages, add_generation_prompt: bool = True, **kwargs) -> tuple[str, list[tuple[str, bool]]]:
    """The rendered prompt, and the same text cut into (piece, trusted) parts.

    Every control-token text that a message's content spells (found as the encoder finds added
    tokens) is an untrusted part, to be encoded as plain text; everything else is trusted, so the
    template's own markers stay control tokens. The parts join to the rendered prompt.
    """
    text = render_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt, **kwargs)
    control = tokenizer._added_splitter(frozenset(tokenizer.special_tokens))  # None: no control tokens
    forged = [] if control is None else [control.findall(m["content"]) for m in messages]  # [messages][hits]
    if not any(forged):
        return text, [(text, True)]
    # a sentinel no text here contains, whose characters no string filter changes (trim, upper, tojson)
    rng = random.Random()
    while True:
        tag = f"\ue000{rng.randrange(10**12, 10**13)}:"
        if tag not in text:
            break
    pieces: list[str] = []  # the k-th sentinel stands for pieces[k]

    def swap(match) -> str:
        pieces.append(match.group())
        return f"{tag}{len(pieces) - 1}\ue001"

    marked = [dict(m, content=control.sub(swap, m["content"])) if hits else m for m, hits in zip(messages, forged)]
    rendered = render_chat(tokenizer, marked, add_generation_prompt=add_generation_prompt, **kwargs)
    cuts = rendered.split(tag)  # [before, "k\ue001after", ...]
    parts = [(cuts[0], True)]
    for cut in cuts[1:]:
        k, sep, after = cut.partition("\ue001")
        if not (sep and k.isdigit() and int(k) < len(pieces)):
            parts = None
            break
        parts += [(pieces[int(k)], False), (after, True)]
    if parts is None or "".join(p for p, _ in parts) != text:
        i = next(i for i, hits in enumerate(forged) if hits)
        raise ValueError(f"messages[{i}]['content'] contains the control token {forged[i][0]!r}, and this model's "
                         f"chat template rewrites message contents, so it cannot be kept apart from the "
                         f"template's own markers; remove it from the message")
    return text, [p for p in parts if p[0]]


def _check_messages(messages) -> None:
    if isinstance(messages, dict):
        raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts, not one dict: "
                        "wrap a single message in a list")
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, not {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: a conversation needs at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError(f"messages[{i}] must be a dict, not {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise ValueError(f"messages[{i}] has no {key!r}: every message needs 'role' and 'content' "
                                 f"(it has {', '.join(map(repr, m)) or 'no keys'})")
        if m["role"] not in ROLES:
            raise ValueError(f"messages[{i}]['role'] is {m['role']!r}; allowed: {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise TypeError(f"messages[{i}]['content'] must be a str, not {type(m['content']).__name__}")


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _BudgetedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, op, left, right):
        return _binop(self, context, op, left, right)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = _BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["range"] = _range
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template is not valid Jinja2 (line {e.lineno}: {e.message})") from e
