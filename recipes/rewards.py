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
- ``module:function`` (or ``path/to/file.py:function``): a Python function, run in a
  process of its own (recipes/reward_worker.py), so that nothing it does -- ``sys.exit``,
  ``os.fork``, replacing the signal handlers -- reaches the run, and each call is bounded
  by ``--reward-timeout`` seconds.

A reward that raises, exits, forks, overruns its time, returns the wrong number of values
or a value that is not a finite number stops the run with a one-line error naming it
(:class:`RewardError`).
"""
from __future__ import annotations

import json
import math
import re
import select
import socket
import subprocess
import sys
import time
import unicodedata
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np

from toygraph.bounded import load_json
from toygraph.errors import ToygraphError
from toygraph.recipes import reward_worker
from toygraph.recipes.json_schema import check_schema, valid

BUILT_IN = ("regex:PATTERN", "exact:FIELD", "json", "json-schema:FILE", "length:MIN:MAX")
_BUILT_IN_KINDS = ("regex", "exact", "json", "json-schema", "length")
#: Seconds a Python reward function may take per call (--reward-timeout; 0: no limit).
REWARD_TIMEOUT = 300.0


class RewardError(ToygraphError):
    """A reward function failed or broke its contract."""


@dataclass
class Reward:
    name: str                  # the spec as given (what metrics and errors call it)
    fn: Callable
    weight: float = 1.0


def parse_rewards(specs, weights=None, timeout: float = REWARD_TIMEOUT) -> list[Reward]:
    """The rewards of ``--reward`` specs, with ``--reward-weights`` (default 1 each); the
    Python ones share one worker process, each call bounded by ``timeout`` seconds."""
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
    python = [s for s in specs if _is_python(s)]
    worker = RewardWorker(python, timeout) if python else None
    return [Reward(s, worker.function(python.index(s)) if _is_python(s) else reward_function(s), w)
            for s, w in zip(specs, weights)]


def _is_python(spec: str) -> bool:
    kind, _, arg = spec.partition(":")
    return bool(arg) and kind not in _BUILT_IN_KINDS


def reward_function(spec: str) -> Callable:
    """The function a built-in ``--reward`` spec names (module docstring)."""
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
            (value := _json(text)) is not _INVALID and _valid(value, schema)))
    if kind == "length":
        lo, hi = _bounds(arg, spec)
        return _per_completion(lambda text, row: float(lo <= len(text) <= hi))
    raise RewardError(f"--reward {spec!r}: not a reward (built in: {', '.join(BUILT_IN)}; or "
                      f"module:function)")


def score(rewards: list[Reward], prompts: list, completions: list, fields: dict) -> np.ndarray:
    """[len(completions), len(rewards)] of each reward's values (NaN for None)."""
    out = np.full((len(completions), len(rewards)), np.nan)
    for j, r in enumerate(rewards):
        try:
            values = r.fn(prompts=prompts, completions=completions, **fields)
        except RewardError:
            raise
        except Exception as e:  # a built-in's failure (a missing field): one line
            msg = " ".join(str(e).split())
            raise RewardError(f"reward {r.name} failed: {type(e).__name__}: {msg}") from None
        if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != len(completions):
            got = f"{len(values)} values" if hasattr(values, "__len__") else repr(type(values).__name__)
            raise RewardError(f"reward {r.name} returned {got} for {len(completions)} completions")
        for i, v in enumerate(values):
            if v is None:
                continue
            if not _finite(v):
                raise RewardError(f"reward {r.name} returned {_shown(v)} for completion {i}: a "
                                  f"finite number or None is needed")
            out[i, j] = float(v)
    return out


def _finite(v) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.number)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:   # an int past float's range (10**400)
        return False


def _shown(v) -> str:
    text = repr(v) if not isinstance(v, int) or abs(v) < 10**30 else f"an integer of {len(str(abs(v)))} digits"
    return text if len(text) <= 60 else text[:57] + "..."


# --- Python rewards, in a process of their own ----------------------------------------------------
class RewardWorker:
    """The worker process (recipes/reward_worker.py) that the Python rewards run in, and
    its ``function(i)``s: callables with TRL's signature that run reward ``i`` there,
    each call bounded by ``timeout`` seconds (0: none). Whatever the worker reports or
    does wrong -- an exception, sys.exit, os.fork, os._exit, no answer in time -- is a
    one-line RewardError naming the reward; the worker is then stopped."""
    #: how errors name the time limit's flag and the process (recipes/tools.py's differ)
    timeout_flag, process = "--reward-timeout", "the process rewards run in"

    def __init__(self, specs: list[str], timeout: float):
        self.specs, self.timeout = specs, float(timeout)
        self._start(f"--reward {specs[0]}: cannot start the process rewards run in")
        targets = [tuple(s.partition(":")[::2]) for s in specs]   # (module, function)
        answer = self._ask(("import", targets), f"--reward {specs[0]}")
        if answer[0] == "raised":
            _, kind, msg, i = answer
            self._stop()
            raise RewardError(f"--reward {specs[i]}: cannot import it ({kind}: {msg})")

    def _start(self, cannot: str) -> None:
        """Start the worker process; ``cannot`` begins the error when it does not start."""
        mine, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, reward_worker.__file__, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            mine.close()
            raise RewardError(f"{cannot} ({e.strerror or e})") from None
        finally:
            theirs.close()
        self.sock = mine
        self._stop = weakref.finalize(self, _stop_worker, self.proc, mine)

    def function(self, i: int) -> Callable:
        def reward(prompts, completions, **fields):
            answer = self._ask(("call", i, dict(prompts=prompts, completions=completions,
                                                **fields)), f"reward {self.specs[i]}")
            return self._values(answer, self.specs[i], len(completions))
        return reward

    def _values(self, answer: tuple, name: str, n: int):
        kind = answer[0]
        if kind == "ok":
            return answer[1]
        self._stop()   # the worker's state is unknown from here on: no further call
        if kind == "raised":
            raise RewardError(f"reward {name} failed: {answer[1]}: {answer[2]}")
        if kind == "type":
            raise RewardError(f"reward {name} returned {answer[1]!r} for {n} completions")
        if kind == "exit":
            raise RewardError(f"reward {name} called sys.exit({answer[1]!r}); a reward must "
                              f"return its values")
        if kind == "fork":
            raise RewardError(f"reward {name} called os.fork(); rewards must not fork (run a "
                              f"program with subprocess instead)")
        raise RewardError(f"reward {name} returned values that cannot be passed back: {answer[1]}")

    def _ask(self, message, name: str) -> tuple:
        """Send ``message``, wait for the answer within the time limit. A signal that ends
        the run (KeyboardInterrupt) stops the worker on the way out."""
        if not self._stop.alive:
            raise RewardError(f"{name}: {self.process} was stopped by an earlier error")
        try:
            reward_worker.send(self.sock, message)
            if not self._answered():
                raise RewardError(f"{name} did not return within {self.timeout:g} s "
                                  f"({self.timeout_flag}); its process was stopped")
            answer = reward_worker.receive(self.sock)
        except (BrokenPipeError, ConnectionResetError):
            answer = None   # the worker is gone: said below
        except BaseException:
            self._stop()
            raise
        if answer is None:   # the worker ended: os._exit, a crash, a kill
            code = self.proc.wait()
            self._stop()
            how = f"signal {-code}" if code < 0 else f"exit status {code}"
            raise RewardError(f"{name} ended {self.process} ({how})")
        return answer

    def _answered(self) -> bool:
        """Wait until the worker answers (True) or the time limit passes (False). A signal
        handler that returns lets select go on waiting (PEP 475)."""
        if self.timeout <= 0:
            return bool(select.select([self.sock], [], [])[0])
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if select.select([self.sock], [], [], deadline - time.monotonic())[0]:
                return True
        return False


def _stop_worker(proc: subprocess.Popen, sock: socket.socket) -> None:
    sock.close()
    if proc.poll() is None:
        proc.kill()
    proc.wait()


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
    except (ValueError, RecursionError):   # a completion nested past the parser's depth too
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


# --- json-schema: ----------------------------------------------------------------------------------
def _load_schema(path: str, spec: str) -> dict:
    """The schema in ``path``, read bounded (toygraph/bounded.py: a regular file, nesting and
    size limited) and checked (recipes/json_schema.py) before it is used."""
    schema = load_json(path, f"--reward {spec}", max_bytes=1 << 20, error=RewardError)
    try:
        where = check_schema(schema)
    except RecursionError:
        where = "nested too deeply"
    if where:
        raise RewardError(f"--reward {spec}: {where}")
    return schema


def _valid(value, schema: dict) -> bool:
    try:
        return valid(value, schema)
    except RecursionError:   # a completion nested deeper than any schema: not valid
        return False
