"""Header fuzzing: damaged GGUF headers end in a one-line GGUFError or a usable model.

Seeded, deterministic mutations of the header + metadata + tensor-index region of tiny
GGUFs (the bytes before the tensor data): single-bit flips, random overwrites, "interesting"
numbers written over the file's own counts, lengths, types, dims and offsets, and
truncations. Each case opens the file with ``GGUFModel`` in a worker process (spawned,
address space capped so a runaway allocation fails instead of swapping the machine) and
then reads every metadata value and dequantizes every tensor. The per-case time limit is
a hang detector with a generous bound, not a speed assertion.
"""
from __future__ import annotations

import multiprocessing
import re
import resource
import traceback
from pathlib import Path

import numpy as np
import pytest

from toygraph.errors import GGUFError
from toygraph.models.model import GGUFModel
from toygraph.gguf.reader import BoundedReader

SEED = 20261123
CASES = {"flip": 110, "overwrite": 60, "number": 100, "cut": 40}   # 310 in all
CASE_LIMIT_S = 30          # a hang detector: a healthy case takes milliseconds
MEMORY_LIMIT = 4 << 30     # worker address space


# --- in the worker ---------------------------------------------------------------------------
def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _mutate(data: bytes, mutation: tuple) -> bytes:
    kind, offset, arg = mutation
    if kind == "cut":
        return data[:offset]
    if kind == "flip":
        return data[:offset] + bytes([data[offset] ^ (1 << arg)]) + data[offset + 1:]
    return data[:offset] + arg + data[offset + len(arg):]        # "write"


def _open_case(base: str, mutation: tuple, path: str) -> tuple[str, str]:
    """("loaded" | "GGUFError" | "unexpected", detail). The last is what the test fails on:
    the catch-all only reports, with its traceback; it never makes a case pass."""
    p = Path(path)
    p.write_bytes(_mutate(Path(base).read_bytes(), mutation))
    try:
        m = GGUFModel(p)
        for key in m.reader.fields:
            m.metadata(key)
        for name in m.tensor_names():
            m.tensor(name).dequantize()
        return "loaded", ""
    except GGUFError as e:
        return "GGUFError", str(e)
    except Exception:  # noqa: BLE001 - classified and reported as a failure below
        return "unexpected", traceback.format_exc()
    finally:
        p.unlink()


# --- cases -----------------------------------------------------------------------------------
def _numbers(path) -> list[tuple[int, int, str]]:
    """(offset, width, label) of the numbers that structure the file: header counts, key
    and string lengths, value and element types, array lengths, scalar values, tensor
    n_dims, dims, types and offsets (array elements past the first are left to flips)."""
    r = BoundedReader(path)
    base = r.data.ctypes.data
    out = []
    for field in list(r.fields.values()) + [t.field for t in r.tensors]:
        is_array = len(field.types) > 1
        for i, part in enumerate(field.parts):
            if part.dtype == np.uint8 and part.size > 1 or (is_array and i > 6):
                continue   # string bytes; array elements after the first
            for k in range(part.size):
                off = part.ctypes.data - base + k * part.itemsize
                out.append((off, part.itemsize, f"{field.name!r} part {i} ({part.dtype})"))
    return out


def _interesting(width: int, old: int, rng) -> int:
    top = (1 << (8 * width)) - 1
    pick = [0, 1, 2, 5, 255, top, top >> 1, (top >> 1) + 1, old + 1, old - 1, old * 2,
            2_300_000_000, 1 << 32, int(rng.integers(0, 1 << 62))]
    return pick[int(rng.integers(len(pick)))] & top


def make_cases(bases: list[Path], seed: int = SEED, scale: int = 1) -> list[tuple[str, tuple, str]]:
    """(base file, mutation, description) for every case, from ``seed`` alone; ``scale``
    multiplies every kind's count (the slow run)."""
    rng = np.random.default_rng(seed)
    info = {b: (BoundedReader(b).data_offset, _numbers(b), b.read_bytes()) for b in bases}
    cases = []
    for kind, n in CASES.items():
        for _ in range(n * scale):
            base = bases[int(rng.integers(len(bases)))]
            region, numbers, data = info[base]
            if kind == "flip":
                off, bit = int(rng.integers(region)), int(rng.integers(8))
                mutation, desc = ("flip", off, bit), f"flip bit {bit} of byte {off}"
            elif kind == "overwrite":
                off = int(rng.integers(region))
                new = rng.integers(0, 256, int(rng.integers(1, 17)), dtype=np.uint8).tobytes()
                mutation, desc = ("write", off, new), f"overwrite bytes {off}.. with {new.hex()}"
            elif kind == "number":
                off, width, label = numbers[int(rng.integers(len(numbers)))]
                old = int.from_bytes(data[off:off + width], "little")
                value = _interesting(width, old, rng)
                mutation = ("write", off, value.to_bytes(width, "little"))
                desc = f"set {label} at byte {off} from {old} to {value}"
            else:
                off = int(rng.integers(region + 1))
                mutation, desc = ("cut", off, None), f"truncate to {off} bytes"
            cases.append((str(base), mutation, f"{base.name}: {desc}"))
    return cases


def run_cases(cases, tmp_path, limit_s: float = CASE_LIMIT_S) -> list[tuple[str, str, str]]:
    """(description, outcome, detail) per case, run two at a time in spawned workers; a case
    past ``limit_s`` is reported as "hang" and ends the run."""
    ctx = multiprocessing.get_context("spawn")
    results = []
    with ctx.Pool(2, initializer=_limit_memory) as pool:
        pending = [(desc, pool.apply_async(_open_case, (base, mutation, str(tmp_path / f"case{i}.gguf"))))
                   for i, (base, mutation, desc) in enumerate(cases)]
        for desc, res in pending:
            try:
                results.append((desc, *res.get(timeout=limit_s)))
            except multiprocessing.TimeoutError:
                results.append((desc, "hang", f"no result within {limit_s} s"))
                break          # the pool is terminated on exit, the hung worker with it
    return results


# --- tests -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bases(tiny_llama, tiny_qwen2):
    return [Path(tiny_llama), Path(tiny_qwen2)]


def test_cases_are_deterministic_and_stay_in_the_header(bases):
    a, b = make_cases(bases), make_cases(bases)
    assert a == b and len(a) == sum(CASES.values())
    for base, (kind, off, _), _ in a:
        assert off <= BoundedReader(base).data_offset


def _check_fuzz(bases, tmp_path, seed: int, scale: int):
    results = run_cases(make_cases(bases, seed, scale), tmp_path)
    bad = [f"  seed {seed} case {i}: {desc}\n    -> {outcome}: {detail}"
           for i, (desc, outcome, detail) in enumerate(results)
           if outcome in ("unexpected", "hang") or (outcome == "GGUFError" and "\n" in detail)]
    assert not bad, "GGUF fuzz cases that did not end cleanly:\n" + "\n".join(bad)
    assert len(results) == sum(CASES.values()) * scale
    outcomes = {o for _, o, _ in results}
    print({o: sum(r[1] == o for r in results) for o in outcomes})
    assert outcomes == {"loaded", "GGUFError"}   # both kinds occur: the fuzz reaches deep


def test_header_fuzz_ends_in_a_clean_error_or_a_usable_model(bases, tmp_path):
    _check_fuzz(bases, tmp_path, SEED, 1)


@pytest.mark.slow
def test_header_fuzz_long(bases, tmp_path):
    """Ten times the cases on another seed (3,100; minutes)."""
    _check_fuzz(bases, tmp_path, SEED + 1, 10)


def _part_offset(reader, name: str, part: int, element: int = 0) -> int:
    """Byte offset of element ``element`` of part ``part`` of a metadata or tensor field."""
    tensors = {t.name: t.field for t in reader.tensors}
    arr = (reader.fields.get(name) or tensors[name]).parts[part]
    return arr.ctypes.data - reader.data.ctypes.data + element * arr.itemsize


def _u64(*values) -> bytes:
    return b"".join(v.to_bytes(8, "little") for v in values)


# (field, part, element, new bytes or None for "old + 1", expected message): one per check
# the reader makes before a loop or an allocation trusts a number from the file.
TARGETED = [
    ("GGUF.kv_count", 0, 0, _u64(1 << 63), r"kv_count \d+ cannot fit in the \d+ bytes left"),
    ("GGUF.tensor_count", 0, 0, _u64(1 << 40), r"tensor_count \d+ cannot fit"),
    ("tokenizer.ggml.tokens", 0, 0, _u64(1 << 40), r"metadata key #\d+: string of \d+ bytes"),
    ("tokenizer.ggml.tokens", 4, 0, _u64(1 << 62),
     r"'tokenizer\.ggml\.tokens': array of STRING with length \d+ cannot fit"),
    ("tokenizer.ggml.tokens", 3, 0, (9).to_bytes(4, "little"),
     r"'tokenizer\.ggml\.tokens': arrays of arrays are not supported"),
    ("token_embd.weight", 2, 0, (5).to_bytes(4, "little"),
     r"'token_embd\.weight': 5 dimensions \(1 to 4 allowed\)"),
    ("token_embd.weight", 3, 1, _u64(0), r"'token_embd\.weight': bad dimensions \[64, 0\]"),
    ("token_embd.weight", 3, 0, _u64(33), r"'token_embd\.weight': rows of 33 elements are not "
                                          r"a whole number of Q8_0 blocks"),
    ("token_embd.weight", 3, 0, _u64(1 << 61, 1 << 61),   # the uint64 product would wrap to 0
     r"'token_embd\.weight' data ends at byte \d+, past the end of the file"),
    ("token_embd.weight", 4, 0, (1000).to_bytes(4, "little"),
     r"'token_embd\.weight' has unknown ggml type id 1000"),
    ("token_embd.weight", 5, 0, None, r"'token_embd\.weight': data offset \d+ is not a "
                                      r"multiple of the alignment \(32\)"),
]


def test_each_bound_the_reader_checks_is_a_one_line_error(tiny_llama, tmp_path):
    reader, data = BoundedReader(tiny_llama), Path(tiny_llama).read_bytes()
    cases = []
    for name, part, element, new, _ in TARGETED:
        off = _part_offset(reader, name, part, element)
        if new is None:
            new = _u64(int.from_bytes(data[off:off + 8], "little") + 1)
        cases.append((str(tiny_llama), ("write", off, new), f"{name} part {part}[{element}] = {new.hex()}"))
    for (desc, outcome, detail), (*_, pattern) in zip(run_cases(cases, tmp_path), TARGETED):
        assert outcome == "GGUFError" and "\n" not in detail, f"{desc}: {outcome}: {detail}"
        assert re.search(pattern, detail), f"{desc}: {detail!r} does not match {pattern!r}"


def test_block_count_corrupted_to_billions_fails_fast(tiny_llama, tmp_path):
    """The issue's case: block_count 2.3e9 made validation build the expected-tensor list
    layer by layer. It must end in a GGUFError naming block_count, within the hang bound."""
    r = BoundedReader(tiny_llama)
    field = r.fields["llama.block_count"]
    off = field.parts[-1].ctypes.data - r.data.ctypes.data
    cases = [(str(tiny_llama), ("write", off, (2_300_000_000).to_bytes(4, "little")),
              "llama.block_count = 2300000000")]
    [(desc, outcome, detail)] = run_cases(cases, tmp_path, limit_s=15)
    assert outcome == "GGUFError" and "block_count" in detail, f"{desc}: {outcome}: {detail}"
