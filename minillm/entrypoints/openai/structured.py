"""What a request asks its output to look like, in the API's two spellings, as StructuredOutputsParams
(chapter 14): OpenAI's `response_format` and vLLM's extra body field `structured_outputs`.

    {"response_format": {"type": "json_object"}}                        any JSON object
    {"response_format": {"type": "json_schema", "json_schema":
        {"name": "person", "schema": {...}, "strict": true}}}           JSON that the schema accepts
    {"response_format": {"type": "text"}}                               no constraint (the default)
    {"structured_outputs": {"json": {...}} | {"regex": "..."} | {"choice": [...]} | {"grammar": "..."}
                         | {"json_object": true}}                       vLLM's names

`strict` is accepted either way and changes nothing: the schema is always enforced token by token
(vLLM does the same), so strict=false output is as valid as strict=true. A request gives one of the two
fields, not both. Every error names the field of the request it is about (`response_format.json_schema
.schema`, `structured_outputs.regex`): the grammar's own errors, raised later by the compiler, are
renamed to it too (`request_field`), so the client reads its own field name and the compiler's reason
and position.
"""

from __future__ import annotations

import re

from ...structured_output import StructuredOutputsParams
from .protocol import BadField

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for response_format and function names
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
SCHEMA_FIELD = "response_format.json_schema.schema"


def structured_outputs_of(response_format, structured_outputs) -> tuple[StructuredOutputsParams | None, str | None]:
    """-> (the params, the request field they came from), or (None, None) for free text; BadField
    (a 400 naming the field) for anything malformed."""
    rf = _response_format(response_format)
    if structured_outputs is None:
        return rf
    if rf[0] is not None:
        raise BadField("structured_outputs", "give either response_format or structured_outputs, not both: they "
                       "both say what the output must look like")
    if not isinstance(structured_outputs, dict):
        raise BadField("structured_outputs", "structured_outputs must be an object such as {\"json\": {...}}, "
                       "{\"regex\": \"...\"}, {\"choice\": [...]}, {\"grammar\": \"...\"} or {\"json_object\": true}")
    fields = ("json", "regex", "choice", "grammar", "json_object")
    unknown = sorted(set(structured_outputs) - set(fields))
    if unknown:
        raise BadField("structured_outputs", f"structured_outputs has unknown field(s) {', '.join(unknown)}; "
                       f"allowed: {', '.join(fields)}")
    try:
        params = StructuredOutputsParams(**structured_outputs)
    except (ValueError, TypeError) as e:
        given = [f for f in fields if f in structured_outputs]
        raise BadField(f"structured_outputs.{given[0]}" if len(given) == 1 else "structured_outputs", str(e)) from None
    return params, f"structured_outputs.{params.kind}"


def _response_format(rf) -> tuple[StructuredOutputsParams | None, str | None]:
    if rf is None:
        return None, None
    if not isinstance(rf, dict):
        raise BadField("response_format", "response_format must be an object such as {\"type\": \"json_object\"}")
    kind = rf.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise BadField("response_format.type", f"response_format.type is {kind!r}; allowed: "
                       f"{', '.join(RESPONSE_FORMAT_TYPES)}")
    if kind == "text":
        return None, None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise BadField("response_format.json_schema", "response_format of type json_schema needs json_schema: "
                       "{\"name\": \"...\", \"schema\": {...}, \"strict\": true}")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise BadField("response_format.json_schema.name", f"response_format.json_schema.name must be 1 to 64 "
                       f"letters, digits, _ or -, not {name!r}")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise BadField("response_format.json_schema.strict",
                       f"response_format.json_schema.strict must be true or false, not {spec['strict']!r}")
    if "schema" not in spec:
        raise BadField(SCHEMA_FIELD, f"{SCHEMA_FIELD} is missing: give the JSON Schema the output must follow")
    schema = spec["schema"]
    if not isinstance(schema, (dict, bool)):
        raise BadField(SCHEMA_FIELD, f"{SCHEMA_FIELD} must be a JSON Schema object, not {type(schema).__name__}")
    return StructuredOutputsParams(json=schema), SCHEMA_FIELD


def request_field(message: str, params: StructuredOutputsParams, field: str | None) -> tuple[str, str | None]:
    """A compiler's error about `params` in the words of the request: (message with the request's
    field name, the field) when the message is about the grammar; (message, None) otherwise."""
    internal = f"structured_outputs.{params.kind}"
    if field is None or internal not in message:
        return message, None
    head, _, rest = message.partition(internal)
    rest = rest.removeprefix(": " + internal)  # the compiler names its source once more
    return head + field + rest, field
