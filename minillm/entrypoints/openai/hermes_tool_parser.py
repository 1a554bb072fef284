"""tool_choice "auto": the model decides, in its own format, and the calls are read out of its text.

The format read here is Hermes' (vLLM's `--tool-call-parser hermes`), the one Qwen2.5/Qwen3, Hermes
and SmolLM3 chat templates teach their models:

    Some text the user sees.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Rome"}}
    </tool_call>

Text outside the blocks is the message's content; each block whose JSON holds a name and arguments
is a call. Nothing constrains the text (the model may answer in prose), so a block that does not parse
stays content, as written. Streamed, content goes out as it comes except a tail that could be the start
of "<tool_call>" (held back until it is not); a call goes out whole, in one delta, once its block
closes. The non-streamed answer is the same parser fed the whole text at once: both carry the same
content and calls.
"""

from __future__ import annotations

import json

from .tool_calls import new_call_id

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser:
    """feed(text) / finish() -> (content delta, tool_calls delta entries) for one choice."""

    def __init__(self):
        self.buffer = ""  # text not handed out yet: a possible start of OPEN, or an open block
        self.in_block = False
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buffer += text
        content, calls = [], []
        while True:
            if self.in_block:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    break  # the block is still being written
                block, self.buffer = self.buffer[:end], self.buffer[end + len(CLOSE):]
                self.in_block = False
                call = self._call(block)
                if call is None:  # not a call: the text stays the model's words
                    content.append(OPEN + block + CLOSE)
                else:
                    calls.append(call)
                continue
            start = self.buffer.find(OPEN)
            if start >= 0:
                content.append(self.buffer[:start])
                self.buffer, self.in_block = self.buffer[start + len(OPEN):], True
                continue
            keep = _partial_open(self.buffer)  # "...<tool_" might become "<tool_call>"
            content.append(self.buffer[: len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            break
        return "".join(content), calls

    def finish(self) -> tuple[str, list[dict]]:
        """The end of the text: a held-back tail, or a block that never closed, is content."""
        rest = (OPEN if self.in_block else "") + self.buffer
        self.buffer, self.in_block = "", False
        return rest, []

    def _call(self, block: str) -> dict | None:
        try:
            obj = json.loads(block)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        call = {"index": self.num_calls, "id": new_call_id(), "type": "function",
                "function": {"name": obj["name"], "arguments": args}}
        self.num_calls += 1
        return call


def _partial_open(text: str) -> int:
    """How many characters at the end of text are a proper prefix of OPEN."""
    for k in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0


def parse_all(text: str) -> tuple[str | None, list[dict]]:
    """The whole text at once -> (content or None when there is none beside calls, calls)."""
    p = HermesToolParser()
    content, calls = p.feed(text)
    rest, _ = p.finish()
    content += rest
    return (content if content.strip() or not calls else None), calls
