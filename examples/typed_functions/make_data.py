"""Write train.jsonl and heldout.jsonl: requests for small Python functions answered in
the house style (house_style.py), for a worked QLoRA fine-tune of Qwen2.5-Coder.

Out of the box Qwen2.5-Coder-Instruct answers "Write a Python function `evens` that ..."
with a markdown-fenced block wrapped in prose, often with ``from typing import List`` and
no docstring. The rows here answer with the function alone: builtin type hints, a one-line
"Return ..." docstring, one return. Each request is drawn from a template (arithmetic,
strings, lists) with random names and constants; each row carries tests computed by the
template's reference function, written apart from the reply's text, so that every
training reply is checked (tests/bench/test_coder_example_data.py) and every held-out reply can
be scored (examples/typed_functions/coder_example.py).

heldout.jsonl holds requests that are not in train.jsonl: new names and constants on the
training templates ("seen": true) and requests from templates training never shows
("seen": false), which measure whether the style carries over to new kinds of function.
Deterministic: run it again and the bytes are equal.

    python examples/typed_functions/make_data.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from house_style import render  # noqa: E402  (a sibling script, not a package)

SEED = 20250101
TRAIN_ROWS, HELDOUT_SEEN = 320, 28
TESTS_PER_ROW = 4
#: the templates held out of training: one or two of each kind
UNSEEN = ("fahrenheit", "floor_div", "word_count", "longer_than", "length_map", "sorted_desc")
HELDOUT_UNSEEN = 2 * len(UNSEEN)

ASKS = ("Write a Python function `{name}` that {what}.",
        "Implement `{name}`, which {what}.",
        "Create a function named `{name}` that {what}.",
        "I need a Python function `{name}`: it {what}.",
        "Python: define `{name}` so that it {what}.")
#: parameter names by role (none of them a comprehension's loop variable: x, a, b, w)
NAMES = {"int": ("n", "value", "count", "number", "total", "size"),
         "float": ("amount", "price", "value", "weight", "reading"),
         "celsius": ("celsius", "temp", "degrees", "temperature"),
         "ints": ("numbers", "values", "scores", "counts", "items", "nums", "data"),
         "floats": ("prices", "costs", "amounts", "payments"),
         "str": ("text", "s", "word", "name", "line", "label"),
         "strs": ("words", "names", "tokens", "labels", "parts")}
WORDS = ("apple", "river", "stone", "cloud", "tiger", "lamp", "violet", "ocean", "bread",
         "pixel", "maple", "orbit", "quartz", "ember", "sun", "ink", "fjord", "kite")


def ints(r, lo=-20, hi=20, most=6):
    return [r.randint(lo, hi) for _ in range(r.randint(0, most))]


def words(r, least=0, most=5):
    return [r.choice(WORDS) for _ in range(r.randint(least, most))]


def text(r):
    return r.choice(("  Hello World ", "banana split", "a", "", "Sun and sand", "MiXeD Case",
                     "the quick brown fox", " spaced  out ", "level", "Tea time"))


@dataclass(frozen=True)
class Template:
    """One kind of request. ``params``: [(placeholder, role, annotation)]; the strings
    ``what``, ``doc`` and ``body`` are formatted with the parameter names and the
    ``consts`` drawn for the row; ``args`` draws one test's arguments; ``ref(c)`` is the
    reference function for constants ``c``, written apart from ``body``."""
    key: str
    names: tuple
    params: tuple
    returns: str
    what: str
    doc: str
    body: str
    args: Callable
    ref: Callable
    consts: Callable = lambda r: {}


I, F, S = "int", "float", "str"
T = Template
TEMPLATES = (
    # --- arithmetic ---
    T("add", ("add_offset", "shift_up", "plus_k"), (("x", I, "int"),), "int",
      "takes an integer `{x}` and returns it plus {k}", "Return {x} plus {k}.", "{x} + {k}",
      lambda r: (r.randint(-50, 50),), lambda c: lambda x: x + c["k"],
      lambda r: {"k": r.randint(1, 99)}),
    T("affine", ("linear", "scale_and_shift", "affine"), (("x", I, "int"),), "int",
      "takes an integer `{x}` and returns {a} times it plus {b}",
      "Return {a} times {x} plus {b}.", "{a} * {x} + {b}",
      lambda r: (r.randint(-30, 30),), lambda c: lambda x: c["a"] * x + c["b"],
      lambda r: {"a": r.randint(2, 9), "b": r.randint(1, 20)}),
    T("clamp", ("clamp", "limit", "bound"), (("x", I, "int"), ("low", I, "int"), ("high", I, "int")),
      "int", "takes integers `{x}`, `{low}` and `{high}` and returns `{x}` limited to the "
      "range from `{low}` to `{high}`", "Return {x} limited to the range {low} to {high}.",
      "min(max({x}, {low}), {high})",
      lambda r: (lambda lo: (r.randint(-20, 20), lo, lo + r.randint(0, 10)))(r.randint(-10, 5)),
      lambda c: lambda x, lo, hi: min(max(x, lo), hi)),
    T("multiple", ("is_multiple", "divisible", "is_divisible"), (("x", I, "int"),), "bool",
      "takes an integer `{x}` and returns True when it is divisible by {k}",
      "Return True if {x} is divisible by {k}.", "{x} % {k} == 0",
      lambda r: (r.randint(-40, 40),), lambda c: lambda x: x % c["k"] == 0,
      lambda r: {"k": r.randint(2, 9)}),
    T("percent", ("percent_of", "share", "portion"), (("x", F, "float"),), "float",
      "takes a float `{x}` and returns {k} percent of it", "Return {k} percent of {x}.",
      "{x} * {k} / 100", lambda r: (round(r.uniform(0, 500), 2),),
      lambda c: lambda x: x * c["k"] / 100, lambda r: {"k": r.randint(1, 99)}),
    T("mean2", ("average", "midpoint", "mean_of_two"), (("x", F, "float"), ("y", F, "float")),
      "float", "takes two floats `{x}` and `{y}` and returns their average",
      "Return the average of {x} and {y}.", "({x} + {y}) / 2",
      lambda r: (round(r.uniform(-50, 50), 1), round(r.uniform(-50, 50), 1)),
      lambda c: lambda x, y: (x + y) / 2),
    T("gap", ("distance", "gap", "difference"), (("x", I, "int"), ("y", I, "int")), "int",
      "takes two integers `{x}` and `{y}` and returns the absolute difference between them",
      "Return the absolute difference of {x} and {y}.", "abs({x} - {y})",
      lambda r: (r.randint(-30, 30), r.randint(-30, 30)), lambda c: lambda x, y: abs(x - y)),
    T("between", ("in_range", "is_between", "within"), (("x", I, "int"),), "bool",
      "takes an integer `{x}` and returns True when it is between {lo} and {hi} inclusive",
      "Return True if {x} is between {lo} and {hi}.", "{lo} <= {x} <= {hi}",
      lambda r: (r.randint(-5, 40),), lambda c: lambda x: c["lo"] <= x <= c["hi"],
      lambda r: (lambda lo: {"lo": lo, "hi": lo + r.randint(1, 20)})(r.randint(0, 20))),
    T("square_minus", ("square_less", "squared_minus", "sq_offset"), (("x", I, "int"),), "int",
      "takes an integer `{x}` and returns its square minus {k}",
      "Return the square of {x} minus {k}.", "{x} * {x} - {k}",
      lambda r: (r.randint(-12, 12),), lambda c: lambda x: x * x - c["k"],
      lambda r: {"k": r.randint(1, 30)}),
    T("fahrenheit", ("to_fahrenheit", "c_to_f", "fahrenheit"), (("x", "celsius", "float"),), "float",
      "takes a Celsius temperature `{x}` as a float and returns it in Fahrenheit",
      "Return {x} Celsius in Fahrenheit.", "{x} * 9 / 5 + 32",
      lambda r: (round(r.uniform(-40, 100), 1),), lambda c: lambda x: x * 1.8 + 32),
    T("floor_div", ("per_group", "groups_of", "whole_parts"), (("x", I, "int"),), "int",
      "takes an integer `{x}` and returns it divided by {k}, rounded down",
      "Return {x} divided by {k}, rounded down.", "{x} // {k}",
      lambda r: (r.randint(-50, 100),), lambda c: lambda x: math.floor(x / c["k"]),
      lambda r: {"k": r.randint(2, 9)}),
    # --- strings ---
    T("greet", ("greet", "greeting", "welcome"), (("s", S, "str"),), "str",
      "takes a string `{s}` and returns \"{g}, \" followed by it and an exclamation mark",
      "Return a greeting for {s}.", '"{g}, " + {s} + "!"',
      lambda r: (r.choice(("Ada", "Bo", "Cleo", "Dev", "")),), lambda c: lambda s: f"{c['g']}, {s}!",
      lambda r: {"g": r.choice(("Hello", "Hi", "Welcome", "Good morning", "Hey"))}),
    T("upper", ("shout", "to_upper", "loud"), (("s", S, "str"),), "str",
      "takes a string `{s}` and returns it in upper case", "Return {s} in upper case.",
      "{s}.upper()", lambda r: (text(r),), lambda c: lambda s: "".join(map(str.upper, s))),
    T("count_char", ("count_letter", "letter_count", "occurrences"), (("s", S, "str"),), "int",
      "takes a string `{s}` and returns how many times the letter '{ch}' occurs in it",
      "Return the number of '{ch}' in {s}.", '{s}.count("{ch}")',
      lambda r: (text(r),), lambda c: lambda s: sum(ch == c["ch"] for ch in s),
      lambda r: {"ch": r.choice("aeost")}),
    T("prefix", ("has_prefix", "starts_right", "begins_with"), (("s", S, "str"),), "bool",
      "takes a string `{s}` and returns True when it starts with \"{p}\"",
      "Return True if {s} starts with \"{p}\".", '{s}.startswith("{p}")',
      lambda r: (r.choice(WORDS) if r.random() < 0.6 else "",),
      lambda c: lambda s: s[:len(c["p"])] == c["p"], lambda r: {"p": r.choice(WORDS)[:r.randint(1, 3)]}),
    T("repeat", ("repeat", "echo", "times"), (("s", S, "str"),), "str",
      "takes a string `{s}` and returns it repeated {k} times", "Return {s} repeated {k} times.",
      "{s} * {k}", lambda r: (r.choice(("ab", "x", "", "na", "hey ")),),
      lambda c: lambda s: "".join([s] * c["k"]), lambda r: {"k": r.randint(2, 5)}),
    T("initials", ("initials", "acronym", "first_letters"), (("ws", "strs", "list[str]"),), "str",
      "takes a list of strings `{ws}` and returns the first letters of its strings joined "
      "together", "Return the first letters of {ws} joined.", '"".join(w[0] for w in {ws})',
      lambda r: (words(r),), lambda c: lambda ws: "".join(w[:1] for w in ws)),
    T("normalize", ("normalize", "clean", "tidy"), (("s", S, "str"),), "str",
      "takes a string `{s}` and returns it in lower case without leading or trailing spaces",
      "Return {s} stripped and in lower case.", "{s}.strip().lower()",
      lambda r: (text(r),), lambda c: lambda s: s.lower().strip(" ")),
    T("wrap", ("wrap", "surround", "enclose"), (("s", S, "str"),), "str",
      "takes a string `{s}` and returns it between \"{left}\" and \"{right}\"",
      "Return {s} between \"{left}\" and \"{right}\".", '"{left}" + {s} + "{right}"',
      lambda r: (r.choice(WORDS + ("",)),), lambda c: lambda s: f"{c['left']}{s}{c['right']}",
      lambda r: dict(zip(("left", "right"), r.choice((("[", "]"), ("<", ">"), ("(", ")"), ("*", "*")))))),
    T("word_count", ("word_count", "count_words", "n_words"), (("s", S, "str"),), "int",
      "takes a string `{s}` and returns the number of words in it",
      "Return the number of words in {s}.", "len({s}.split())",
      lambda r: (text(r),), lambda c: lambda s: sum(1 for p in s.split(" ") if p)),
    T("reverse", ("reverse", "backwards", "flip"), (("s", S, "str"),), "str",
      "takes a string `{s}` and returns it reversed", "Return {s} reversed.", "{s}[::-1]",
      lambda r: (text(r),), lambda c: lambda s: "".join(reversed(s))),
    T("join", ("join_words", "glue", "combine"), (("ws", "strs", "list[str]"),), "str",
      "takes a list of strings `{ws}` and returns them joined with \"{sep}\"",
      "Return {ws} joined with \"{sep}\".", '"{sep}".join({ws})',
      lambda r: (words(r),), lambda c: lambda ws: c["sep"].join(ws),
      lambda r: {"sep": r.choice((", ", "-", " ", "/", "; "))}),
    T("longer_than", ("long_words", "longer_than", "keep_long"), (("ws", "strs", "list[str]"),),
      "list[str]", "takes a list of strings `{ws}` and returns those longer than {k} characters",
      "Return the strings in {ws} longer than {k}.", "[w for w in {ws} if len(w) > {k}]",
      lambda r: (words(r),), lambda c: lambda ws: list(filter(lambda w: len(w) > c["k"], ws)),
      lambda r: {"k": r.randint(3, 5)}),
    # --- lists ---
    T("scale", ("scale_all", "multiply_each", "scaled"), (("xs", "ints", "list[int]"),), "list[int]",
      "takes a list of integers `{xs}` and returns a new list with every element multiplied by {k}",
      "Return the elements of {xs} multiplied by {k}.", "[x * {k} for x in {xs}]",
      lambda r: (ints(r),), lambda c: lambda xs: list(map(lambda v: v * c["k"], xs)),
      lambda r: {"k": r.randint(2, 9)}),
    T("keep_above", ("keep_above", "above", "filter_big"), (("xs", "ints", "list[int]"),), "list[int]",
      "takes a list of integers `{xs}` and returns the elements greater than {k}",
      "Return the elements of {xs} greater than {k}.", "[x for x in {xs} if x > {k}]",
      lambda r: (ints(r),), lambda c: lambda xs: list(filter(lambda v: v > c["k"], xs)),
      lambda r: {"k": r.randint(-5, 10)}),
    T("count_above", ("count_above", "how_many_over", "n_above"), (("xs", "ints", "list[int]"),), "int",
      "takes a list of integers `{xs}` and returns how many elements are greater than {k}",
      "Return how many elements of {xs} exceed {k}.", "sum(1 for x in {xs} if x > {k})",
      lambda r: (ints(r),), lambda c: lambda xs: len([v for v in xs if v > c["k"]]),
      lambda r: {"k": r.randint(-5, 10)}),
    T("sum_squares", ("sum_of_squares", "square_sum", "energy"), (("xs", "ints", "list[int]"),), "int",
      "takes a list of integers `{xs}` and returns the sum of their squares",
      "Return the sum of the squares of {xs}.", "sum(x * x for x in {xs})",
      lambda r: (ints(r),), lambda c: lambda xs: sum(v ** 2 for v in xs)),
    T("max_default", ("largest", "biggest", "top_value"), (("xs", "ints", "list[int]"),), "int",
      "takes a list of integers `{xs}` and returns its largest element, or {k} when it is empty",
      "Return the largest element of {xs}, or {k} if empty.", "max({xs}, default={k})",
      lambda r: (ints(r),), lambda c: lambda xs: sorted(xs)[-1] if xs else c["k"],
      lambda r: {"k": r.randint(-1, 0)}),
    T("first_default", ("first", "head", "first_or"), (("xs", "ints", "list[int]"),), "int",
      "takes a list of integers `{xs}` and returns its first element, or {k} when it is empty",
      "Return the first element of {xs}, or {k} if empty.", "{xs}[0] if {xs} else {k}",
      lambda r: (ints(r),), lambda c: lambda xs: next(iter(xs), c["k"]),
      lambda r: {"k": r.randint(-1, 0)}),
    T("pair_sums", ("pairwise_sum", "add_lists", "zip_add"),
      (("xs", "ints", "list[int]"), ("ys", "ints", "list[int]")), "list[int]",
      "takes two lists of integers `{xs}` and `{ys}` of the same length and returns their "
      "element-wise sums", "Return the element-wise sums of {xs} and {ys}.",
      "[a + b for a, b in zip({xs}, {ys})]",
      lambda r: (lambda n: ([r.randint(-9, 9) for _ in range(n)], [r.randint(-9, 9) for _ in range(n)]))(r.randint(0, 5)),
      lambda c: lambda xs, ys: [xs[i] + ys[i] for i in range(len(xs))]),
    T("lengths", ("lengths", "sizes", "word_lengths"), (("ws", "strs", "list[str]"),), "list[int]",
      "takes a list of strings `{ws}` and returns the length of each",
      "Return the length of each string in {ws}.", "[len(w) for w in {ws}]",
      lambda r: (words(r),), lambda c: lambda ws: list(map(len, ws))),
    T("last_k", ("last_few", "tail", "latest"), (("xs", "ints", "list[int]"),), "list[int]",
      "takes a list of integers `{xs}` and returns its last {k} elements",
      "Return the last {k} elements of {xs}.", "{xs}[-{k}:]",
      lambda r: (ints(r),), lambda c: lambda xs: xs[max(0, len(xs) - c["k"]):],
      lambda r: {"k": r.randint(1, 4)}),
    T("contains", ("contains", "has_value", "includes"), (("xs", "ints", "list[int]"), ("x", I, "int")),
      "bool", "takes a list of integers `{xs}` and an integer `{x}` and returns True when `{x}` "
      "is in the list", "Return True if {x} is in {xs}.", "{x} in {xs}",
      lambda r: (ints(r, -5, 5), r.randint(-5, 5)), lambda c: lambda xs, x: any(v == x for v in xs)),
    T("length_map", ("length_map", "word_sizes", "len_by_word"), (("ws", "strs", "list[str]"),),
      "dict[str, int]", "takes a list of strings `{ws}` and returns a dict that maps each string "
      "to its length", "Return a dict of each string in {ws} to its length.",
      "{{w: len(w) for w in {ws}}}", lambda r: (words(r),),
      lambda c: lambda ws: dict(zip(ws, map(len, ws)))),
    T("with_tax", ("total_with_tax", "gross_total", "bill"), (("fs", "floats", "list[float]"),),
      "float", "takes a list of floats `{fs}` and returns their sum plus {k} percent tax",
      "Return the sum of {fs} plus {k} percent tax.", "sum({fs}) * (1 + {k} / 100)",
      lambda r: ([round(r.uniform(0, 50), 2) for _ in range(r.randint(0, 4))],),
      lambda c: lambda fs: sum(fs) + sum(fs) * c["k"] / 100, lambda r: {"k": r.randint(5, 25)}),
    T("evens", ("evens", "even_only", "keep_even"), (("xs", "ints", "list[int]"),), "list[int]",
      "takes a list of integers `{xs}` and returns its even elements",
      "Return the even elements of {xs}.", "[x for x in {xs} if x % 2 == 0]",
      lambda r: (ints(r),), lambda c: lambda xs: [v for v in xs if not v & 1]),
    T("triangle", ("triangle", "sum_to", "sum_up_to"), (("x", I, "int"),), "int",
      "takes an integer `{x}` and returns the sum of the integers from 1 to `{x}`",
      "Return the sum of 1 to {x}.", "sum(range(1, {x} + 1))",
      lambda r: (r.randint(0, 40),), lambda c: lambda x: x * (x + 1) // 2),
    T("sorted_desc", ("descending", "sort_desc", "largest_first"), (("xs", "ints", "list[int]"),),
      "list[int]", "takes a list of integers `{xs}` and returns its elements sorted from largest "
      "to smallest", "Return {xs} sorted from largest to smallest.", "sorted({xs}, reverse=True)",
      lambda r: (ints(r),), lambda c: lambda xs: sorted(xs)[::-1]),
    T("distinct", ("distinct_count", "n_unique", "unique_count"), (("xs", "ints", "list[int]"),), "int",
      "takes a list of integers `{xs}` and returns how many distinct values it holds",
      "Return the number of distinct values in {xs}.", "len(set({xs}))",
      lambda r: (ints(r, -3, 3),), lambda c: lambda xs: len(dict.fromkeys(xs))),
)


def make_row(t: Template, r: random.Random) -> dict:
    """One request for template ``t``: names and constants drawn, the reply, the tests."""
    consts = t.consts(r)
    picked = r.sample(NAMES[t.params[0][1]], len(t.params)) \
        if len({role for _, role, _ in t.params}) == 1 else \
        [r.choice(NAMES[role]) for _, role, _ in t.params]
    names = dict(zip((p for p, _, _ in t.params), picked))
    fill = {**consts, **names}
    name = r.choice(t.names)
    params = [[names[p], ann] for p, _, ann in t.params]
    reply = render(name, params, t.returns, t.doc.format(**fill), t.body.format(**fill))
    ref = t.ref(consts)
    tests, seen_args = [], set()
    for _ in range(TESTS_PER_ROW * 4):      # distinct arguments, as many as the template has
        args = list(t.args(r))
        key = json.dumps(args)
        if key not in seen_args:
            seen_args.add(key)
            tests.append([args, ref(*args)])
        if len(tests) == TESTS_PER_ROW:
            break
    instruction = r.choice(ASKS).format(name=name, what=t.what.format(**fill))
    return {"instruction": instruction, "response": reply, "name": name, "params": params,
            "returns": t.returns, "tests": tests, "template": t.key}


def make_sets(seed: int = SEED) -> tuple[list[dict], list[dict]]:
    """(train, heldout) rows. The held-out requests are drawn first; no training row
    repeats one's request or its reply (the same function asked in other words), nor
    another training row's."""
    r = random.Random(seed)
    by_key = {t.key: t for t in TEMPLATES}
    seen = [t for t in TEMPLATES if t.key not in UNSEEN]
    heldout = [dict(make_row(t, r), seen=True) for t in r.sample(seen, HELDOUT_SEEN)]
    while len(heldout) < HELDOUT_SEEN + HELDOUT_UNSEEN:   # each unseen template twice
        row = make_row(by_key[UNSEEN[(len(heldout) - HELDOUT_SEEN) // 2]], r)
        if row["response"] not in {h["response"] for h in heldout}:   # two functions, not one
            heldout.append(dict(row, seen=False))
    r.shuffle(heldout)   # so that the first N (bench --limit N) mix both kinds
    for row in heldout:  # held-out rows keep the reference reply apart from "response"
        row["reference"] = row.pop("response")
    taken = {row["instruction"] for row in heldout} | {row["reference"] for row in heldout}
    train = []
    while len(train) < TRAIN_ROWS:
        row = make_row(seen[len(train) % len(seen)], r)
        if row["instruction"] not in taken and row["response"] not in taken:
            taken |= {row["instruction"], row["response"]}
            train.append(row)
    r.shuffle(train)
    return train, heldout


def jsonl(rows) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent))
    out = Path(ap.parse_args().out)
    train, heldout = make_sets()
    for name, rows in (("train.jsonl", train), ("heldout.jsonl", heldout)):
        (out / name).write_text(jsonl(rows), encoding="utf-8")
        print(f"{out / name}: {len(rows)} rows")


if __name__ == "__main__":
    main()
