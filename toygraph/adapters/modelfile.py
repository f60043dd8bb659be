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

from pathlib import Path

from toygraph.atomic import atomic_write
from toygraph.gguf.tokenizer import Tokenizer

MODELFILE = "Modelfile"


def _quotable(token: str) -> bool:
    # Modelfile values are double-quoted strings; a token that would need escaping is
    # left out rather than risk how Ollama's parser reads escapes.
    return not any(c in token for c in '"\\\n\r')


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
    # A SYSTEM """...""" block cannot hold three quotes, and one ending in a quote or a
    # backslash runs into the closing quotes: no faithful Modelfile then, so none is written.
    if system is not None and ('"""' in system or not system.strip()
                               or system.endswith(('"', "\\"))):
        return None
    return OLLAMA_CHATML, system, "ChatML"


def modelfile_text(base_gguf, adapter: str = "./adapter.gguf",
                   template: tuple[str, str] | None = None) -> str:
    """The Modelfile for ``base_gguf`` plus the llama.cpp adapter at ``adapter``, whose
    prompts follow ``template`` ((name, Jinja source): the run's; None: the model's own)."""
    base = Path(base_gguf).resolve()
    tokenizer = Tokenizer.from_gguf(base)
    if template is not None:
        tokenizer.use_template(*template)
    # the tokens that end a reply, the same list generation stops on
    stops = sorted({tokenizer.id_to_token(i) for i in tokenizer.end_of_turn_ids})
    lines = [
        "# Ollama model: the base GGUF plus this run's LoRA adapter (llama.cpp format).",
        f"#   ollama create NAME -f path/to/{MODELFILE}    then: ollama run NAME",
        "# Or merge the adapter into one GGUF: toygraph export --model BASE --adapter . --out merged.gguf",
        f"FROM {base}",
        f"ADAPTER {adapter}",
    ]
    derived = ollama_template(tokenizer)
    if derived is not None:
        go, system, what = derived
        lines.append(f"# The chat template the adapter was trained with is {what}: its Go form.")
        lines.append(f'TEMPLATE """{go}"""')
        if system is not None:
            lines.append(f'SYSTEM """{system}"""')
    elif tokenizer.template_name == "gguf":
        lines.append("# No TEMPLATE: not one we translate, so Ollama derives it from the GGUF's "
                     "chat template (check `ollama show NAME --template`).")
    else:
        lines.append(f"# No TEMPLATE: the run's template ({tokenizer.template_name}) has no Go "
                     "translation here; write one, or use the merged GGUF (toygraph export), "
                     "which carries the template.")
    lines += [f'PARAMETER stop "{t}"' for t in stops if _quotable(t)]
    return "\n".join(lines) + "\n"


def write_modelfile(run_dir, base_gguf, template: tuple[str, str] | None = None) -> Path:
    """Write ``run_dir/Modelfile`` (atomically) next to the run's ``adapter.gguf``."""
    path = Path(run_dir) / MODELFILE
    text = modelfile_text(base_gguf, template=template)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
    return path
