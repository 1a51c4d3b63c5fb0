"""Small builders of JSON Schema (OpenAPI 3.1) fragments, shared by the request models and the document."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def ref(name: str) -> Schema:
    """A reference to ``components.schemas[name]``."""
    return {"$ref": f"#/components/schemas/{name}"}


def obj(properties: dict[str, Schema], required: tuple[str, ...] = (), *, closed: bool = False,
        description: str | None = None) -> Schema:
    """An object schema (open to other fields unless ``closed``)."""
    out: Schema = {"type": "object", "properties": properties}
    if required:
        out["required"] = list(required)
    if closed:
        out["additionalProperties"] = False
    if description:
        out["description"] = description
    return out


def string(description: str | None = None, *, min_length: int | None = None, max_length: int | None = None,
           pattern: str | None = None, enum: list[str] | None = None) -> Schema:
    out: Schema = {"type": "string"}
    for key, value in (("minLength", min_length), ("maxLength", max_length), ("pattern", pattern), ("enum", enum)):
        if value is not None:
            out[key] = value
    if description:
        out["description"] = description
    return out


def number(lo: float | None = None, hi: float | None = None, description: str | None = None) -> Schema:
    out: Schema = {"type": "number"}
    if lo is not None:
        out["minimum"] = lo
    if hi is not None:
        out["maximum"] = hi
    if description:
        out["description"] = description
    return out


def integer(lo: int | None = None, hi: int | None = None, description: str | None = None) -> Schema:
    out = number(lo, hi, description)
    out["type"] = "integer"
    return out


def enum(*values: str, description: str | None = None) -> Schema:
    return string(description, enum=list(values))


def nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def array(items: Schema, *, min_items: int = 0, max_items: int | None = None, description: str | None = None) -> Schema:
    out: Schema = {"type": "array", "items": items}
    if min_items:
        out["minItems"] = min_items
    if max_items is not None:
        out["maxItems"] = max_items
    if description:
        out["description"] = description
    return out


BOOL: Schema = {"type": "boolean"}
ANY_OBJECT: Schema = {"type": "object"}
#: what ``strict`` on a function tool does here (every protocol's tool schema says it)
STRICT_TOOL = ("true: this tool's calls are constrained to its schema while decoding where the engine can "
               "(server.strict_tools: auto, the default, on vllm, or on hf with the grammar extra), and checked "
               "against it once generated everywhere; a call that breaks it is answered as generated and reported "
               "(the X-Swarm-Strict-Violations header of a non-streamed answer, the recorded timeline's "
               "meta.strict_violations), not refused")
