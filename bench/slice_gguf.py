"""Write a smaller GGUF from a big one: the first N transformer blocks, everything else as is.

    python bench/slice_gguf.py IN.gguf OUT.gguf --layers 8

Keeps every non-block tensor (token_embd, output_norm, output, rope tables, ...), the
tensors ``blk.<i>.*`` with i < N, and all metadata, with ``<arch>.block_count`` set to N
(and any per-layer metadata array of length block_count cut to N). Tensor bytes are copied
as they are: quantized tensors stay quantized, nothing is requantized, so the slice's
first N blocks compute exactly what the big model's first N blocks compute.

Why: SmolLM2-135M-Instruct.Q4_1.gguf is 98 MB and does not fit in what travels to the lent
GPU machine (64 MiB); its 8-block slice (~50 MB, most of it the Q8_0 token embedding) does.
The slice is a valid, smaller Llama that toygraph and transformers both load; its losses
are not SmolLM2's, but CUDA vs CPU (and toygraph vs transformers) must still agree on it.

Needs the ``gguf`` package (GGUFReader / GGUFWriter); tested with gguf 0.19.0.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

BLOCK = re.compile(r"^blk\.(\d+)\.")


def _field_value(field):
    """A reader field's Python value (str, number, bool, or a list of them)."""
    if hasattr(field, "contents"):
        return field.contents()
    # older gguf without ReaderField.contents(): rebuild it from parts/data
    import gguf
    vt = field.types[0]
    if vt == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    if vt == gguf.GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    return field.parts[field.data[0]].tolist()[0]


def slice_gguf(src: Path, dst: Path, layers: int, quiet: bool = False) -> dict:
    """Write ``dst`` with the first ``layers`` blocks of ``src``; returns a short summary."""
    import gguf

    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr))
    reader = gguf.GGUFReader(src, "r")
    arch_field = reader.get_field("general.architecture")
    if arch_field is None:
        raise SystemExit(f"{src}: no general.architecture")
    arch = _field_value(arch_field)
    count_key = f"{arch}.block_count"
    count_field = reader.get_field(count_key)
    if count_field is None:
        raise SystemExit(f"{src}: no {count_key}")
    n_old = int(_field_value(count_field))
    if not 1 <= layers <= n_old:
        raise SystemExit(f"--layers {layers}: the model has {n_old} blocks")

    dst.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(dst, arch)
    align = reader.get_field("general.alignment")
    if align is not None:
        writer.data_alignment = int(_field_value(align))

    for field in reader.fields.values():
        name = field.name
        if name == "general.architecture" or name.startswith("GGUF."):
            continue  # the writer adds the architecture; GGUF.* are header pseudo-fields
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        val = _field_value(field)
        if name == count_key:
            val = layers
        elif (sub is not None and sub != gguf.GGUFValueType.STRING and name.startswith(arch + ".")
              and isinstance(val, list) and len(val) == n_old):
            say(f"  per-layer array {name}: keeping the first {layers} of {n_old}")
            val = val[:layers]
        writer.add_key_value(name, val, vtype, sub_type=sub)

    kept, dropped, nbytes = [], 0, 0
    for t in reader.tensors:
        m = BLOCK.match(t.name)
        if m and int(m.group(1)) >= layers:
            dropped += 1
            continue
        # t.data is the tensor's bytes as a numpy view: element-typed (numpy order, the
        # reverse of ggml's t.shape) for f32/f16/..., uint8 [rows, bytes per row] for
        # quantized types, which the writer turns back into the element shape given
        # raw_dtype. Either way the bytes are copied untouched.
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type,
                          tensor_endianess=reader.endianess)
        kept.append((t.name, [int(x) for x in t.shape], t.tensor_type))
        nbytes += int(t.n_bytes)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    # check what was written: same names, ggml shapes, types and bytes as the source
    out = gguf.GGUFReader(dst, "r")
    src_t = {t.name: t for t in reader.tensors}
    got = {t.name: t for t in out.tensors}
    if sorted(got) != sorted(n for n, _, _ in kept):
        raise SystemExit("written tensor set differs from the kept set")
    for name, shape, qtype in kept:
        o = got[name]
        if [int(x) for x in o.shape] != shape or o.tensor_type != qtype:
            raise SystemExit(f"{name}: wrote {list(o.shape)} {o.tensor_type.name}, "
                             f"expected {shape} {qtype.name}")
        if not np.array_equal(np.asarray(o.data).view(np.uint8).ravel(),
                              np.asarray(src_t[name].data).view(np.uint8).ravel()):
            raise SystemExit(f"{name}: bytes differ from the source")
    if int(_field_value(out.get_field(count_key))) != layers:
        raise SystemExit(f"{count_key} not written as {layers}")

    summary = {"arch": arch, "blocks": f"{n_old} -> {layers}", "tensors_kept": len(kept),
               "tensors_dropped": dropped, "tensor_bytes": nbytes,
               "file_bytes": dst.stat().st_size}
    say(f"wrote {dst}: {summary}")
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="input GGUF")
    ap.add_argument("dst", type=Path, help="output GGUF")
    ap.add_argument("--layers", type=int, required=True, help="transformer blocks to keep")
    ap.add_argument("--force", action="store_true", help="overwrite an existing output")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    if a.dst.resolve() == a.src.resolve():
        ap.error("output would overwrite the input")
    if a.dst.exists() and not a.force:
        ap.error(f"{a.dst} exists (--force to overwrite)")
    slice_gguf(a.src, a.dst, a.layers, quiet=a.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
