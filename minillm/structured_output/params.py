"""What a request asks its output to look like: vLLM's `StructuredOutputsParams`.

Exactly one of the five forms is set. The names are vLLM's, so a request written for vLLM's
`SamplingParams(structured_outputs=StructuredOutputsParams(json=...))` runs here unchanged.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """json: a JSON Schema (dict, or its text); regex: a regular expression the whole output must match;
    choice: a list of strings, the output is one of them; grammar: an EBNF/GBNF grammar (llama.cpp's
    dialect, start rule `root`); json_object: True for "any JSON object" (OpenAI's json_object mode)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        given = [f for f in _FIELDS if _is_set(f, getattr(self, f))]
        if len(given) != 1:
            what = "none" if not given else " and ".join(given)
            raise ValueError(f"StructuredOutputsParams takes exactly one of {', '.join(_FIELDS)}; got {what}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = _json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON Schema object, not {type(schema).__name__}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"structured_outputs.regex must be a str, not {type(self.regex).__name__}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError(f"structured_outputs.grammar must be a str, not {type(self.grammar).__name__}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a list of strings")
            if not self.choice:
                raise ValueError("structured_outputs.choice must name at least one string")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, not {type(self.json_object).__name__}")

    @property
    def kind(self) -> str:
        """Which form is set: 'json', 'regex', 'choice', 'grammar' or 'json_object'."""
        return next(f for f in _FIELDS if _is_set(f, getattr(self, f)))

    def spec(self) -> Any:
        """The set value in a canonical, hashable-as-text form (the compile cache's key)."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            value = _json.loads(value) if isinstance(value, str) else value
            # Not sort_keys: the order of "properties" is the order the output must follow.
            return _json.dumps(value, separators=(",", ":"))
        if self.kind == "choice":
            return _json.dumps(list(value))
        return value


def _is_set(field: str, value) -> bool:
    return value is not False if field == "json_object" else value is not None
