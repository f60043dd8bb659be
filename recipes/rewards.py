"""GRPO's reward functions: built-in ones named on the command line, and Python callables
with TRL's signature.

>>> rewards = parse_rewards(["json", "exact:capital", "length:1:80"], weights=(1, 2, 0.5))
>>> scores = score(rewards, prompts, completions, fields)   # [completions, functions]  # doctest: +SKIP

Every reward is called as TRL calls one, ``fn(prompts=..., completions=..., **fields)``:
one entry per completion in each list (a prompt is repeated for each of its completions),
``fields`` the data rows' other keys (one list per key; None where a row lacks it) and
``completion_ids``; it returns one float per completion, or None where it does not apply.
A completion is its text, or ``[{"role": "assistant", "content": text}]`` when the prompt
was a list of messages (TRL's conversational format). The built-in ones score 1.0 or 0.0:

- ``regex:PATTERN``: the pattern is found in the completion (``re.search``, DOTALL; anchor
  it with ``^...$`` to match the whole);
- ``exact:FIELD``: the completion's answer equals the row's field ``FIELD``. The answer is
  the value of key ``FIELD`` when the completion is a JSON object holding it, else the
  whole completion. Both sides are normalised: Unicode NFKC, case-folded, runs of
  whitespace made one space, then surrounding whitespace, quotes and one final ``.``
  removed;
- ``json``: the completion (stripped) is valid JSON;
- ``json-schema:FILE``: it is valid JSON and valid under the schema in FILE (the subset of
  JSON Schema in :func:`check_schema`; a schema using another keyword is refused);
- ``length:MIN:MAX``: MIN <= its length in characters <= MAX;
- ``module:function`` (or ``path/to/file.py:function``): a Python function, imported.

A reward that raises, returns the wrong number of values or a value that is not a number
stops the run with a one-line error naming it (:class:`RewardError`).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import math
import re
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from toygraph.errors import ToygraphError
from toygraph.files import open_regular

BUILT_IN = ("regex:PATTERN", "exact:FIELD", "json", "json-schema:FILE", "length:MIN:MAX")


class RewardError(ToygraphError):
    """A reward function failed or broke its contract."""


@dataclass
class Reward:
    name: str                  # the spec as given (what metrics and errors call it)
    fn: Callable
    weight: float = 1.0


def parse_rewards(specs, weights=None) -> list[Reward]:
    """The rewards of ``--reward`` specs, with ``--reward-weights`` (default 1 each)."""
    specs = list(specs)
    if not specs:
        raise RewardError("GRPO needs at least one --reward (built in: "
                          f"{', '.join(BUILT_IN)}; or module:function)")
    if weights:
        try:
            weights = [float(w) for w in weights]
        except (TypeError, ValueError):
            raise RewardError(f"--reward-weights must be numbers, got {list(weights)}") from None
        if len(weights) != len(specs) or not all(math.isfinite(w) for w in weights):
            raise RewardError(f"--reward-weights: {len(weights)} finite numbers needed, one per "
                              f"--reward ({len(specs)}), got {list(weights)}")
    else:
        weights = [1.0] * len(specs)
    return [Reward(s, reward_function(s), w) for s, w in zip(specs, weights)]


def reward_function(spec: str) -> Callable:
    """The function a ``--reward`` spec names (module docstring)."""
    kind, _, arg = spec.partition(":")
    if kind == "regex" and arg:
        try:
            pattern = re.compile(arg, re.DOTALL)
        except re.error as e:
            raise RewardError(f"--reward {spec}: not a regular expression ({e})") from None
        return _per_completion(lambda text, row: float(pattern.search(text) is not None))
    if kind == "exact" and arg:
        return _exact(arg)
    if spec == "json":
        return _per_completion(lambda text, row: float(_json(text) is not _INVALID))
    if kind == "json-schema" and arg:
        schema = _load_schema(arg, spec)
        return _per_completion(lambda text, row: float(
            (value := _json(text)) is not _INVALID and valid(value, schema)))
    if kind == "length":
        lo, hi = _bounds(arg, spec)
        return _per_completion(lambda text, row: float(lo <= len(text) <= hi))
    if arg and kind not in ("regex", "exact", "json-schema"):
        return _import(kind, arg, spec)
    raise RewardError(f"--reward {spec!r}: not a reward (built in: {', '.join(BUILT_IN)}; or "
                      f"module:function)")


def score(rewards: list[Reward], prompts: list, completions: list, fields: dict) -> np.ndarray:
    """[len(completions), len(rewards)] of each reward's values (NaN for None)."""
    out = np.full((len(completions), len(rewards)), np.nan)
    for j, r in enumerate(rewards):
        try:
            values = r.fn(prompts=prompts, completions=completions, **fields)
        except Exception as e:  # the user's code: any failure stops the run, on one line
            msg = " ".join(str(e).split())
            raise RewardError(f"reward {r.name} failed: {type(e).__name__}: {msg}") from None
        if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != len(completions):
            got = f"{len(values)} values" if hasattr(values, "__len__") else repr(type(values).__name__)
            raise RewardError(f"reward {r.name} returned {got} for {len(completions)} completions")
        for i, v in enumerate(values):
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) \
                    or not math.isfinite(float(v)):
                raise RewardError(f"reward {r.name} returned {v!r} for completion {i}: a finite "
                                  f"number or None is needed")
            out[i, j] = float(v)
    return out


# --- totals and statistics ------------------------------------------------------------------------
def weighted_total(rewards: np.ndarray, weights) -> np.ndarray:
    """Each completion's sum of weighted rewards over the functions that applied (TRL's
    nansum), NaN where none did."""
    w = np.asarray(weights, np.float64)[None]
    total = np.nansum(rewards * w, axis=1)
    return np.where(np.isnan(rewards).all(axis=1), np.nan, total)


def nan_mean(x) -> float:
    """The mean of the values that are not NaN; NaN when there are none."""
    x = np.asarray(x, np.float64)
    x = x[~np.isnan(x)]
    return float(x.mean()) if len(x) else float("nan")


def nan_std(x) -> float:
    """The unbiased standard deviation of the values that are not NaN (TRL's nanstd)."""
    x = np.asarray(x, np.float64)
    x = x[~np.isnan(x)]
    return float(np.std(x, ddof=1)) if len(x) > 1 else float("nan")


# --- the built-in rewards ------------------------------------------------------------------------
def completion_text(c) -> str:
    """A completion's text, plain or conversational."""
    if isinstance(c, list):
        return c[-1]["content"] if c else ""
    return c


def _per_completion(check: Callable) -> Callable:
    def reward(prompts, completions, **fields):
        rows = [{k: v[i] for k, v in fields.items()} for i in range(len(completions))]
        return [check(completion_text(c), row) for c, row in zip(completions, rows)]
    return reward


def normalise(value) -> str:
    """The comparison form of ``exact:`` (module docstring)."""
    s = " ".join(unicodedata.normalize("NFKC", str(value)).casefold().split())
    s = s.strip().strip("\"'").strip()
    return s[:-1].rstrip() if s.endswith(".") else s


def _exact(field: str) -> Callable:
    def reward(prompts, completions, **fields):
        if field not in fields or any(v is None for v in fields[field]):
            raise KeyError(f"a data row has no field {field!r}")
        out = []
        for c, want in zip(completions, fields[field]):
            text = completion_text(c)
            value = _json(text)
            answer = value[field] if isinstance(value, dict) and field in value else text
            out.append(float(normalise(answer) == normalise(want)))
        return out
    return reward


_INVALID = object()


def _json(text: str):
    try:
        return json.loads(text.strip())
    except ValueError:
        return _INVALID


def _bounds(arg: str, spec: str) -> tuple[int, int]:
    parts = arg.split(":")
    try:
        lo, hi = (int(p) for p in parts)
    except ValueError:
        lo = hi = -1
    if len(parts) != 2 or not 0 <= lo <= hi:
        raise RewardError(f"--reward {spec}: expected length:MIN:MAX with 0 <= MIN <= MAX "
                          f"(characters)")
    return lo, hi


def _import(module: str, name: str, spec: str) -> Callable:
    """``module:function``, a module importable from the working directory or a .py file."""
    try:
        if module.endswith(".py"):
            path = Path(module)
            loader = importlib.util.spec_from_file_location(path.stem, path)
            if loader is None or not path.is_file():
                raise FileNotFoundError(f"no file {path}")
            mod = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(mod)
        else:
            sys.path.insert(0, str(Path.cwd()))
            try:
                mod = importlib.import_module(module)
            finally:
                sys.path.remove(str(Path.cwd()))
        fn = getattr(mod, name)
    except Exception as e:  # the user's module: whatever importing it raised, on one line
        msg = " ".join(str(e).split())
        raise RewardError(f"--reward {spec}: cannot import it ({type(e).__name__}: {msg})") from None
    if not callable(fn):
        raise RewardError(f"--reward {spec}: {name} is not a function")
    return fn


# --- a subset of JSON Schema ---------------------------------------------------------------------
#: The keywords ``json-schema:`` checks; annotations (title, description, $schema, $id,
#: examples, default) are accepted and mean nothing to validation.
KEYWORDS = ("type", "properties", "required", "additionalProperties", "items", "enum", "const",
            "minLength", "maxLength", "pattern", "minimum", "maximum", "minItems", "maxItems")
ANNOTATIONS = ("title", "description", "$schema", "$id", "examples", "default")
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _load_schema(path: str, spec: str) -> dict:
    try:
        with open_regular(path, "--reward json-schema:", RewardError, mode="r") as f:
            schema = json.loads(f.read())
    except OSError as e:
        raise RewardError(f"--reward {spec}: cannot read {path} ({e.strerror or e})") from None
    except ValueError as e:
        raise RewardError(f"--reward {spec}: {path} is not JSON ({e})") from None
    where = check_schema(schema)
    if where:
        raise RewardError(f"--reward {spec}: {where}")
    return schema


def check_schema(schema, at: str = "#") -> str | None:
    """None when every keyword of ``schema`` is one :func:`valid` checks, else where not."""
    if not isinstance(schema, dict):
        return f"{at} must be an object (a schema)"
    for key, value in schema.items():
        if key in ANNOTATIONS:
            continue
        if key not in KEYWORDS:
            return (f"{at}: keyword {key!r} is not supported (supported: {', '.join(KEYWORDS)})")
        subs = (value.items() if key == "properties" and isinstance(value, dict) else
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
    return isinstance(value, _TYPES.get(kind, ())) and not (kind != "boolean" and isinstance(value, bool))


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
