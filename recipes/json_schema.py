"""The subset of JSON Schema that GRPO's ``json-schema:FILE`` reward checks completions
against (recipes/rewards.py).

>>> check_schema({"type": "object", "required": ["capital"]}) is None
True
>>> valid({"capital": "Paris"}, {"type": "object", "required": ["capital"]})
True

A schema is checked before it is used, keywords and their values both: an unknown keyword
is refused (it would be ignored), and so is a value a keyword cannot take -- ``"type":
"strnig"`` matched nothing and gave every completion reward 0, silently.
"""
from __future__ import annotations

import math
import re

#: The keywords checked; annotations (title, description, $schema, $id, examples,
#: default) are accepted and mean nothing to validation.
KEYWORDS = ("type", "properties", "required", "additionalProperties", "items", "enum", "const",
            "minLength", "maxLength", "pattern", "minimum", "maximum", "minItems", "maxItems")
ANNOTATIONS = ("title", "description", "$schema", "$id", "examples", "default")
TYPES = ("object", "array", "string", "boolean", "null", "integer", "number")
_PY_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _count(v) -> bool:
    return type(v) is int and v >= 0


def _number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def _value_error(key: str, value) -> str | None:
    """Why ``value`` is no value of keyword ``key`` (None: it is one). Subschemas are
    checked by check_schema itself."""
    if key == "type":
        kinds = value if isinstance(value, list) else [value]
        bad = [k for k in kinds if k not in TYPES]
        if not kinds or bad:
            return f"'type' must be one of {', '.join(TYPES)} (or a list of them), got {bad or value!r}"
    elif key == "properties" and not isinstance(value, dict):
        return "'properties' must be an object of schemas"
    elif key == "required" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return "'required' must be a list of property names"
    elif key == "additionalProperties" and not isinstance(value, (bool, dict)):
        return "'additionalProperties' must be true, false or a schema"
    elif key == "enum" and not isinstance(value, list):
        return "'enum' must be a list"
    elif key in ("minLength", "maxLength", "minItems", "maxItems") and not _count(value):
        return f"{key!r} must be an integer >= 0, got {value!r}"
    elif key in ("minimum", "maximum") and not _number(value):
        return f"{key!r} must be a finite number, got {value!r}"
    elif key == "pattern":
        if not isinstance(value, str):
            return "'pattern' must be a string (a regular expression)"
        try:
            re.compile(value)
        except re.error as e:
            return f"'pattern' {value!r} is not a regular expression ({e})"
    return None


def check_schema(schema, at: str = "#") -> str | None:
    """None when ``schema`` uses only the keywords :func:`valid` checks, each with a value
    it can take; else where and what is wrong."""
    if not isinstance(schema, dict):
        return f"{at} must be an object (a schema)"
    for key, value in schema.items():
        if key in ANNOTATIONS:
            continue
        if key not in KEYWORDS:
            return f"{at}: keyword {key!r} is not supported (supported: {', '.join(KEYWORDS)})"
        bad = _value_error(key, value)
        if bad:
            return f"{at}: {bad}"
        subs = (value.items() if key == "properties" else
                [("", value)] if key == "items" or (key == "additionalProperties"
                                                    and isinstance(value, dict)) else [])
        for name, sub in subs:
            bad = check_schema(sub, f"{at}/{key}{'/' + name if name else ''}")
            if bad:
                return bad
    return None


def _is_type(value, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _PY_TYPES.get(kind, ())) and not (kind != "boolean" and isinstance(value, bool))


def valid(value, schema: dict) -> bool:
    """Whether ``value`` is valid under ``schema`` (the keywords of :data:`KEYWORDS`)."""
    s = schema
    if "type" in s:
        kinds = s["type"] if isinstance(s["type"], list) else [s["type"]]
        if not any(_is_type(value, k) for k in kinds):
            return False
    if "enum" in s and value not in s["enum"]:
        return False
    if "const" in s and value != s["const"]:
        return False
    if isinstance(value, str):
        if len(value) < s.get("minLength", 0) or len(value) > s.get("maxLength", math.inf):
            return False
        if "pattern" in s and not re.search(s["pattern"], value):
            return False
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < s.get("minimum", -math.inf) or value > s.get("maximum", math.inf):
            return False
    if isinstance(value, list):
        if len(value) < s.get("minItems", 0) or len(value) > s.get("maxItems", math.inf):
            return False
        if "items" in s and not all(valid(v, s["items"]) for v in value):
            return False
    if isinstance(value, dict):
        if any(k not in value for k in s.get("required", ())):
            return False
        props = s.get("properties", {})
        for k, v in value.items():
            if k in props:
                if not valid(v, props[k]):
                    return False
            elif s.get("additionalProperties", True) is False:
                return False
            elif isinstance(s.get("additionalProperties"), dict) \
                    and not valid(v, s["additionalProperties"]):
                return False
    return True
