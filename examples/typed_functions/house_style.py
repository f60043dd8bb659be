"""The house style the typed-functions example teaches, and the checks of a reply against it.

A reply in the house style is exactly one small Python function and nothing else: no
markdown fence, no prose before or after, three lines::

    def keep_above(scores: list[int]) -> list[int]:
        \"\"\"Return the elements of scores greater than 7.\"\"\"
        return [x for x in scores if x > 7]

- the signature names the function and its parameters as the request does, each
  parameter and the return annotated with builtin types (``list[int]``, not
  ``typing.List[int]``), the types the request describes;
- a one-line docstring in triple double quotes that starts with "Return " and ends with a
  full stop;
- a body that is one ``return`` of an expression.

A *case* (a row of train.jsonl or heldout.jsonl) says what the request asked for:
``name``, ``params`` ([[name, annotation], ...]), ``returns`` (the annotation) and
``tests`` ([[args, expected], ...], computed by a reference implementation written apart
from the reply's text). :func:`verdict` scores a reply: its format, whether it passes the
tests as it stands, and the same two of the code in it once taken out of a markdown fence
(what a base model writes is often right code in the wrong wrapping).

Model replies are run in a child process with a time limit (:func:`passes_isolated`);
``python house_style.py`` is that child: a JSON {code, name, tests} on stdin, true or
false on stdout.
"""
from __future__ import annotations

import ast
import copy
import json
import math
import re
import secrets
import subprocess
import sys

DOC_START, DOC_END = "Return ", "."
FENCE = re.compile(r"```[a-zA-Z0-9_+-]*\n(.*?)(?:```|\Z)", re.S)


def render(name: str, params, returns: str, doc: str, body: str) -> str:
    """A function in the house style (the training replies are written with this)."""
    signature = ", ".join(f"{p}: {t}" for p, t in params)
    return f'def {name}({signature}) -> {returns}:\n    """{doc}"""\n    return {body}'


def format_problems(reply: str, case: dict) -> list[str]:
    """Why ``reply`` is not in the house style for ``case`` (empty: it is), each reason
    "what: detail" (what: fence, prose, name, parameters, returns, docstring, body, lines)."""
    text = reply.strip()
    if "```" in text:
        return ["fence: a markdown fence"]
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return ["prose: not Python on its own"]
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        return ["prose: not one function and nothing else"]
    fn, problems = tree.body[0], []
    if fn.name != case["name"]:
        problems.append(f"name: {fn.name}, asked for {case['name']}")
    a = fn.args
    if a.posonlyargs or a.vararg or a.kwonlyargs or a.kwarg or a.defaults or fn.decorator_list:
        problems.append("parameters: extra kinds, defaults or decorators")
    params = [[p.arg, ast.unparse(p.annotation) if p.annotation else None] for p in a.args]
    if params != [list(p) for p in case["params"]]:
        problems.append(f"parameters: {params}, asked for {case['params']}")
    returns = ast.unparse(fn.returns) if fn.returns else None
    if returns != case["returns"]:
        problems.append(f"returns: {returns}, asked for {case['returns']}")
    lines = text.splitlines()
    doc = ast.get_docstring(fn, clean=False)
    if (doc is None or "\n" in doc or not doc.startswith(DOC_START) or not doc.endswith(DOC_END)
            or len(lines) < 2 or lines[1] != f'    """{doc}"""'):
        problems.append('docstring: not one line of """Return ... ."""')
    if len(fn.body) != 2 or not isinstance(fn.body[1], ast.Return) or fn.body[1].value is None:
        problems.append("body: not the docstring and one return")
    if len(lines) != 3:
        problems.append(f"lines: {len(lines)}, not 3")
    return problems


def same(got, expected) -> bool:
    """``got == expected``, floats within rounding, types equal (True is not 1)."""
    if isinstance(expected, float):
        return isinstance(got, (int, float)) and not isinstance(got, bool) and \
            math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(expected, list):
        return (isinstance(got, list) and len(got) == len(expected)
                and all(same(g, e) for g, e in zip(got, expected)))
    if isinstance(expected, dict):
        return (isinstance(got, dict) and got.keys() == expected.keys()
                and all(same(got[k], v) for k, v in expected.items()))
    return type(got) is type(expected) and got == expected


def passes(code: str, name: str, tests) -> bool:
    """Whether ``code`` defines ``name`` and it returns the expected value on every test.
    Runs ``code`` in this process: for trusted code (the generated replies) only."""
    namespace = {"__name__": "reply"}
    try:
        exec(compile(code, "<reply>", "exec"), namespace)
        fn = namespace[name]
        return all(same(fn(*copy.deepcopy(args)), expected) for args, expected in tests)
    except Exception:   # any failure of a reply's code is a failed test, nothing more
        return False


def passes_isolated(code: str, name: str, tests, timeout: float = 10.0) -> bool:
    """:func:`passes` in a child process, killed after ``timeout`` seconds: for model
    replies, which may loop, read stdin, print or exit. The child prints its answer after a
    random word, so that nothing the reply prints can pass for it."""
    nonce = secrets.token_hex(8)
    try:
        done = subprocess.run([sys.executable, __file__], input=json.dumps(
            {"code": code, "name": name, "tests": tests, "nonce": nonce}),
            capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    return f"{nonce} true" in done.stdout.splitlines()


def code_of(reply: str) -> str:
    """The code in a reply: its first markdown-fenced block (closed or not: generation may
    stop at the closing fence), else the whole reply."""
    m = FENCE.search(reply)
    return m.group(1) if m else reply


def verdict(reply: str, case: dict) -> dict:
    """``format``: the reply is in the house style; ``passes``: the reply as it stands
    passes the case's tests; ``code_format``, ``code_passes``: the same of the code fenced
    in it (a fenced reply can only fail the first two); ``problems`` and ``code_problems``:
    why each format check failed."""
    problems = format_problems(reply, case)
    as_is = passes_isolated(reply, case["name"], case["tests"])
    code = code_of(reply)
    if code == reply:
        return {"format": not problems, "passes": as_is, "code_format": not problems,
                "code_passes": as_is, "problems": problems, "code_problems": problems}
    code_problems = format_problems(code, case)
    return {"format": not problems, "passes": as_is, "code_format": not code_problems,
            "code_passes": passes_isolated(code, case["name"], case["tests"]),
            "problems": problems, "code_problems": code_problems}


if __name__ == "__main__":
    # the child of passes_isolated: stdin is read to its end first, so input() fails
    request = json.loads(sys.stdin.read())
    try:
        result = passes(request["code"], request["name"], request["tests"])
    except BaseException:   # the reply called exit() or the like: a failure
        result = False
    print(f"\n{request['nonce']} {'true' if result else 'false'}", flush=True)
