"""Every environment variable toygraph reads, in one table, and typed accessors for them.

The environment is read when :func:`get` is called (never cached at import), so tests can
``monkeypatch.setenv`` freely. An unset or empty variable means its default; a malformed
value is a one-line :class:`~toygraph.errors.SettingError` naming the variable.

>>> get("TOYGRAPH_CUDA_GRAPHS")       # with the variable unset
True
>>> cache_dir("kernels")              # doctest: +SKIP
PosixPath('/home/me/.cache/toygraph/kernels')

``TOYGRAPH_CACHE`` is one root with a sub-folder per kind of cached file (``CACHE_FOLDERS``).
:func:`markdown_table` renders the table for the README's "Settings" section.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from toygraph.errors import SettingError


@dataclass(frozen=True)
class Setting:
    """One environment variable: ``kind`` is "flag" (0/1), "path", "choice" (one of
    ``choices``), "device" (a CUDA ordinal or "host"), "seconds" (a number > 0) or "count" (a whole
    number >= 1, None when unset);
    ``default`` is written as it would be in the environment ("" means unset)."""
    name: str
    kind: str
    default: str
    meaning: str
    choices: tuple[str, ...] = ()


#: The sub-folders of ``$TOYGRAPH_CACHE`` and what lives in each.
CACHE_FOLDERS = {
    "models": "GGUFs fetched or written once (SmolLM2, the tiny fixture models)",
    "kernels": "NVRTC cubins, and the host executor's g++ libraries in kernels/host",
    "bench": "bench/bench_lora.py's models and results (unless TOYGRAPH_BENCH_CACHE is set)",
}

SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("TOYGRAPH_CACHE", "path", "~/.cache/toygraph",
            "root of the caches: `models/`, `kernels/` and `bench/` under it"),
    Setting("TOYGRAPH_SMOLLM2", "path", "",
            "the SmolLM2-135M-Instruct Q4_1 GGUF to use instead of searching for it"),
    Setting("TOYGRAPH_GEMMA3_270M", "path", "",
            "the Gemma 3 270M Q4_K_M GGUF to use instead of the one fetched into the cache"),
    Setting("TOYGRAPH_QWEN25_CODER_05B", "path", "",
            "the Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF to use instead of the one fetched "
            "into the cache"),
    Setting("TOYGRAPH_QWEN25_CODER_15B", "path", "",
            "the Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF to use instead of the one fetched "
            "into the cache"),
    Setting("TOYGRAPH_OFFLINE", "flag", "0",
            "tests skip instead of downloading SmolLM2 or Gemma 3 270M when not on this machine"),
    Setting("TOYGRAPH_CUDA_DEVICE", "device", "0",
            "CUDA device ordinal, or `host` to run the CUDA kernels on the CPU"),
    Setting("TOYGRAPH_CUDA_GRAPHS", "flag", "1",
            "replay each phase as a captured CUDA graph (0: launch kernels one by one)"),
    Setting("TOYGRAPH_CUDA_QMATMUL", "flag", "1",
            "keep block-format weights quantized on the device (0: f32 copies of all)"),
    Setting("TOYGRAPH_CUDA_DUAL_GEMM", "flag", "1",
            "at `--precision bf16`, compute a LoRA projection's base product and adapter in "
            "one GEMM (0: the base product written, then added in the adapter's GEMM)"),
    Setting("TOYGRAPH_CUDA_BF16_ACTIVATIONS", "flag", "1",
            "at `--precision bf16`, keep the activations that only matmuls and bf16-aware "
            "kernels read in bf16 (0: every buffer f32, the matmuls still bf16)"),
    Setting("TOYGRAPH_BASE_MEMORY", "choice", "auto",
            "how the numpy backend holds a frozen base stored as f16/bf16/quantized blocks: "
            "`quantized` in its file's format, the CPU engine multiplying on the blocks "
            "panel by panel, `decode` to f32 once at realize (BLAS on f32 copies: 4 bytes a "
            "weight), `auto` quantized with the engine, else decode when that fits the "
            "machine's memory", ("auto", "decode", "quantized")),
    Setting("TOYGRAPH_CPU_DOT", "choice", "int8",
            "how the CPU engine multiplies a few rows (generation's one-token step, GRPO "
            "groups of up to 4) with a weight kept in blocks: `int8` rounds x per 32 columns "
            "to 8 bits and multiplies in integers, as llama.cpp does (x86 with AVX2, ARM with NEON; "
            "elsewhere f32), `f32` keeps x in f32 (slower; the rounding of the training "
            "forward and of more rows)", ("int8", "f32")),
    Setting("TOYGRAPH_CPU_TARGET", "choice", "native",
            "the instruction set the CPU engine is built for: `native` this CPU's own, "
            "`x86-64-v3` AVX2 and FMA only (what a CPU without AVX-512 runs; a benchmark "
            "at the same instruction set as a reference capped to AVX2), `x86-64-v4` "
            "AVX-512", ("native", "x86-64-v3", "x86-64-v4")),
    Setting("TOYGRAPH_CPU_REPLAY", "choice", "engine",
            "how the numpy backend runs a step's nodes: `engine` every run of nodes that has "
            "CPU engine kernels (toygraph/ops/<family>/cpu.h: all but all_reduce) as one "
            "engine call on its pool of threads, `numpy` one numpy kernel per node from "
            "Python (the reference the goldens are recorded on; also what runs where the "
            "engine is not built)", ("engine", "numpy")),
    Setting("TOYGRAPH_THREADS", "count", "",
            "threads the CPU engine and BLAS compute with (`--threads` overrides it); unset: "
            "the CPUs this process may run on"),
    Setting("TOYGRAPH_HOST_OPT", "choice", "-O1",
            "g++ optimisation level of the host executor's kernel library",
            ("-O0", "-O1", "-O2", "-O3")),
    Setting("TOYGRAPH_HOST_SCHEDULE", "choice", "forward",
            "order the host executor runs a block's threads in between barriers",
            ("forward", "reverse")),
    Setting("TOYGRAPH_MPI_TIMEOUT", "seconds", "600",
            "how long an MPI rank waits in a collective before it aborts the job"),
    Setting("TOYGRAPH_BENCH_CACHE", "path", "",
            "bench/bench_lora.py's cache (unset: `$TOYGRAPH_CACHE/bench`)"),
    # models by name (models/stores.py): the other programs' stores, read, never written
    Setting("OLLAMA_MODELS", "path", "",
            "Ollama's model store for `--model ollama:NAME` (unset: `~/.ollama/models`, else "
            "`/usr/share/ollama/.ollama/models`)"),
    Setting("HF_HUB_CACHE", "path", "",
            "the Hugging Face hub cache for `--model hf:ORG/REPO/FILE.gguf` (unset: `$HF_HOME/hub`)"),
    Setting("HF_HOME", "path", "~/.cache/huggingface",
            "Hugging Face's home; its `hub/` is the hub cache unless `HF_HUB_CACHE` is set"),
    Setting("LMSTUDIO_MODELS", "path", "",
            "LM Studio's models folder for `--model lmstudio:...` (unset: `~/.lmstudio/models` "
            "and `~/.cache/lm-studio/models`)"),
)}

_FLAG_WORDS = {"1": True, "true": True, "yes": True, "on": True,
               "0": False, "false": False, "no": False, "off": False}


def parse(name: str, raw: str | None):
    """``raw`` (a value of variable ``name``; None or "" for its default) as its type:
    bool, Path (None when unset without default), str, int/"host" for a device, or float
    seconds."""
    s = SETTINGS[name]
    text = s.default if raw is None or raw == "" else raw.strip()
    if s.kind == "flag":
        if text.lower() not in _FLAG_WORDS:
            raise SettingError(f"{name} must be 0 or 1 (or true/false, yes/no, on/off), "
                               f"got {raw!r}")
        return _FLAG_WORDS[text.lower()]
    if s.kind == "path":
        return Path(text).expanduser() if text else None
    if s.kind == "choice":
        if text not in s.choices:
            raise SettingError(f"{name} must be one of {', '.join(s.choices)}, got {raw!r}")
        return text
    if s.kind == "seconds":
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (value > 0 and value != float("inf")):
            raise SettingError(f"{name} must be a number of seconds > 0, got {raw!r}")
        return value
    if s.kind == "count":
        if not text:
            return None
        if not _whole(text) or int(text) < 1:
            raise SettingError(f"{name} must be a whole number >= 1, got {raw!r}")
        return int(text)
    if text == "host":  # kind "device"
        return text
    if not _whole(text):
        raise SettingError(f"{name} must be a device ordinal or 'host', got {raw!r}")
    return int(text)


def _whole(text: str) -> bool:
    """Whether ``text`` is a whole number int() reads: str.isdigit alone also takes "²"."""
    return text.isascii() and text.isdigit()


def get(name: str):
    """The current value of environment variable ``name`` (a key of ``SETTINGS``)."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not in toygraph.environment.SETTINGS")
    return parse(name, os.environ.get(name))


def given(name: str) -> bool:
    """Whether variable ``name`` (a key of ``SETTINGS``) is set to something non-empty."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not in toygraph.environment.SETTINGS")
    return bool(os.environ.get(name, "").strip())


def cache_dir(folder: str) -> Path:
    """``$TOYGRAPH_CACHE/<folder>`` for one of ``CACHE_FOLDERS`` (not created here)."""
    if folder not in CACHE_FOLDERS:
        raise KeyError(f"unknown cache folder {folder!r} (one of {', '.join(CACHE_FOLDERS)})")
    return get("TOYGRAPH_CACHE") / folder


def markdown_table() -> str:
    """The table as Markdown, as the README's "Settings" section shows it."""
    rows = ["| Variable | Type | Default | Meaning |", "|---|---|---|---|"]
    for s in SETTINGS.values():
        kind = " / ".join(f"`{c}`" for c in s.choices) if s.choices else s.kind
        default = f"`{s.default}`" if s.default else "unset"
        rows.append(f"| `{s.name}` | {kind} | {default} | {s.meaning} |")
    return "\n".join(rows) + "\n"
