"""Merge a LoRA adapter into its base GGUF and write one self-contained GGUF.

>>> export_merged("SmolLM2-135M-Instruct.Q4_1.gguf", "runs/demo", "merged.gguf",
...               out_type="q8_0")                                      # doctest: +SKIP

Each weight the adapter targets becomes ``W + (alpha / rank) * B @ A``, computed in f32
from the dequantized base and written in ``out_type``. The adapter is loaded in the GGUF
row order (``adapters.load_peft`` converts q/k rows with ``hf_row_order``), so the sum is
taken in the layout the file stores. Every other tensor is copied byte for byte in its
own block type, and every metadata key (tokenizer, chat template, ...) is carried over,
except that the chat template becomes the one the adapter was trained with (recorded in a
run's adapter, or ``--template``) where that differs from the base's — a base model
trained with the Alpaca default gets it written in, so the merged file prompts as
training did; ``general.name`` gets a ``+ merged`` suffix and ``toygraph.merged_adapter.*``
records which adapter went in, by names and digests only (``source``: the run directory's
or adapter file's name; ``base``: the base GGUF's file name; ``sha256``: the adapter's
weights), never a path: a merged file is meant to be shared. Which tensors are merged comes from the adapter's own names, so
nothing here knows one architecture's tensor names.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from toygraph.adapters.base import check_base
from toygraph.adapters.experts import per_base_tensor
from toygraph.adapters.files import (WEIGHTS_FILE, PeftAdapter, adapter_template,
                                     load_gguf_adapter, read_peft)
from toygraph.atomic import atomic_write, check_replaceable
from toygraph.errors import DataError
from toygraph.gguf.templates import bos_first, shared_name
from toygraph.models.model import GGUFModel

OUT_TYPES = ("f32", "f16", "bf16", "q8_0")
PROVENANCE = "toygraph.merged_adapter"


#: What ``--adapter`` may name, in eval, generate, chat and export alike (read_adapter).
ADAPTER_FORMS = "a run, checkpoint or PEFT directory, or a llama.cpp adapter .gguf file"


def read_adapter(adapter, cfg) -> tuple[PeftAdapter, Path]:
    """(the adapter, the file whose bytes identify it) of ``--adapter``: a run/PEFT
    directory or a llama.cpp ``.gguf`` adapter file (ADAPTER_FORMS)."""
    adapter = Path(adapter)
    if adapter.is_file() and adapter.suffix == ".gguf":
        lora, rank, alpha, targets = load_gguf_adapter(adapter, cfg)
        return PeftAdapter(lora, rank, alpha, targets), adapter
    if not adapter.is_dir():
        raise DataError(f"--adapter {adapter}: no such run directory or .gguf adapter file")
    return read_peft(adapter, cfg), adapter / WEIGHTS_FILE


def load_adapter(adapter, cfg) -> tuple[dict, int, float, float, Path]:
    """An adapter given as a run/PEFT directory or a llama.cpp ``.gguf`` adapter file:
    (lora in GGUF row order, DoRA's (A, B, m) included, rank, alpha, the scale of B A
    (alpha / rank, rsLoRA's alpha / sqrt(rank)), the file whose bytes identify it)."""
    a, source = read_adapter(adapter, cfg)
    return a.lora, a.rank, a.alpha, a.scaling, source


def refuse_merged_twice(model, adapter_file: Path, allow: bool = False) -> None:
    """A DataError when ``model`` (a GGUF this module wrote) already has the adapter whose
    weights are ``adapter_file`` merged in, by its ``toygraph.merged_adapter.sha256``:
    applying it again would add its update twice. ``allow`` (--allow-merged) lets it be."""
    merged = model.metadata(f"{PROVENANCE}.sha256")
    if allow or merged is None or not Path(adapter_file).is_file():
        return
    if hashlib.sha256(Path(adapter_file).read_bytes()).hexdigest() == merged:
        raise DataError(f"{model.path} already has the adapter {adapter_file} merged in "
                        f"({PROVENANCE}.sha256); applying it again would add its update twice "
                        f"(pass --allow-merged if that is meant)")


def merged_weight(base: np.ndarray, a: np.ndarray, b: np.ndarray, scaling: float,
                  magnitude: np.ndarray | None = None) -> np.ndarray:
    """``base + scaling * b @ a`` in f32 (numpy shapes: base [n_out, n_in], a [r, n_in],
    b [n_out, r], or an expert stack's [E, ...] of each, merged per expert); with DoRA's ``magnitude`` [n_out], each row of that is rescaled to
    norm m (PEFT's merge: W' = m / ||W + s B A||_row * (W + s B A))."""
    delta = b.astype(np.float32) @ a.astype(np.float32)
    w = (base.astype(np.float32) + np.float32(scaling) * delta).astype(np.float32)
    if magnitude is not None:
        w = w * (magnitude.astype(np.float32) / np.linalg.norm(w, axis=1))[:, None]
    return w


def encode_weight(w: np.ndarray, out_type: str, name: str):
    """(array to write, ggml type) for a float32 weight in ``out_type``; q8_0 and bf16
    through gguf-py's own quantizer, so the bytes are what llama.cpp's tools produce."""
    import gguf
    import gguf.quants

    t = gguf.GGMLQuantizationType[out_type.upper()]
    if out_type == "f32":
        return np.ascontiguousarray(w, np.float32), t
    if out_type == "f16":
        return w.astype(np.float16), t
    block = gguf.GGML_QUANT_SIZES[t][0]
    if w.shape[-1] % block:
        raise DataError(f"{name}: row length {w.shape[-1]} is not a multiple of the {out_type} "
                        f"block ({block}); choose --type f16 or f32")
    return gguf.quants.quantize(w, t), t


def _merged_tensors(model: GGUFModel, lora: dict, scaling: float, out_type: str,
                    progress=None) -> dict:
    merged = {}
    lora = per_base_tensor(lora)   # the shared gate/up expert adapter: each tensor its half
    for i, (name, (a, b, *m)) in enumerate(lora.items()):
        if progress is not None:
            progress(i, len(lora))
        if not model.has(name):
            raise DataError(f"{model.path}: the adapter targets {name!r}, which the model lacks")
        w = merged_weight(model.tensor(name).dequantize(), a, b, scaling, *m)
        if not np.isfinite(w).all():   # finite adapter values whose product overflows f32
            raise DataError(f"{name}: the merged weight (base + {scaling:g} B A) is not finite; "
                            "the adapter's values are too large to be a trained LoRA")
        merged[name] = encode_weight(w, out_type, name)
    return merged


def _copy_metadata(reader, writer, skip: set[str]) -> None:
    """Every key-value pair except those GGUFWriter writes itself (as gguf-py's
    gguf_new_metadata script does), in the original value types."""
    import gguf

    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in skip \
                or field.name == gguf.Keys.General.ARCHITECTURE:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)


def export_merged(model_path, adapter_dir, out_path, out_type: str = "f16",
                  template: str | None = None, allow_merged: bool = False,
                  progress=None, other_base: bool = False) -> Path:
    """Write ``out_path``: the GGUF at ``model_path`` with the LoRA adapter ``adapter_dir``
    (run, checkpoint or PEFT directory, or a llama.cpp adapter ``.gguf`` file) merged into
    its target weights, stored as ``out_type`` (f32, f16, bf16 or q8_0), with the chat
    template ``template`` (a name or Jinja file; None: the one the adapter recorded, else
    the base's). Returns the path; the file appears atomically (temp file + rename). An
    adapter that records another base is refused unless ``other_base`` (adapters/base.py)."""
    import gguf

    from toygraph.gguf.tokenizer import Tokenizer

    if out_type not in OUT_TYPES:
        raise DataError(f"--type {out_type!r}: choose one of {', '.join(OUT_TYPES)}")
    check_replaceable(out_path, "--out")   # refused before minutes of merging
    if Path(out_path).resolve() == Path(model_path).resolve():
        raise DataError(f"--out {out_path}: would overwrite the base model; choose another path")
    model = GGUFModel(model_path)
    lora, rank, alpha, scaling, source = load_adapter(adapter_dir, model.config)
    refuse_merged_twice(model, source, allow_merged)
    check_base(adapter_dir, model, other_base)
    tok = Tokenizer.from_gguf(model.reader, source=str(model_path))
    trained = adapter_template(adapter_dir) if Path(adapter_dir).is_dir() else None
    if template is not None:
        tok.use_template(template)
    elif trained is not None:
        tok.use_template(*trained)
    # Written in only when known: --template, or the template the adapter recorded. An
    # adapter of another tool says nothing, and the base's metadata is then kept as it is.
    known = template is not None or trained is not None
    chat_template = (tok.chat_template if known and tok.chat_template != tok.file_chat_template
                     else None)
    template_name = (tok.template_name if chat_template
                     else "gguf" if tok.file_chat_template else "none")
    if chat_template:
        chat_template = bos_first(chat_template, tok)
    merged = _merged_tensors(model, lora, scaling, out_type, progress)
    reader, out_path = model.reader, Path(out_path)
    name = model.metadata("general.name") or Path(model_path).stem
    # names, not paths: the merged file is meant to be shared, and a path names the machine
    adapter_name = Path(adapter_dir).resolve().name   # the run's directory, or the .gguf file

    def write(tmp):
        w = gguf.GGUFWriter(tmp, model.config.arch, endianess=reader.endianess)
        w.data_alignment = int(model.metadata("general.alignment", w.data_alignment))
        _copy_metadata(reader, w, skip={"general.name"} | ({"tokenizer.chat_template"}
                                                           if chat_template else set()))
        w.add_string("general.name", f"{name} + {adapter_name} (merged)")
        if chat_template:   # the template the adapter was trained with, not the base's
            w.add_chat_template(chat_template)
        w.add_string(f"{PROVENANCE}.template", shared_name(template_name))
        w.add_string(f"{PROVENANCE}.source", adapter_name)
        w.add_string(f"{PROVENANCE}.base", Path(model_path).name)
        w.add_string(f"{PROVENANCE}.sha256", hashlib.sha256(source.read_bytes()).hexdigest())
        w.add_uint32(f"{PROVENANCE}.rank", rank)
        w.add_float32(f"{PROVENANCE}.alpha", alpha)
        w.add_string(f"{PROVENANCE}.type", out_type)
        w.add_array(f"{PROVENANCE}.tensors", sorted(merged))
        for t in reader.tensors:
            data, qt = merged.get(t.name, (t.data, t.tensor_type))
            w.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in reader.tensors:  # merged arrays are native-endian, copies as the file is
            if t.name in merged:
                w.write_tensor_data(merged[t.name][0])
            else:
                w.write_tensor_data(t.data, tensor_endianess=reader.endianess)
        w.close()

    out_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out_path, write)
    return out_path

