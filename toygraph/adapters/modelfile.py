"""An Ollama ``Modelfile`` for a run directory, so ``ollama create NAME -f Modelfile``
works as written.

>>> print(modelfile_text("/models/SmolLM2-135M-Instruct.Q4_1.gguf"))   # doctest: +SKIP
FROM /models/SmolLM2-135M-Instruct.Q4_1.gguf
ADAPTER ./adapter.gguf
PARAMETER stop "<|im_end|>"
...

``FROM`` names the base GGUF by absolute path; ``ADAPTER`` is relative, which Ollama
resolves against the Modelfile's own directory. The stop tokens are the model's
end-of-turn tokens, the same ones ``toygraph generate`` stops at.

The prompt template: given no TEMPLATE, Ollama picks the shipped Go template whose Jinja
source is nearest (edit distance < 100) to the GGUF's chat template, or else sends the
bare prompt. For SmolLM2 that is its ChatML template (distance 41), which drops the
default system message SmolLM2's Jinja template inserts. So when the GGUF's template
renders probe conversations exactly as ChatML does, we write Ollama's own ChatML template
(``template/chatml.gotmpl``) and, if the Jinja template adds a default system message, a
``SYSTEM`` line with it (Ollama prepends ``SYSTEM`` when a conversation has no system
message, as that template does). The run's template is the one checked (templates.py: a
model without one trained with the Alpaca default), and the Alpaca layout has a Go
translation too, written when the Jinja template renders the probes as it does. Any other
template is left to Ollama's detection, and the Modelfile says so: a translation we cannot
check against the Jinja original would silently change every prompt.
"""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

from toygraph.atomic import atomic_write
from toygraph.bounded import printable
from toygraph.gguf.tokenizer import Tokenizer

MODELFILE = "Modelfile"


def path_value(path: str) -> str | None:
    """``path`` as a Modelfile value (FROM, ADAPTER), or None when none reads back as it:
    Ollama's parser ends a value at a space or line break unless it is quoted, has no
    escapes (a quote inside ends it) and drops characters that are not printable, so a
    path with a line break, a quote or a control character is refused (a newline in the
    base's file name would otherwise write directives of its own: issue 46). A path with
    spaces is quoted."""
    if '"' in path or not path.isprintable():   # isprintable: no line break, tab, control
        return None
    return f'"{path}"' if " " in path else path


def _comment(text: str) -> str:
    """A comment line: ``text`` with every control character (a line break above all,
    which would end the comment and start a directive) written as an escape."""
    return "# " + printable(text)


def _quotable(token: str) -> bool:
    # Modelfile values are double-quoted strings; a token that would need escaping is
    # left out rather than risk how Ollama's parser reads escapes (and it drops what is
    # not printable, which would change the token).
    return token.isprintable() and not any(c in token for c in '"\\')


# Ollama's template/chatml.gotmpl, and what it renders for a list of messages.
OLLAMA_CHATML = ("{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n"
                 "{{ end }}<|im_start|>assistant\n")
_PROBES = ([{"role": "user", "content": "Hi there"}],
           [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Name a colour.\nOne word."}],
           [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Bye"}])


def _chatml(messages) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) \
        + "<|im_start|>assistant\n"


_ALPACA_HEADERS = {"system": "### System:\n", "user": "### Instruction:\n",
                   "assistant": "### Response:\n"}


def ollama_alpaca(eos: str) -> str:
    """The Go template of templates.ALPACA (a reply closed by ``eos``): blocks joined by a
    blank line, the response header last."""
    return ('{{- range $i, $m := .Messages }}{{ if $i }}\n\n{{ end }}'
            '{{ if eq $m.Role "system" }}### System:\n{{ $m.Content }}'
            '{{ else if eq $m.Role "user" }}### Instruction:\n{{ $m.Content }}'
            '{{ else if eq $m.Role "assistant" }}### Response:\n{{ $m.Content }}' + eos +
            '{{ end }}{{ end }}\n\n### Response:\n')


def _alpaca(messages, eos: str) -> str:
    """What :func:`ollama_alpaca` renders for ``messages`` (a Python mirror of the Go)."""
    return "\n\n".join(_ALPACA_HEADERS[m["role"]] + m["content"]
                         + (eos if m["role"] == "assistant" else "") for m in messages) \
        + "\n\n### Response:\n"


def ollama_template(tokenizer) -> tuple[str, str | None, str] | None:
    """(Go template, default system message or None, what it is) reproducing the
    tokenizer's chat template in use exactly on the probe conversations, or None when we
    have no faithful one."""
    if not tokenizer.chat_template:
        return None
    try:
        renders = [tokenizer.apply_chat_template(p, add_generation_prompt=True) for p in _PROBES]
    except Exception:  # whatever a template raises on a probe, it is not one we translate
        return None
    eos = tokenizer.eos_token or ""
    if '"""' not in eos and all(r == _alpaca(p, eos) for p, r in zip(_PROBES, renders)):
        return ollama_alpaca(eos), None, "the Alpaca layout"
    system, head = None, "<|im_start|>system\n"
    if renders[0].startswith(head) and "<|im_end|>\n" in renders[0]:
        system = renders[0][len(head):renders[0].index("<|im_end|>\n")]
    for probe, rendered in zip(_PROBES, renders):
        if system is not None and probe[0]["role"] != "system":
            probe = [{"role": "system", "content": system}] + probe  # Ollama's SYSTEM rule
        if rendered != _chatml(probe):
            return None
    # no faithful Modelfile when the system message cannot be quoted, so none is written
    if system is not None and not _system_ok(system):
        return None
    return OLLAMA_CHATML, system, "ChatML"


def _template_lines(tokenizer, source) -> tuple[list[str], str | None]:
    """The TEMPLATE lines (and comments saying what they are) and the trained-in default
    system message, for the run's template; ``source`` says what the Ollama model had."""
    layer = source.template if source is not None else None
    derived = ollama_template(tokenizer)
    if derived is not None:
        go, system, what = derived
        lines = [f"# The chat template the adapter was trained with is {what}: its Go form."]
        if layer is not None:
            same = layer.strip() == go.strip()
            lines.append("# (the Ollama model's own template layer is the same text)" if same else
                         "# (it replaces the Ollama model's own template layer, which differs: "
                         "this is the one the adapter learned)")
        return lines + [f'TEMPLATE """{go}"""'], system
    if tokenizer.template_name == "gguf" and layer is not None:
        return [f"# No TEMPLATE: Ollama keeps {source.ollama_name}'s own Go template (through "
                "FROM). The adapter was trained with the GGUF's Jinja chat template, which "
                "toygraph cannot compare with a Go template: check that they render alike."], None
    if tokenizer.template_name == "gguf":
        return ["# No TEMPLATE: not one we translate, so Ollama derives it from the GGUF's "
                "chat template (check `ollama show NAME --template`)."], None
    inherited = (f" NOTE: without one, Ollama uses {source.ollama_name}'s own template, which is "
                 "not the one the adapter was trained with." if layer is not None else "")
    return [f"# No TEMPLATE: the run's template ({tokenizer.template_name}) has no Go "
            "translation here; write one, or use the merged GGUF (toygraph export), "
            f"which carries the template.{inherited}"], None


def _system_ok(system: str) -> bool:
    # A SYSTEM """...""" block cannot hold three quotes, and one ending in a quote or a
    # backslash runs into the closing quotes.
    return '"""' not in system and bool(system.strip()) and not system.endswith(('"', "\\"))


def _parameter(key: str, value) -> str | None:
    """``PARAMETER key value`` for one of Ollama's generation parameters, or None when the
    value is not one we write faithfully."""
    if not re.fullmatch(r"[A-Za-z0-9_]+", key):   # Ollama's parameter names; nothing else
        return None
    if isinstance(value, bool):
        return f"PARAMETER {key} {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"PARAMETER {key} {value}"
    if isinstance(value, str) and _quotable(value):
        return f'PARAMETER {key} "{value}"'
    return None


def _parameter_lines(stops: list[str], params: dict) -> list[str]:
    """The stop tokens (the model's end-of-turn tokens, then the Ollama params layer's),
    then the params layer's other generation parameters."""
    lines, skipped = [], []
    given = params.get("stop", [])
    for t in dict.fromkeys([*stops, *([given] if isinstance(given, str) else given)]):
        if isinstance(t, str) and _quotable(t):
            lines.append(f'PARAMETER stop "{t}"')
        else:
            skipped.append("stop")
    for key, value in sorted(params.items()):
        for v in (value if isinstance(value, list) else [value]) if key != "stop" else ():
            line = _parameter(key, v)
            if line is None:
                skipped.append(key)
            else:
                lines.append(line)
    if skipped:
        lines.append(_comment(f"left out (values a Modelfile cannot quote): "
                              f"{', '.join(sorted(set(skipped)))}"))
    return lines


def modelfile_text(base_gguf, adapter: str = "./adapter.gguf",
                   template: tuple[str, str] | None = None, source=None) -> str:
    """The Modelfile for ``base_gguf`` plus the llama.cpp adapter at ``adapter``, whose
    prompts follow ``template`` ((name, Jinja source): the run's; None: the model's own).
    ``source`` (models.stores.Source), when the model came from Ollama's store: FROM names
    the Ollama model (Ollama reuses its blob), and its system message and generation
    parameters are written back."""
    base = Path(base_gguf).absolute()   # a symlink (the HF cache's snapshots) kept: its name ends in .gguf
    tokenizer = Tokenizer.from_gguf(base)
    if template is not None:
        tokenizer.use_template(*template)
    # the tokens that end a reply, the same list generation stops on
    stops = sorted({tokenizer.id_to_token(i) for i in tokenizer.end_of_turn_ids})
    from_ollama = source is not None and source.ollama_name is not None
    lines = [
        "# Ollama model: the base GGUF plus this run's LoRA adapter (llama.cpp format).",
        f"#   ollama create NAME -f path/to/{MODELFILE}    then: ollama run NAME",
        "# Or merge the adapter into one GGUF: toygraph export --model BASE --adapter . --out merged.gguf",
    ]
    if from_ollama:
        lines.append(_comment(f"The base is the Ollama model {source.ollama_name} (GGUF {base})."))
    base_value = path_value(source.ollama_name if from_ollama else str(base))
    if base_value is None:   # left out, said: `ollama create` then fails with "no FROM line"
        lines.append(_comment(f"No FROM: the base's path {base} holds a character a Modelfile "
                              "cannot quote (a line break, a quote, a control character); "
                              "link or copy the GGUF to a plain name and write FROM that path"))
    else:
        lines.append(f"FROM {base_value}")
    lines.append(f"ADAPTER {path_value(adapter)}")
    template_lines, system = _template_lines(tokenizer, source)
    lines += [_comment(line[2:]) if line.startswith("# ") else line for line in template_lines]
    layer_system = source.system if from_ollama else None
    if system is not None:
        lines.append(f'SYSTEM """{system}"""')
        if layer_system is not None and layer_system != system:
            lines.append("# (the trained-in default system message above replaces the Ollama "
                         "model's own system layer)")
    elif layer_system is not None:
        lines.append("# The Ollama model's system message:" if _system_ok(layer_system) else
                     "# The Ollama model's system message cannot be quoted here; Ollama keeps it through FROM.")
        if _system_ok(layer_system):
            lines.append(f'SYSTEM """{layer_system}"""')
    lines += _parameter_lines(stops, source.params if from_ollama else {})
    return "\n".join(lines) + "\n"


def write_modelfile(run_dir, base_gguf, template: tuple[str, str] | None = None,
                    source=None) -> Path:
    """Write ``run_dir/Modelfile`` (atomically) next to the run's ``adapter.gguf``."""
    path = Path(run_dir) / MODELFILE
    text = modelfile_text(base_gguf, template=template, source=source)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
    return path


#: A name ``ollama create`` takes: [host/][namespace/]name[:tag].
OLLAMA_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*/){0,2}[A-Za-z0-9][A-Za-z0-9._-]*"
                         r"(:[A-Za-z0-9_][A-Za-z0-9._-]{0,79})?$")


def ollama_name_error(name: str) -> str | None:
    """Why ``name`` is not a model name Ollama accepts, or None."""
    if OLLAMA_NAME.match(name):
        return None
    return (f"{name!r} is not an Ollama model name ([namespace/]name[:tag]: letters, digits, "
            "'.', '_', '-')")


def ollama_create(name: str, modelfile: Path) -> dict:
    """``ollama create NAME -f Modelfile`` when ``ollama`` is on PATH; else the command to run.
    A dict: ``name``, ``command`` (the line), ``created`` (bool), ``message`` (what happened)."""
    command = f"ollama create {shlex.quote(name)} -f {shlex.quote(str(modelfile))}"
    exe = shutil.which("ollama")
    if exe is None:
        return {"name": name, "command": command, "created": False,
                "message": f"ollama is not on PATH; create the model with:\n  {command}"}
    try:
        proc = subprocess.run([exe, "create", name, "-f", str(modelfile)], capture_output=True,
                              text=True, stdin=subprocess.DEVNULL)
    except OSError as e:   # the training's result stands; the user can run the line
        return {"name": name, "command": command, "created": False,
                "message": f"`{command}` could not run ({e})"}
    if proc.returncode != 0:
        said = " ".join((proc.stderr or proc.stdout).split())[-300:]
        return {"name": name, "command": command, "created": False,
                "message": f"`{command}` failed (exit {proc.returncode}): {said}"}
    return {"name": name, "command": command, "created": True,
            "message": f"created the Ollama model {name}: ollama run {shlex.quote(name)}"}
