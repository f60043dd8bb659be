"""Compile the CUDA backend's kernel modules ahead, here (NVRTC needs no GPU), into a cubin
cache the GPU session carries, so a device call spends its minutes running, not compiling.

    python bench/precompile.py                          # -> .gpu/kernels.tar.xz, sm_80 + sm_90
    python bench/precompile.py --unpack .gpu/kernels.tar.xz --arch sm_90   # on the device

Every module a session loads is ``backend_source(precision)`` compiled for the device's
arch (cuda/backend.py, driver.load_module); this compiles each precision's module for each
``--arch`` with toygraph.cuda.nvrtc.compile_cubin into a fresh cache, so the entries carry
the keys the device will look up (sha256 of the source, the options and the NVRTC version),
and packs it as a tar.xz (``kernels/<key>.cubin`` + ``kernels/manifest.json``). The cache
only hits where NVRTC has the same major.minor version as here (the manifest records it)
and the kernel sources are this checkout's; elsewhere the session compiles as before.
gpu_session.sh unpacks ``.gpu/kernels.tar.xz`` into its cache when it is there (carry it
with ``.gpu``) and reports how many modules hit.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tarfile
import tempfile
import time
from pathlib import Path


def _modules(archs, precisions):
    """[(arch, precision, source)] a session may load, one per distinct (arch, source):
    bf16 and tf32 compile the same module (both precisions' tensor-core kernels)."""
    import toygraph.cuda  # noqa: F401  (loads every family's CUDA lowering)
    from toygraph.ops.lowering.sources import backend_source
    out, seen = [], set()
    for arch in archs:
        for prec in precisions:
            source = backend_source(prec)
            if (arch, source) not in seen:
                seen.add((arch, source))
                out.append((arch, prec, source))
    return out


def build(archive: Path, archs, precisions) -> dict:
    """Compile every module into a fresh cache and pack its ``kernels/`` into ``archive``
    (tar.xz: the cubins compress ~8x, and the device call carries at most 64 MiB)."""
    saved = os.environ.get("TOYGRAPH_CACHE")
    with tempfile.TemporaryDirectory() as root:
        os.environ["TOYGRAPH_CACHE"] = root      # compile_cubin writes $TOYGRAPH_CACHE/kernels
        try:
            return _build(archive, archs, precisions)
        finally:
            if saved is None:
                os.environ.pop("TOYGRAPH_CACHE", None)
            else:
                os.environ["TOYGRAPH_CACHE"] = saved


def _build(archive: Path, archs, precisions) -> dict:
    from toygraph.cuda import nvrtc
    entries = []
    for arch, prec, source in _modules(archs, precisions):
        t0 = time.perf_counter()
        cubin = nvrtc.compile_cubin(source, arch=arch, name=f"toygraph-{prec}.cu")
        key = nvrtc.cache_key(source, nvrtc.options(arch))
        entries.append({"arch": arch, "precision": prec, "file": f"{key}.cubin",
                        "bytes": len(cubin), "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{arch} {prec}: {len(cubin) / 2**20:.2f} MiB in {entries[-1]['seconds']} s",
              file=sys.stderr)
    manifest = {"nvrtc": "%d.%d" % nvrtc.version(), "entries": entries,
                "cubin_bytes": sum(e["bytes"] for e in entries)}
    (nvrtc.cache_dir() / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:xz", preset=9) as tar:
        tar.add(nvrtc.cache_dir(), arcname="kernels")
    manifest["archive_bytes"] = archive.stat().st_size
    return manifest


def unpack(archive: Path, archs, precisions) -> int:
    """Unpack ``archive`` into this machine's cache ($TOYGRAPH_CACHE/kernels) and say how
    many of the modules this checkout compiles, with this machine's NVRTC, it now holds."""
    from toygraph.cuda import nvrtc
    root = nvrtc.cache_dir().parent
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:xz") as tar:
        tar.extractall(root, filter="data")
    carried = json.loads((nvrtc.cache_dir() / "manifest.json").read_text())
    have = "%d.%d" % nvrtc.version()
    want = _modules(archs, precisions)
    hits = sum((nvrtc.cache_dir() / f"{nvrtc.cache_key(src, nvrtc.options(arch))}.cubin").is_file()
               for arch, _, src in want)
    print(f"{hits} of {len(want)} modules cached for this checkout ({', '.join(archs)}); "
          f"carried for NVRTC {carried['nvrtc']}, this machine's is {have}"
          + ("" if hits == len(want) else ": the rest compile on first use, as without it"))
    return 0 if hits == len(want) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".gpu/kernels.tar.xz", type=Path,
                    help="the archive to write (default .gpu/kernels.tar.xz)")
    ap.add_argument("--unpack", type=Path, help="unpack this archive into $TOYGRAPH_CACHE instead")
    ap.add_argument("--arch", default="sm_80,sm_90")
    ap.add_argument("--precision", default="f32,bf16,tf32")
    a = ap.parse_args(argv)
    from toygraph.precision import PRECISIONS
    precs, archs = a.precision.split(","), a.arch.split(",")
    bad = [p for p in precs if p not in PRECISIONS]
    if bad:
        ap.error(f"--precision: unknown {bad} (one of {', '.join(PRECISIONS)})")
    if a.unpack:
        return unpack(a.unpack, archs, precs)
    m = build(a.out, archs, precs)
    print(f"{len(m['entries'])} modules, {m['cubin_bytes'] / 2**20:.2f} MiB of cubins, "
          f"{m['archive_bytes'] / 2**20:.2f} MiB in {a.out} (NVRTC {m['nvrtc']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
