"""Prompt formats: which chat template a model's conversations are rendered with.

A GGUF that carries ``tokenizer.chat_template`` is rendered with it. A base model without
one gets :data:`DEFAULT` (the Alpaca layout, below) instead of being refused, and
``--template NAME|FILE`` chooses another for any model. The one choice serves everything
that renders a conversation: training and ``eval`` (toygraph/data/encoding.py),
``generate --chat`` and ``chat``, the Ollama ``Modelfile``'s ``TEMPLATE`` and the merged
GGUF's ``tokenizer.chat_template``; a run records it (``template`` in run.yaml, and the
adapter's safetensors metadata), so the adapter is used the way it was trained.

>>> choose_template(tokenizer, None)        # doctest: +SKIP
('gguf', '{% for message in messages %}...')
>>> choose_template(tokenizer, "alpaca")    # doctest: +SKIP
('alpaca', '{% for m in messages %}...')

The named templates are written for transformers' Jinja environment (the tokenizer's),
and each ends an assistant reply with the end-of-sequence token, so a model learns to stop
where generation stops.
"""
from __future__ import annotations

from pathlib import Path

from toygraph.errors import DataError

#: Alpaca's headers, without its preamble: "### Instruction:" / "### Response:" blocks
#: separated by a blank line; a reply ends with EOS; the generation prompt is the response
#: header. The format base models most often meet in instruction data.
ALPACA = (
    "{% for m in messages %}"
    "{% if not loop.first %}{{ '\\n\\n' }}{% endif %}"
    "{% if m['role'] == 'system' %}{{ '### System:\\n' + m['content'] }}"
    "{% elif m['role'] == 'user' %}{{ '### Instruction:\\n' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '### Response:\\n' + m['content'] + (eos_token or '') }}"
    "{% else %}{{ raise_exception('the alpaca template has no role ' + m['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ ('\\n\\n' if messages else '') + '### Response:\\n' }}{% endif %}"
)
#: ChatML as SmolLM2 and Qwen write it (<|im_start|>role ... <|im_end|>), for vocabularies
#: that have those tokens.
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
#: The named templates ``--template`` accepts.
TEMPLATES = {"alpaca": ALPACA, "chatml": CHATML}
#: The template of a model whose GGUF has none.
DEFAULT = "alpaca"
#: The name of "the GGUF's own template".
FROM_FILE = "gguf"


def bos_first(source: str, tokenizer) -> str:
    """``source`` (the template ``tokenizer`` uses) as a merged GGUF stores it: printing the
    BOS token first where the tokenizer adds one and the template does not print it.
    llama-cpp-python's chat completion renders the file's template and adds no BOS of its
    own (a Gemma 3 model asked that way answered nothing); llama.cpp, which adds BOS,
    strips a rendered one (common/chat.cpp), and so does LanguageModel.encode_prompt."""
    bos = tokenizer.bos_token
    if not tokenizer.add_bos_token or not bos:
        return source
    probe = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                          add_generation_prompt=True)
    return source if probe.startswith(bos) else "{{ bos_token }}" + source


def shared_name(name: str) -> str:
    """A template's name as a file meant to be shared records it (an adapter, a merged
    GGUF): a Jinja file's own name, not its path, which names the machine (a home
    directory, a user). The built-in names pass unchanged."""
    return Path(name).name if "/" in name else name


def choose_template(tokenizer, choice: str | None) -> tuple[str, str]:
    """(name, Jinja source) of the template a model's conversations are rendered with:
    ``choice`` None is the GGUF's own template, or :data:`DEFAULT` when it has none;
    "gguf" the GGUF's (an error when it has none); a name of :data:`TEMPLATES`; or the
    path of a Jinja file (its name is then the path)."""
    own = tokenizer.file_chat_template
    if choice is None:
        return (FROM_FILE, own) if own else (DEFAULT, TEMPLATES[DEFAULT])
    if choice == FROM_FILE:
        if not own:
            raise DataError(f"--template gguf: {tokenizer.source} has no chat template; "
                            f"choose one of {', '.join(TEMPLATES)} or a Jinja file")
        return FROM_FILE, own
    if choice in TEMPLATES:
        return choice, TEMPLATES[choice]
    path = Path(choice)
    if not path.is_file():
        raise DataError(f"--template {choice}: neither a template name ({FROM_FILE}, "
                        f"{', '.join(TEMPLATES)}) nor a file")
    try:
        return str(path.resolve()), path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"--template {choice}: cannot read it ({e})") from None
