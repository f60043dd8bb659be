"""The process GRPO's Python reward functions run in (``--reward module:function``).

A reward is the user's code, and the run must outlive whatever it does: ``sys.exit`` or
``os._exit``, ``os.fork`` (16 copies of a run once pruned each other's checkpoints),
replacing the SIGINT/SIGTERM handlers, hanging. So the functions run here, in a process of
their own that rewards.py (``RewardWorker``) starts and talks to over a socket; the run
keeps its signal handlers, its lock and its event log, and it bounds each call's time.

This file is a script of the standard library alone (it does not import toygraph): it
starts in a fraction of a second and imports nothing but the reward modules. It runs in a
session of its own (Ctrl-C at the terminal goes to the run, which decides), dies with the
run (PR_SET_PDEATHSIG on Linux), and a fork in a reward ends the child at once and is
reported as an error of that reward.

Messages are pickles, each preceded by its length (8 bytes, little-endian). The run sends
``("import", [(module, function), ...])`` once, then ``("call", index, kwargs)`` per call;
the worker answers each with one of ``("ok", values)``, ``("type", type name)`` (a result
that is not a list), ``("raised", type name, message)``, ``("exit", code)`` (SystemExit),
``("fork",)`` or ``("unpicklable", message)``.

GRPO's tools (recipes/tools.py) run here too, in a worker of their own: the run sends
``("tools", path)`` once, answered ``("ok", schemas)`` (each public function the file
defines, described as a JSON schema from its type hints and docstring) or ``("raised",
type name, message, 0)``; then ``("tool", index, kwargs)`` per call, answered as a reward
call is, except that ``("ok", value)`` carries any value the tool returned.

And GRPO's environments (recipes/environments.py): ``("environment", module, name)``
loads the factory (answered as "import" is), ``("new", key)`` makes an environment
object under ``key`` (``("ok", None)``), ``("method", key, name, args)`` calls one of its
methods (answered as a tool call) and ``("drop", key)`` lets it go.
"""
import importlib
import importlib.util
import inspect
import os
import pickle
import signal
import socket
import struct
import sys

_HEADER = struct.Struct("<Q")


def send(sock, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def receive(sock):
    """The next message, or None at the end of the stream."""
    head = _read(sock, _HEADER.size)
    body = None if head is None else _read(sock, _HEADER.unpack(head)[0])
    return None if body is None else pickle.loads(body)


def _read(sock, n: int):
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _die_with_parent() -> None:
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):   # not Linux: the closed socket ends it instead
        pass


def _load(module: str, name: str):
    if module.endswith(".py"):
        spec = importlib.util.spec_from_file_location(os.path.basename(module)[:-3], module)
        if spec is None or not os.path.isfile(module):
            raise FileNotFoundError(f"no file {module}")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(module)
    if name is None:   # the module itself (a tools file)
        return mod
    fn = getattr(mod, name)
    if not callable(fn):
        raise TypeError(f"{name} is not a function")
    return fn


def _as_list(values):
    """A reward's result as a list to send back, or None when it is not a sequence."""
    if isinstance(values, (list, tuple)):
        return list(values)
    if hasattr(values, "tolist") and hasattr(values, "shape"):   # a numpy array
        return values.tolist() if getattr(values, "ndim", 1) == 1 else None
    return None


def _call(fn, kwargs, any_value: bool = False):
    forked.clear()
    try:
        values = fn(**kwargs)
    except SystemExit as e:
        return ("exit", e.code if isinstance(e.code, (int, type(None))) else str(e.code))
    except BaseException as e:   # the user's code: reported, the worker lives on
        return ("raised", type(e).__name__, " ".join(str(e).split()))
    if forked:
        return ("fork",)
    if any_value:   # a tool's reply: whatever it returned
        return ("ok", values)
    out = _as_list(values)
    return ("ok", out) if out is not None else ("type", type(values).__name__)


forked = []

#: JSON schema types of the annotations a tool's arguments may have (transformers'
#: get_json_schema reads the same ones).
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean",
               list: "array", dict: "object"}


def _tools(path: str):
    """(functions, schemas): the public functions the file at ``path`` defines (not the
    ones it imports), in the order they are defined, and their JSON schemas."""
    module = _load(path, None)
    functions = [f for name, f in vars(module).items()
                 if not name.startswith("_") and inspect.isfunction(f)
                 and f.__module__ == module.__name__]
    if not functions:
        raise ValueError(f"{path} defines no public function to use as a tool")
    functions.sort(key=lambda f: f.__code__.co_firstlineno)
    return functions, [_schema(f) for f in functions]


def _schema(fn) -> dict:
    """The OpenAI-style function schema of ``fn``: its docstring's first paragraph as the
    description, an "Args:" section's ``name: text`` lines as the arguments', the type
    hints as their types; an argument without a default is required."""
    import typing
    doc = inspect.getdoc(fn) or ""
    summary, _, rest = doc.partition("\n\n")
    described = {}
    for line in rest.splitlines():
        name, colon, text = line.strip().partition(":")
        if colon and name.split(" ")[0].isidentifier():
            described[name.split(" ")[0]] = text.strip()
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for name, param in inspect.signature(fn).parameters.items():
        kind = _JSON_TYPES.get(typing.get_origin(hints.get(name)) or hints.get(name))
        if kind is None:
            raise TypeError(f"tool {fn.__name__}: argument {name!r} needs a type hint of "
                            f"{', '.join(t.__name__ for t in _JSON_TYPES)}")
        properties[name] = {"type": kind, **({"description": described[name]}
                                             if name in described else {})}
        if param.default is inspect.Parameter.empty:
            required.append(name)
    if not summary.strip():
        raise TypeError(f"tool {fn.__name__}: a docstring saying what it does is needed "
                        "(the model reads it)")
    return {"type": "function", "function": {
        "name": fn.__name__, "description": " ".join(summary.split()),
        "parameters": {"type": "object", "properties": properties, "required": required}}}


def main(fd: int) -> None:
    sys.path[0] = os.getcwd()   # modules from the working directory, as the run's cwd
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the run decides when to stop
    _die_with_parent()
    # A fork in a reward would copy this worker; the copy ends before it runs anything.
    os.register_at_fork(after_in_child=lambda: os._exit(0),
                        after_in_parent=lambda: forked.append(True))
    sock = socket.socket(fileno=fd)
    functions, objects, factory = [], {}, None
    while (message := receive(sock)) is not None:
        if message[0] == "import":
            functions, answer = [], ("ok", None)
            for i, (module, name) in enumerate(message[1]):
                try:
                    functions.append(_load(module, name))
                except BaseException as e:   # the user's module: reported by the run
                    answer = ("raised", type(e).__name__, " ".join(str(e).split()), i)
                    break
        elif message[0] == "tools":
            try:
                functions, schemas = _tools(message[1])
                answer = ("ok", schemas)
            except BaseException as e:   # the user's file: reported by the run
                answer = ("raised", type(e).__name__, " ".join(str(e).split()), 0)
        elif message[0] == "environment":
            try:
                factory, answer = _load(message[1], message[2]), ("ok", None)
            except BaseException as e:   # the user's module: reported by the run
                answer = ("raised", type(e).__name__, " ".join(str(e).split()), 0)
        elif message[0] == "new":
            answer = _call(lambda: objects.__setitem__(message[1], factory()), {}, True)
        elif message[0] == "method":
            _, key, name, args = message
            answer = _call(lambda: getattr(objects[key], name)(*args), {}, any_value=True)
        elif message[0] == "drop":
            objects.pop(message[1], None)
            answer = ("ok", None)
        else:
            answer = _call(functions[message[1]], message[2], any_value=message[0] == "tool")
        try:
            send(sock, answer)
        except (pickle.PicklingError, TypeError, AttributeError, RecursionError) as e:
            send(sock, ("unpicklable", " ".join(str(e).split())))


if __name__ == "__main__":
    main(int(sys.argv[1]))
