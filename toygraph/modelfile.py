"""An Ollama ``Modelfile`` for a run directory, so ``ollama create NAME -f Modelfile``
works as written.

>>> print(modelfile_text("/models/SmolLM2-135M-Instruct.Q4_1.gguf"))   # doctest: +SKIP
FROM /models/SmolLM2-135M-Instruct.Q4_1.gguf
ADAPTER ./adapter.gguf
PARAMETER stop "<|im_end|>"
...

``FROM`` names the base GGUF by absolute path; ``ADAPTER`` is relative, which Ollama
resolves against the Modelfile's own directory. There is no ``TEMPLATE`` line on purpose:
Ollama turns a GGUF's ``tokenizer.chat_template`` (Jinja) into its own Go template when it
reads the file, and a translation written here could not be checked against Ollama's
renderer, so a wrong one would silently change every prompt. The stop tokens are the
model's end-of-turn tokens, the same ones ``toygraph generate`` stops at.
"""
from __future__ import annotations

from pathlib import Path

from .adapters import _atomic_write

MODELFILE = "Modelfile"


def _quotable(token: str) -> bool:
    # Modelfile values are double-quoted strings; a token that would need escaping is
    # left out rather than risk how Ollama's parser reads escapes.
    return not any(c in token for c in '"\\\n\r')


def modelfile_text(base_gguf, adapter: str = "./adapter.gguf") -> str:
    """The Modelfile for ``base_gguf`` plus the llama.cpp adapter at ``adapter``."""
    from .inference import LanguageModel

    base = Path(base_gguf).resolve()
    lm = LanguageModel(base)  # opens the file and tokenizer only; no graph is built
    stops = sorted({lm.tokenizer.id_to_token(i) for i in lm.stop_ids})
    lines = [
        "# Ollama model: the base GGUF plus this run's LoRA adapter (llama.cpp format).",
        f"#   ollama create NAME -f path/to/{MODELFILE}    then: ollama run NAME",
        "# Or merge the adapter into one GGUF: toygraph export --model BASE --adapter . --out merged.gguf",
        f"FROM {base}",
        f"ADAPTER {adapter}",
    ]
    if lm.tokenizer.chat_template:
        lines.append("# No TEMPLATE: Ollama derives it from the GGUF's tokenizer.chat_template.")
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
