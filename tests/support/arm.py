"""The CPU engine on ARM without an ARM machine: engine.py's source plus a small driver
(arm_driver.cpp) built by Debian's aarch64 cross compiler (g++-aarch64-linux-gnu) as a
static program and run under qemu-user (qemu-aarch64), once per target:

- ``sdot``: ARMv8.2 with the dot-product extension (Apple silicon, Graviton 2 and later,
  a Raspberry Pi 5): the 8-bit kernels' sdot;
- ``neon``: plain ARMv8 (a Raspberry Pi 4): the same kernels by smull and pairwise adds.

>>> arm = Arm("sdot")                                         # doctest: +SKIP
>>> arm.matmul(raw, "q4_k", (N, K), x, kernel=3)              # doctest: +SKIP

Every request of one call goes through one qemu process. Programs are built into the
system's temporary folder, keyed by the source's hash.
"""
from __future__ import annotations

import hashlib
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from toygraph.cpu import engine
from toygraph.gguf import blocks

CXX, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"
TARGETS = {"sdot": "-march=armv8.2-a+dotprod", "neon": "-march=armv8-a"}
#: engine.py's flags but a static program instead of a shared library, and the target's march
FLAGS = ("-O3", "-std=c++17", "-static", "-pthread", "-ffp-contract=off", "-fno-fast-math")
DRIVER = Path(__file__).with_name("arm_driver.cpp")


def missing() -> str | None:
    """Why the ARM build cannot run here (a one-line reason), or None."""
    gone = [tool for tool in (CXX, QEMU) if shutil.which(tool) is None]
    if gone:
        return (f"no {' and no '.join(gone)} (Debian's g++-aarch64-linux-gnu and qemu-user; "
                ".ci/run installs them)")
    return None


def build(target: str, source: str | None = None) -> Path:
    """The driver program for ``target`` (TARGETS), from ``source`` (default: the engine's)."""
    text = (source or engine.source()) + "\n" + DRIVER.read_text()
    key = hashlib.sha256((text + TARGETS[target] + " ".join(FLAGS)).encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / "toygraph-arm"
    folder.mkdir(exist_ok=True)
    exe = folder / f"engine-{target}-{key}"
    if not exe.exists():
        src = folder / f"engine-{key}.cpp"
        src.write_text(text)
        part = exe.with_suffix(".part")
        done = subprocess.run([CXX, *FLAGS, TARGETS[target], str(src), "-o", str(part)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{CXX} {TARGETS[target]} failed:\n{done.stderr[-3000:]}")
        part.replace(exe)
    return exe


class Arm:
    """Requests to the engine built for ``target``, answered under qemu."""

    def __init__(self, target: str, source: str | None = None):
        self.exe = build(target, source)

    def _run(self, request: bytes) -> bytes:
        done = subprocess.run([QEMU, str(self.exe)], input=request, capture_output=True,
                              timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{self.exe.name} exited {done.returncode}: "
                               f"{done.stderr.decode(errors='replace')[-500:]}")
        return done.stdout

    def info(self) -> tuple[str, bool]:
        """(tg_simd(), whether the 8-bit kernels are built)."""
        out = self._run(struct.pack("<q", 0))
        (q8,) = struct.unpack("<q", out[:8])
        return out[8:].split(b"\0")[0].decode(), bool(q8)

    def decode(self, raw: np.ndarray, fmt: str) -> np.ndarray:
        """The blocks ``raw`` decoded by the engine (tg_decode), flat f32."""
        qk, size = blocks.BLOCK[fmt]
        data = np.ascontiguousarray(raw, np.uint8).tobytes()
        n = len(data) // size
        out = self._run(struct.pack("<3q", 1, engine.FORMATS.index(fmt), n) + data)
        return np.frombuffer(out, np.float32).copy()

    def matmuls(self, cases: list[tuple]) -> list[np.ndarray]:
        """Each (raw, fmt, (N, K), a, transposed, kernel) through tg_matmul in one run:
        c = a W^T (transposed) or a W; raises on a status other than 0."""
        request, shapes = b"", []
        for raw, fmt, (N, K), a, transposed, kernel in cases:
            M = a.shape[0]
            request += struct.pack("<7q", 2, engine.FORMATS.index(fmt), N, K, M, int(transposed),
                                   kernel)
            request += np.ascontiguousarray(raw, np.uint8).tobytes()
            request += np.ascontiguousarray(a, np.float32).tobytes()
            shapes.append((M, N if transposed else K))
        out, at, results = self._run(request), 0, []
        for M, width in shapes:
            (status,) = struct.unpack("<q", out[at:at + 8])
            if status != 0:
                raise RuntimeError(f"tg_matmul returned {status}")
            at += 8
            results.append(np.frombuffer(out[at:at + 4 * M * width], np.float32).reshape(M, width).copy())
            at += 4 * M * width
        return results
