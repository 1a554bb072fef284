"""Tool calling on chapter 14's grammars: `tools` + `tool_choice` become a JSON Schema the output must
follow, and the output becomes `message.tool_calls` (streamed: `delta.tool_calls`, as vLLM sends them).

    tool_choice = {"type": "function", "function": {"name": "get_weather"}}
        the output is that function's arguments: its `parameters` schema is the grammar
    tool_choice = "required"
        the output is a list of one or more calls, each {"name": <one of the tools>, "arguments": <that
        tool's parameters>}; the grammar (our design, close to vLLM's):

            {"type": "array", "minItems": 1, "maxItems": 1 if parallel_tool_calls is false,
             "items": {"anyOf": [{"type": "object", "properties": {"name": {"const": NAME_i},
                                                                   "arguments": PARAMETERS_i},
                                  "required": ["name", "arguments"], "additionalProperties": false}, ...]}}

        "name" comes first (properties keep their order), so once the model has written the name the
        grammar holds it to that tool's own schema: anyOf over objects whose first member differs is a
        choice made at the name and kept to the end. Each tool's $defs move up to the root under
        a prefix of its own, their $refs rewritten, so two tools' definitions cannot collide.
    tool_choice = "none"
        the tools are ignored (free text); the template still sees them, as in vLLM.
    tool_choice = "auto" (the default when tools are given)
        the model decides whether to call, in its own format, free text: only a model whose chat template
        renders the tools has been shown them, so only then is it served; the calls are read in Hermes'
        format (hermes_tool_parser.py, vLLM's `--tool-call-parser hermes`). A template that does not
        render tools is a 400 that says which choices work, as vLLM answers a server started without a
        tool-call parser ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser').

The calls are read out of the text by ToolCallParser, the same way for a streamed and a non-streamed
answer, so the two carry the same calls and the deltas of a stream join to the same arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ...structured_output import StructuredOutputsParams
from .protocol import BadField
from .structured import _NAME, request_field


@dataclass
class ToolPlan:
    """What a tools request asks: the grammar, and how to read the output back."""

    mode: str  # "named" (one function's arguments), "required" (a list of calls) or "auto" (free text)
    name: str | None  # the named function
    params: StructuredOutputsParams | None  # None for "auto": no grammar


def tool_plan(tools, tool_choice, parallel_tool_calls: bool, check, renders_tools) -> ToolPlan | None:
    """-> the plan, or None for free text (no tools, or tool_choice "none"); BadField naming the
    field for a bad tool or choice. check(StructuredOutputsParams) raises ValueError for a schema the
    compiler refuses; renders_tools() says whether the chat template shows tools to the model."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise BadField("tool_choice", "tool_choice needs tools: give the functions the model may call")
        return None
    functions = check_tools(tools, check)
    if tool_choice is None:
        tool_choice = "auto"  # OpenAI's default when tools are given
    if tool_choice == "none":
        return None
    if tool_choice == "auto":
        if renders_tools():
            return ToolPlan("auto", None, None)
        raise BadField("tool_choice", 'tool_choice "auto" lets the model decide whether to call a tool, but this '
                       "model's chat template does not render tools, so the model is never shown them: use "
                       'tool_choice "required", a named function {"type": "function", "function": {"name": ...}},'
                       ' or "none"')
    if tool_choice == "required":
        return ToolPlan("required", None, StructuredOutputsParams(json=required_schema(functions, parallel_tool_calls)))
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in functions:
            raise BadField("tool_choice.function.name", f"tool_choice names the function {name!r}, which is not among "
                           f"the tools ({', '.join(functions)})")
        return ToolPlan("named", name, StructuredOutputsParams(json=functions[name]))
    raise BadField("tool_choice", f'tool_choice must be "none", "auto", "required" or {{"type": "function", '
                   f'"function": {{"name": ...}}}}, not {json.dumps(tool_choice)[:200]}')


def check_tools(tools, check) -> dict[str, dict]:
    """-> {name: parameters schema}, in the tools' order; a 400 naming the first bad field."""
    if not isinstance(tools, list):
        raise BadField("tools", "tools must be a list of {\"type\": \"function\", \"function\": {...}}")
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise BadField(f"tools[{i}].type", f'tools[{i}] must be {{"type": "function", "function": {{...}}}}; '
                           f"only function tools exist")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise BadField(f"tools[{i}].function", f"tools[{i}].function must be an object with name and parameters")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise BadField(f"tools[{i}].function.name", f"tools[{i}].function.name must be 1 to 64 letters, digits, _ "
                           f"or -, not {name!r}")
        if name in functions:
            raise BadField(f"tools[{i}].function.name", f"tools[{i}].function.name {name!r} is given twice")
        for key, kind in (("description", str), ("strict", bool)):
            if fn.get(key) is not None and not isinstance(fn[key], kind):
                raise BadField(f"tools[{i}].function.{key}", f"tools[{i}].function.{key} must be a {kind.__name__}")
        # no parameters: a function that takes none, so its arguments are {}
        schema = fn.get("parameters", {"type": "object", "properties": {}})
        field = f"tools[{i}].function.parameters"
        if not isinstance(schema, dict):
            raise BadField(field, f"{field} must be a JSON Schema object, not {type(schema).__name__}")
        params = StructuredOutputsParams(json=schema)
        try:
            check(params)
        except (ValueError, TypeError) as e:
            message, _ = request_field(str(e), params, field)
            raise BadField(field, message if field in message else f"{field}: {message}") from None
        functions[name] = schema
    return functions


def required_schema(functions: dict[str, dict], parallel: bool) -> dict:
    """The grammar of tool_choice "required" (the module docstring)."""
    defs, calls = {}, []
    for i, (name, schema) in enumerate(functions.items()):
        schema = dict(schema)
        own = {**schema.pop("$defs", {}), **schema.pop("definitions", {})}
        prefix = f"tool{i}_"
        defs.update({prefix + k: _rebase(v, prefix) for k, v in own.items()})
        calls.append({"type": "object", "properties": {"name": {"const": name}, "arguments": _rebase(schema, prefix)},
                      "required": ["name", "arguments"], "additionalProperties": False})
    out = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        out["maxItems"] = 1
    if defs:
        out["$defs"] = defs
    return out


def _rebase(node, prefix: str):
    """A copy of a schema whose local $refs point at the prefixed root $defs."""
    if isinstance(node, list):
        return [_rebase(v, prefix) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rebase(v, prefix) for k, v in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str):
        for local in ("#/$defs/", "#/definitions/"):
            if ref.startswith(local):
                out["$ref"] = "#/$defs/" + prefix + ref[len(local):]
    return out


# ---- reading the calls out of the text -------------------------------------------------------------

# one call's head in the "required" list, up to the first character of its arguments (that character
# must be there: whitespace before it is not part of the arguments)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
_COMMA = re.compile(r"\s*,")


def parse_calls(text: str, plan: ToolPlan) -> list[tuple[str, str, bool]]:
    """The calls in `text` so far: (name, arguments text, complete). The arguments text only grows as
    the text does, so a stream can send it in pieces."""
    if plan.mode == "named":
        return [(plan.name, text, False)]
    pos, calls = text.find("["), []
    if pos < 0:
        return calls
    pos += 1
    while (m := _HEAD.match(text, pos)) is not None:
        name, start = json.loads(f'"{m.group(1)}"'), m.end()
        end = _value_end(text, start)
        if end is None:
            calls.append((name, text[start:].rstrip(), False))
            break
        calls.append((name, text[start:end].rstrip(), True))
        if (m := _COMMA.match(text, end + 1)) is None:
            break
        pos = m.end()
    return calls


def _value_end(text: str, start: int) -> int | None:
    """Where the call object that holds the value at `start` closes (its "}"), or None: not yet."""
    depth, in_str, esc = 0, False, False
    for j in range(start, len(text)):
        ch = text[j]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            if depth == 0:
                return j
            depth -= 1
    return None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    """One choice's calls as its text arrives: feed() -> the `tool_calls` entries of a delta (the first
    for a call carries its id, type and name; later ones only the new arguments text)."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.text = plan, ""
        self.ids: list[str] = []
        self.sent: list[int] = []  # arguments characters sent, per call

    def feed(self, delta: str) -> list[dict]:
        self.text += delta
        out = []
        for i, (name, args, _) in enumerate(parse_calls(self.text, self.plan)):
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.sent.append(len(args))
                out.append({"index": i, "id": self.ids[i], "type": "function",
                            "function": {"name": name, "arguments": args}})
            elif len(args) > self.sent[i]:
                out.append({"index": i, "function": {"arguments": args[self.sent[i]:]}})
                self.sent[i] = len(args)
        return out

    def tool_calls(self) -> list[dict]:
        """Every call so far, whole (the non-streamed message's tool_calls)."""
        calls = parse_calls(self.text, self.plan)
        while len(self.ids) < len(calls):
            self.ids.append(new_call_id())
        return [{"id": self.ids[i], "type": "function", "function": {"name": name, "arguments": args}}
                for i, (name, args, _) in enumerate(calls)]


def finish_reason(reason: str | None) -> str | None:
    """A tool answer that ended on its own ends with "tool_calls"; "length" and "abort" stay."""
    return "tool_calls" if reason == "stop" else reason
