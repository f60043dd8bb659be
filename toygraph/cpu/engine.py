"""The CPU engine: native kernels that compute on GGUF blocks, on one pool of threads.

engine.cpp (with simd.h, pool.h, decode.h, gemm.h beside it) is built once with the host
compiler (toygraph/native.py) for this machine's CPU (``-march=native``; the CPU's flags
are part of the cache key) and loaded with ctypes. It holds

- the block decoders, bit for bit ``blocks.dequantize``'s values (the same f32 products in
  the same order), vectorised by the compiler for the target (AVX-512, AVX2, NEON);
- products with a weight kept in its blocks, decoded panel by panel right before the
  product on that panel: :func:`matmul_nt` (x W^T, the forward) and :func:`matmul_nn`
  (g W, the input gradient); no f32 copy of the weight exists, each thread's panels are
  tens of KiB; and for a few rows (generation's one-token step, ``M <= DOT_MAX_M``) dot
  kernels that read each block once and apply its scale to the partial sum (dot.h): on
  x86 with AVX2 and on ARM with NEON with x rounded per 32 columns to int8 and integer
  multiply-adds, as llama.cpp does (dot8.h, :func:`dot_q8`), elsewhere in f32;
- the pool of threads every kernel runs on (:func:`set_threads`; cpu/threads.py sets it
  and BLAS's together).

Without a compiler, or if the build fails, :func:`library` is None, the fallback is said
once on this module's logger, and callers take the numpy path (blocks.dequantize and BLAS
on the decoded weight).

>>> y = matmul_nt(x, raw, "q4_k", (4864, 896))        # doctest: +SKIP
"""
from __future__ import annotations

import ctypes
import logging
from functools import lru_cache
from pathlib import Path

import numpy as np

from toygraph import environment, native
from toygraph.cpu import threads
from toygraph.errors import GGUFError, ToygraphError
from toygraph.gguf import blocks

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
#: The engine's own sources, in the order they are concatenated; the op families' replay
#: kernels (:func:`family_kernels`) come after replay.h, engine.cpp's entry points last.
SOURCES = ("simd.h", "pool.h", "decode.h", "gemm.h", "dot.h", "dot8.h", "replay.h", "vmath.h",
           "products.h", "engine.cpp")
#: The formats the engine knows, by index: decode.h's kFormats table expands the same list
#: (TG_BLOCK_FORMATS, from blocks.c_defines) in the same order.
FORMATS = blocks.BLOCK_FORMATS
#: -ffp-contract=off and no fast-math keep blocks.py's f32 rounding order bit for bit in the
#: decoders (the products use explicit FMA intrinsics, which the flag does not touch);
#: -march=native is safe for the values (IEEE ops whatever the vector width), and the
#: CPU's flags are part of the cache key so a shared cache never hands a library to a
#: CPU it was not built for.
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread",
         "-ffp-contract=off", "-fno-fast-math", "-fvisibility=hidden")
#: The entry points engine.cpp exports; a cached library without one of them is rebuilt.
SYMBOLS = ("tg_simd", "tg_set_threads", "tg_threads", "tg_dot_q8", "tg_decode",
           "tg_decode_rows", "tg_matmul", "tg_replay_kernel", "tg_replay", "tg_draw",
           "tg_release")
#: Rows of x up to which the row-dot kernels run instead of the panels (dot.h's DOT_MAX_M).
DOT_MAX_M = 4

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def family_kernels() -> list[Path]:
    """The op families' replay kernels (toygraph/ops/<family>/cpu.h), in folder order. They
    are read as files, not imported: the engine is built below the ops it runs."""
    return sorted((HERE.parent / "ops").glob("*/cpu.h"))


def source() -> str:
    """The translation unit the library is built from: the CPU's flags (a comment, for the
    cache key), the block layouts, the headers, the families' replay kernels and the entry
    points."""
    parts = [f"// cpu {_cpu_flags()}", blocks.c_defines()]
    for name in SOURCES:
        if name == "engine.cpp":
            parts += [f"// ---- ops/{p.parent.name}/cpu.h\n{p.read_text()}" for p in family_kernels()]
        parts.append(f"// ---- {name}\n{(HERE / name).read_text()}")
    return "\n".join(parts)


@lru_cache(maxsize=None)
def library():
    """The engine as a loaded library, or None (no compiler, or the build failed: logged
    once)."""
    target = environment.get("TOYGRAPH_CPU_TARGET")
    try:
        lib = load(source(), target=f"-march={target}")
    except (ToygraphError, OSError) as native_error:
        try:   # a compiler that does not know -march=native here: its default target
            lib = load(source(), target="")
            logger.warning("the CPU engine is built for the compiler's default target, not "
                           "this CPU's own (slower): %s", str(native_error).splitlines()[0])
        except (ToygraphError, OSError) as e:
            logger.warning("the CPU engine is not available, block formats take the numpy "
                           "path (decoded whole, several times slower): %s",
                           str(e).splitlines()[0])
            return None
    lib.tg_set_threads(threads.resolve(None))   # the process's count until use_threads
    return lib


def loaded():
    """The engine if this process has loaded it already, else None: for callers that only
    gain speed by it (sampling's draw), which should never wait for its build."""
    return library() if library.cache_info().currsize else None


def release() -> None:
    """Free the memory the engine's kernels keep between calls on this thread (the fused
    head's chunk of logits, attention's kept blocks), where it is loaded: at the end of a
    training run, so that what comes after it (generation, another run) does not carry it."""
    lib = loaded()
    if lib is not None:
        lib.tg_release()


def load(text: str, target: str = "-march=native"):
    """The engine built from ``text`` (:func:`source`, or a variant of it: the tests build
    deliberately broken ones) for ``target`` (the tests also build the AVX2 and the plain
    x86-64 code paths; "" for the compiler's default) and loaded, its entry points typed."""
    flags = [f for f in FLAGS if not f.startswith("-march=")] + ([target] if target else [])
    path, _ = native.build_shared(text, flags, environment.cache_dir("kernels") / "cpu",
                                  "the CPU engine (toygraph/cpu/engine.cpp)", symbols=SYMBOLS,
                                  say=True)
    lib = ctypes.CDLL(str(path))
    lib.tg_simd.restype = ctypes.c_char_p
    lib.tg_set_threads.argtypes, lib.tg_set_threads.restype = [_I64], ctypes.c_int
    lib.tg_threads.restype = ctypes.c_int
    lib.tg_dot_q8.restype = ctypes.c_int
    lib.tg_decode.argtypes = [ctypes.c_int, _P, _P, _I64]
    lib.tg_decode_rows.argtypes = [ctypes.c_int, _P, _I64, _I64, _P, _I64, _P]
    lib.tg_matmul.argtypes = [ctypes.c_int, _P, _I64, _I64, _I64, _P, _I64, _I64, _P, _I64,
                              ctypes.c_int, ctypes.c_int]
    lib.tg_replay_kernel.argtypes = [ctypes.c_char_p]
    lib.tg_replay.argtypes = [_P, _I64, _P, _P]
    lib.tg_draw.argtypes, lib.tg_draw.restype = [_P, _I64, ctypes.c_double], _I64
    lib.tg_release.restype = None
    for fn in (lib.tg_decode, lib.tg_decode_rows, lib.tg_matmul, lib.tg_replay_kernel,
               lib.tg_replay):
        fn.restype = ctypes.c_int
    return lib


def available(fmt: str | None = None) -> bool:
    """Whether the engine is built (and knows ``fmt``, when given)."""
    return library() is not None and (fmt is None or fmt in FORMATS)


def simd() -> str:
    """The vector instructions the engine was built for ("avx512", "avx2", "neon",
    "portable"), or "none" without the engine."""
    lib = library()
    return lib.tg_simd().decode() if lib is not None else "none"


def dot_q8() -> bool:
    """Whether the 8-bit dot kernels (x rounded per 32 columns to int8, as llama.cpp does)
    are built: x86 with AVX2, ARM with NEON. Elsewhere a few rows take the f32 dot kernels."""
    lib = library()
    return bool(lib is not None and lib.tg_dot_q8())


#: The most threads the pool takes (pool.h's kMaxThreads): a bound against a count gone
#: wrong, far past any machine's cores (threads.resolve caps the user's count to those).
MAX_THREADS = 256


def set_threads(n: int) -> int:
    """Size the engine's pool to ``n`` threads (the caller and n - 1 workers, n at most
    MAX_THREADS); returns the size it has (the engine missing: 1)."""
    if not 1 <= n <= MAX_THREADS:
        raise ToygraphError(f"the CPU engine takes 1 to at most {MAX_THREADS} threads, got {n}")
    lib = library()
    return lib.tg_set_threads(int(n)) if lib is not None else 1


def use_threads(n: int | None = None) -> int:
    """Compute with ``n`` threads (``--threads``; None: threads.resolve's default): the
    engine's pool and BLAS's. Returns the count."""
    n = threads.resolve(n)
    set_threads(min(n, MAX_THREADS))   # a machine past the pool's bound: BLAS still takes n
    threads.choose(n)
    threads.limit_blas(n)
    return n


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise ToygraphError(f"CPU engine: {what} failed (code {rc})")


def _weight(raw, fmt: str, shape) -> tuple[np.ndarray, int, int, int]:
    """(bytes, row bytes, rows N, row length K) of a 2-D block-format weight, checked."""
    N, K = (int(s) for s in shape)
    data = blocks.as_bytes(np.asarray(raw))
    if data.size != blocks.nbytes(fmt, (N, K)):
        raise GGUFError(f"{fmt} tensor of shape {(N, K)} needs {blocks.nbytes(fmt, (N, K))} "
                        f"bytes, got {data.size}")
    return data, blocks.nbytes(fmt, (1, K)), N, K


def _rows(a: np.ndarray, width: int, what: str) -> np.ndarray:
    if a.dtype != np.float32 or a.ndim != 2 or a.shape[1] != width or a.strides[1] != 4:
        raise ToygraphError(f"CPU engine: {what} must be f32 [rows, {width}] with unit column "
                            f"stride, got {a.dtype} {a.shape} strides {a.strides}")
    return a


def decode(raw, fmt: str, n_elements: int, out: np.ndarray) -> None:
    """Every block of ``raw`` into the contiguous f32 ``out`` (n_elements of them)."""
    elems, size = blocks.BLOCK[fmt]
    _check(library().tg_decode(FORMATS.index(fmt), raw.ctypes.data, out.ctypes.data,
                               n_elements // elems), f"decoding {fmt}")


def decode_rows(raw, fmt: str, shape, ids: np.ndarray, out: np.ndarray) -> None:
    """Rows ``ids`` (int32, each in range: the caller checked) of a [N, K] tensor into the
    contiguous f32 ``out`` [len(ids), K]."""
    data, row_bytes, _, K = _weight(raw, fmt, shape)
    ids = np.ascontiguousarray(ids, np.int32)
    _check(library().tg_decode_rows(FORMATS.index(fmt), data.ctypes.data, row_bytes, K,
                                    ids.ctypes.data, ids.size, out.ctypes.data),
           f"decoding rows of {fmt}")


class Weight:
    """A 2-D block-format weight W [N, K] as the engine's products take it: its bytes,
    format and row size checked once (a step multiplies each weight several times, and
    generation hundreds of times a second, so the per-call path only checks the operands)."""

    def __init__(self, raw, fmt: str, shape, lib=None):
        self.data, self.row_bytes, self.N, self.K = _weight(raw, fmt, shape)
        self.fmt, self.shape = fmt, (self.N, self.K)
        self.lib = lib or library()
        self._args = (FORMATS.index(fmt), self.data.ctypes.data, self.row_bytes, self.N, self.K)
        # TOYGRAPH_CPU_DOT, read when the weight is made: f32 sends a few rows to kernel 2
        self.few_rows_kernel = 2 if environment.get("TOYGRAPH_CPU_DOT") == "f32" else 0
        self._last = None   # matmul_again's operands

    def matmul(self, a: np.ndarray, out: np.ndarray, transposed: bool, kernel: int = 0) -> np.ndarray:
        """out = a . W^T (transposed: a [M, K], out [M, N]) or a . W (a [M, N], out [M, K]);
        ``kernel`` (transposed only) 0 picks by M (up to DOT_MAX_M rows the 8-bit dot
        kernels where built for the format, else the f32 ones; more rows the panels), 1 the
        panels, 2 the f32 dot kernels, 3 the 8-bit ones (an error where there are none);
        ``TOYGRAPH_CPU_DOT=f32`` makes 0 take the f32 ones for a few rows."""
        self._run(self._operands(a, out, transposed, kernel))
        return out

    def matmul_again(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``matmul(x, out, True)`` where x and out are the arrays of this method's last call:
        their checks and addresses are kept (generation multiplies each weight with the same
        buffers every token, and ``x.ctypes.data`` alone costs microseconds)."""
        last = self._last
        if last is None or last[0] is not x or last[1] is not out:
            last = self._last = (x, out, self._operands(x, out, True, 0))
        self._run(last[2])
        return out

    def _operands(self, a: np.ndarray, out: np.ndarray, transposed: bool, kernel: int) -> tuple:
        """tg_matmul's arguments after the weight's own, ``a`` and ``out`` checked."""
        name, a_width, out_width = ("x", self.K, self.N) if transposed else ("g", self.N, self.K)
        if (a.dtype != np.float32 or out.dtype != np.float32 or a.ndim != 2 or out.ndim != 2
                or a.shape[1] != a_width or out.shape[1] != out_width or a.strides[1] != 4
                or out.strides[1] != 4 or out.shape[0] != a.shape[0]):
            _rows(a, a_width, name)
            _rows(out, out_width, "out")
            raise ToygraphError(f"CPU engine: out has {out.shape[0]} rows, {name} {a.shape[0]}")
        if kernel == 0 and transposed and a.shape[0] <= DOT_MAX_M:
            kernel = self.few_rows_kernel
        return (a.ctypes.data, a.strides[0] >> 2, a.shape[0], out.ctypes.data,
                out.strides[0] >> 2, int(transposed), kernel if transposed else 1)

    def _run(self, operands: tuple) -> None:
        rc = self.lib.tg_matmul(*self._args, *operands)
        if rc == 0:
            return
        rows, transposed = operands[2], operands[5]
        if rc == -2:
            raise ToygraphError(f"CPU engine: no 8-bit dot kernel for {self.fmt} {self.shape} "
                                f"with {rows} rows on this CPU (engine.dot_q8() says "
                                f"whether any is built)")
        _check(rc, f"{'x . W^T' if transposed else 'g . W'} ({self.fmt} {self.shape})")


def matmul_nt(x: np.ndarray, raw, fmt: str, shape, out: np.ndarray, kernel: int = 0,
              lib=None) -> np.ndarray:
    """``out`` [M, N] = x [M, K] . W^T for W [N, K] in ``fmt`` blocks. ``kernel`` 0 picks by
    M, 1 forces the panels, 2 the dot kernels; ``lib`` another build (tests)."""
    return Weight(raw, fmt, shape, lib).matmul(x, out, True, kernel)


def matmul_nn(g: np.ndarray, raw, fmt: str, shape, out: np.ndarray, lib=None) -> np.ndarray:
    """``out`` [M, K] = g [M, N] . W for W [N, K] in ``fmt`` blocks (the input gradient);
    ``lib`` another build (tests)."""
    return Weight(raw, fmt, shape, lib).matmul(g, out, False)
