"""The CUDA C++ sources of every kernel, assembled into one translation unit per precision.

Each op family declares its kernel files, which sit beside its CUDA lowering in
``toygraph/ops/<family>/``, with :func:`declare_kernels` (norm/cuda.py: ``declare_kernels(__file__,
"norm.cu")``); a file that uses another's helpers says so with ``needs`` and is placed
after it. Headers (``.cuh``) sit in ``toygraph/ops/include/``: the ones every kernel
shares (common.cuh; blocks.cuh, the block-format decoders) and the tensor-core helpers a
family declares for its precisions. Numbers the host and the kernels
share are emitted ahead of them as ``#define``s: the tile sizes and thread counts of
constants.py (:func:`constants.constant_defines`) and the block layouts of
``toygraph.gguf.blocks`` (:func:`layout_defines`). The kernels need no CUDA toolkit
header, so NVRTC compiles them with nothing but its own wheel.

A backend compiles :func:`backend_source` of its precision once (cached on disk by
nvrtc.py): "f32" the files declared for every precision, "bf16"/"tf32" those plus the
tensor-core files declared for them only (so the f32 module and its cubin stay as they
are). The files are known once the op families are imported (``toygraph.ops``, which
any graph has done); this module never imports them itself.

>>> from toygraph import ops                           # the families declare their files
>>> "tg_matmul" in kernel_names(backend_source("f32"))
True
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from toygraph.ops.lowering.constants import constant_defines
from toygraph.errors import CudaError

#: The shared headers, included ahead of every family's files.
INCLUDE_DIR = Path(__file__).parent.parent / "include"
HEADERS = ("common.cuh", "blocks.cuh")


@dataclass(frozen=True)
class KernelFile:
    """One family's kernel file: where it is, the files it uses helpers of, and the module
    precisions it is compiled into (None: every module)."""
    name: str
    path: Path
    needs: tuple[str, ...]
    precisions: tuple[str, ...] | None


#: Every declared kernel file by name, in declaration order.
FILES: dict[str, KernelFile] = {}


def declare_kernels(module_file: str, *names: str, needs: tuple[str, ...] = (),
                    precisions: tuple[str, ...] | None = None) -> None:
    """Declare kernel files ``names`` beside ``module_file`` (an op family's ``__file__``).
    ``needs``: files whose helpers they use; ``precisions``: the modules they belong to
    (default every precision; the tensor-core files only "bf16" and "tf32")."""
    for name in names:
        # headers live in include/ with the shared ones; kernels beside their family's cuda.py
        folder = INCLUDE_DIR if name.endswith(".cuh") else Path(module_file).resolve().parent
        if name in FILES or name in HEADERS:
            raise CudaError(f"kernel file {name!r} is declared twice")
        if not (folder / name).is_file():
            raise CudaError(f"kernel file {folder / name} does not exist")
        FILES[name] = KernelFile(name, folder / name, tuple(needs),
                                 None if precisions is None else tuple(precisions))


def ordered(names) -> list[str]:
    """``names`` (declared files) with each file after the files it needs, otherwise in
    declaration order."""
    out: list[str] = []

    def place(name, chain=()):
        if name in out:
            return
        if name in chain:
            raise CudaError(f"kernel files need each other: {' -> '.join(chain + (name,))}")
        if name not in FILES:
            raise CudaError(f"kernel file {name!r} is not declared (declared: {sorted(FILES)}; "
                            "import toygraph.cuda, which loads the families' CUDA lowerings)")
        for dep in FILES[name].needs:
            place(dep, chain + (name,))
        out.append(name)

    declared = list(FILES)
    for name in sorted(names, key=lambda n: declared.index(n) if n in FILES else -1):
        place(name)
    return out


def files_of(precision: str) -> tuple[str, ...]:
    """The declared files of ``precision``'s module, in order."""
    if not FILES:
        raise CudaError("no kernel files are declared: import toygraph.cuda, which loads "
                        "the op families' CUDA lowerings")
    return tuple(ordered([f.name for f in FILES.values()
                          if f.precisions is None or precision in f.precisions]))


def only_in(precision: str) -> tuple[str, ...]:
    """The files ``precision``'s module adds to the f32 module (the tensor-core files)."""
    return tuple(n for n in files_of(precision) if n not in files_of("f32"))


def source_path(name: str) -> Path:
    """Where kernel source ``name`` lives: a shared header in include/, else its family's folder."""
    if name in HEADERS:
        return INCLUDE_DIR / name
    if name not in FILES:
        raise CudaError(f"kernel file {name!r} is not declared")
    return FILES[name].path


def source_files() -> list[Path]:
    """Every kernel source file: the headers, then every declared family file."""
    return [source_path(name) for name in HEADERS + tuple(ordered(FILES))]


def read_source(name: str) -> str:
    return source_path(name).read_text()


def layout_defines() -> str:
    """blocks.BLOCK and blocks.LAYOUT as C macros (``TG_Q4_K_QK``, ``TG_Q4_K_BYTES``,
    ``TG_Q4_K_SCALES``...) for every stored format but f32, and blocks.IQ4NL_VALUES and
    MXFP4_VALUES as ``TG_IQ4NL_VALUES`` / ``TG_MXFP4_VALUES``, so the kernels use the one
    description of each block (the CPU engine's decoders, cpu/decode.h, get the
    same macros: blocks.c_defines)."""
    from toygraph.gguf import blocks
    return blocks.c_defines()


@lru_cache(maxsize=None)
def module_source(files: tuple[str, ...]) -> str:
    """The shared constants and block layouts as macros, the headers, then ``files`` (in
    the order their needs give): one translation unit."""
    parts = ["// ---- constants\n" + constant_defines(),
             "// ---- block layouts\n" + layout_defines()]
    parts += [f"// ---- {h}\n" + read_source(h) for h in HEADERS]
    parts += [f"// ---- {f}\n" + read_source(f) for f in ordered(files)]
    return "\n".join(parts)


def backend_source(precision: str = "f32") -> str:
    """The module a backend of this precision compiles: f32 the files of every precision,
    bf16/tf32 those plus the tensor-core files."""
    return module_source(files_of(precision))


# --- the kernels of a source, with the per-format kernels of TG_BLOCK_FORMATS expanded -----
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)')
_FUNCTION_MACRO = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)\(([^)]*)\)[ \t]*(.*)$", re.M)
_FORMATS_LINE = re.compile(r"^[ \t]*TG_BLOCK_FORMATS\((\w+)\)[ \t]*$", re.M)


def _x_macros(source: str) -> list[tuple[re.Match, re.Match]]:
    """(the line, the #define of its M) for every ``TG_BLOCK_FORMATS(M)`` line of
    ``source``, whose continuation lines are joined."""
    defines = {m[1]: m for m in _FUNCTION_MACRO.finditer(source)}
    uses = []
    for line in _FORMATS_LINE.finditer(source):
        if line[1] not in defines:
            raise CudaError(f"TG_BLOCK_FORMATS({line[1]}): no macro {line[1]}(fmt, NAME) is "
                            "defined in the source")
        uses.append((line, defines[line[1]]))
    return uses


def _expand(define: re.Match, args) -> str:
    """The body of the function-like macro ``define`` for ``args``, as the preprocessor
    makes it: ``#p`` made a string, ``p`` replaced, then ``a ## b`` pasted."""
    body = define[3]
    for p, a in zip((p.strip() for p in define[2].split(",")), args):
        body = re.sub(rf"(?<!#)#\s*{p}\b", f'"{a}"', body)
        body = re.sub(rf"\b{p}\b", a, body)
    return re.sub(r"\s*##\s*", "", body)


def expand_block_formats(source: str) -> str:
    """``source`` as the preprocessor leaves its X-macro lines: every ``TG_BLOCK_FORMATS(M)``
    replaced by M's body once per block format of blocks.BLOCK_FORMATS (``X(q4_k, Q4_K)``),
    M's #define gone. The compilers expand the X-macro themselves; this is for reading the
    kernels it defines from the text (kernel_names, so the host executor's exports, and the
    signature tests), checked against g++ -E by a test."""
    from toygraph.gguf import blocks
    source = source.replace("\\\n", " ")
    uses = _x_macros(source)
    edits = {define.span(): "" for _, define in uses}
    edits.update({line.span(): "\n".join(_expand(define, f) for f in blocks.c_formats())
                  for line, define in uses})
    out, end = [], 0
    for (start, stop), text in sorted(edits.items()):
        out += [source[end:start], text]
        end = stop
    return "".join(out) + source[end:]


def kernel_names(source: str) -> list[str]:
    """The ``extern "C" __global__`` kernels of a source, TG_BLOCK_FORMATS lines expanded."""
    return _KERNEL.findall(expand_block_formats(source))


def format_kernels(source: str) -> dict[str, dict[str, str]]:
    """The kernels ``source`` defines once per block format (its TG_BLOCK_FORMATS lines), as
    {pattern: {format: kernel}}, the pattern being the kernel's name with the format as
    ``<fmt>``: ``{"tg_qmm_nt_<fmt>": {"f16": "tg_qmm_nt_f16", ...}, ...}``."""
    from toygraph.gguf import blocks
    table: dict[str, dict[str, str]] = {}
    for _, define in _x_macros(source.replace("\\\n", " ")):
        placeholder = _expand(define, ("FMT", "NAME"))
        patterns = [k.replace("FMT", "<fmt>") for k in _KERNEL.findall(placeholder)]
        for fmt, name in blocks.c_formats():
            kernels = _KERNEL.findall(_expand(define, (fmt, name)))
            for pattern, kernel in zip(patterns, kernels, strict=True):
                table.setdefault(pattern, {})[fmt] = kernel
    return table
