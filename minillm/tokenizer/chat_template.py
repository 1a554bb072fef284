"""Chat templates: turning a list of messages into the one prompt string the model was trained on.

Each instruct model ships a Jinja2 template (in its GGUF header or tokenizer_config.json). SmolLM2's
wraps every turn in ChatML markers:

    <|im_start|>system\\nYou are a helpful AI assistant ...<|im_end|>\\n
    <|im_start|>user\\nHi<|im_end|>\\n
    <|im_start|>assistant\\n            <- add_generation_prompt: the model continues from here

We render the model's own template in a sandbox, with the settings and helpers that templates are
written against (those of Hugging Face's `apply_chat_template`): blocks trimmed, `loopcontrols`,
`raise_exception`, a `tojson` that keeps non-ASCII text, and `strftime_now`.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant", "tool")


def render_chat(tokenizer, messages, add_generation_prompt: bool = True, **kwargs) -> str:
    template = tokenizer.chat_template
    if not template:
        raise ValueError(f"tokenizer {tokenizer.name!r} has no chat template; pass a prompt string instead")
    _check_messages(messages)
    try:
        return _compile(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
            **kwargs,
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template failed: {e}") from e


def _check_messages(messages) -> None:
    if isinstance(messages, dict) or not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, not {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: a conversation needs at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError(f"messages[{i}] must be a dict, not {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}]['role'] is {m.get('role')!r}; allowed: {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise TypeError(f"messages[{i}]['content'] must be a str, not {type(m.get('content')).__name__}")


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template is not valid Jinja2 (line {e.lineno}: {e.message})") from e
