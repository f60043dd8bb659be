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
message, as that template does). Any other template is left to Ollama's detection, and
the Modelfile says so: a translation we cannot check against the Jinja original would
silently change every prompt.
"""
from __future__ import annotations

from pathlib import Path

from toygraph.adapters.files import _atomic_write
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


def ollama_template(tokenizer) -> tuple[str, str | None] | None:
    """(Go template, default system message or None) reproducing the tokenizer's chat
    template exactly on the probe conversations, or None when we have no faithful one."""
    if not tokenizer.chat_template:
        return None
    try:
        renders = [tokenizer.apply_chat_template(p, add_generation_prompt=True) for p in _PROBES]
    except Exception:  # whatever a template raises on a probe, it is not plain ChatML
        return None
    system, head = None, "<|im_start|>system\n"
    if renders[0].startswith(head) and "<|im_end|>\n" in renders[0]:
        system = renders[0][len(head):renders[0].index("<|im_end|>\n")]
    for probe, rendered in zip(_PROBES, renders):
        if system is not None and probe[0]["role"] != "system":
            probe = [{"role": "system", "content": system}] + probe  # Ollama's SYSTEM rule
        if rendered != _chatml(probe):
            return None
    if system is not None and ('"""' in system or not system.strip()):
        return None
    return OLLAMA_CHATML, system


def modelfile_text(base_gguf, adapter: str = "./adapter.gguf") -> str:
    """The Modelfile for ``base_gguf`` plus the llama.cpp adapter at ``adapter``."""
    base = Path(base_gguf).resolve()
    tokenizer = Tokenizer.from_gguf(base)
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
        template, system = derived
        lines.append("# The GGUF's chat template is ChatML: Ollama's own ChatML template.")
        lines.append(f'TEMPLATE """{template}"""')
        if system is not None:
            lines.append(f'SYSTEM """{system}"""')
    elif tokenizer.chat_template:
        lines.append("# No TEMPLATE: not ChatML, so Ollama derives it from the GGUF's chat "
                     "template (check `ollama show NAME --template`).")
    else:
        lines.append("# The base GGUF has no chat template: Ollama sends prompts as they are.")
    lines += [f'PARAMETER stop "{t}"' for t in stops if _quotable(t)]
    return "\n".join(lines) + "\n"


def write_modelfile(run_dir, base_gguf) -> Path:
    """Write ``run_dir/Modelfile`` (atomically) next to the run's ``adapter.gguf``."""
    path = Path(run_dir) / MODELFILE
    text = modelfile_text(base_gguf)
    _atomic_write(path, lambda tmp: Path(tmp).write_text(text))
    return path
