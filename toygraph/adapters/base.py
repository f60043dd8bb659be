"""Which base model an adapter was trained on, and the check that it is applied to that one.

A run records its base in the adapters it writes (``toygraph.base``: a JSON string in the
PEFT weights' safetensors metadata and a string key of ``adapter.gguf``):

- ``name``: the base's file name (never its path: adapters are shared);
- ``arch``: its architecture;
- ``tensors_sha256``: a digest of its tensor table (every name and shape), as a
  checkpoint's model identity (training/resume.py model_identity) has it;
- ``weights_sha256``: a digest of the values of its 1-D tensors (norms, biases). Every
  quantization keeps these in f32, so another quantization of the same model has the same
  digest, while a base and its instruct model (the same table, other weights) differ.

eval, generate, chat, export and ``--adapter-init`` compare the record with the model given
(:func:`check_base`): another base is refused in one line, or applied with ``--other-base``
and a one-line warning. An adapter without a record (another tool's, or older) is not
checked: there is nothing to compare.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np

from toygraph.adapters.files import BASE_METADATA, WEIGHTS_FILE
from toygraph.bounded import printable
from toygraph.errors import DataError

logger = logging.getLogger(__name__)



def tensor_table_sha256(model) -> str:
    """A digest of ``model``'s tensor names and shapes."""
    shapes = sorted((name, tuple(model.tensor(name).shape)) for name in model.tensor_names())
    return hashlib.sha256(repr(shapes).encode()).hexdigest()


def weights_sha256(model) -> str:
    """A digest of the values of ``model``'s 1-D tensors, as f32, in name order."""
    h = hashlib.sha256()
    for name in sorted(model.tensor_names()):
        t = model.tensor(name)
        if len(t.shape) == 1:
            h.update(name.encode() + b"\0")
            h.update(np.ascontiguousarray(t.dequantize(), np.float32).tobytes())
    return h.hexdigest()


def base_record(model) -> dict:
    """What an adapter trained on ``model`` (a GGUFModel) records of it."""
    return {"name": Path(model.path).name, "arch": model.config.arch,
            "tensors_sha256": tensor_table_sha256(model), "weights_sha256": weights_sha256(model)}


def recorded_base(adapter) -> dict | None:
    """The record of the adapter at ``adapter`` (a run, checkpoint or PEFT directory, or an
    ``adapter.gguf``), or None when it has none."""
    adapter = Path(adapter)
    try:
        if adapter.is_dir():
            from safetensors import safe_open
            with safe_open(str(adapter / WEIGHTS_FILE), "np") as f:
                text = (f.metadata() or {}).get(BASE_METADATA)
        else:
            from toygraph.gguf.reader import BoundedReader
            field = BoundedReader(str(adapter), "r").get_field(BASE_METADATA)
            text = None if field is None else field.contents()
    except Exception:   # unreadable: the adapter's own reader says why, in its own words
        return None
    try:
        record = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        record = None
    return record if isinstance(record, dict) else None


def base_difference(record: dict, model) -> str | None:
    """How ``model`` differs from the base ``record`` names (the first difference), or
    None when it is that base."""
    if record.get("arch") != model.config.arch:
        return f"is a {model.config.arch} model, not {printable(str(record.get('arch')))[:80]}"
    if record.get("tensors_sha256") != tensor_table_sha256(model):
        return "has another tensor table (its tensors' names or shapes differ)"
    if record.get("weights_sha256") != weights_sha256(model):
        return ("has other weights (its norms and biases differ, as a base model's and its "
                "instruct model's do)")
    return None


def check_base(adapter, model, other_base: bool = False) -> None:
    """Refuse (DataError) to apply ``adapter`` to ``model`` when the adapter records another
    base; with ``other_base`` (--other-base), warn in one line instead."""
    record = recorded_base(adapter)
    if record is None:
        return
    why = base_difference(record, model)
    if why is None:
        return
    said = (f"{adapter}: the adapter was trained on {printable(str(record.get('name')))[:200]}; "
            f"{Path(model.path).name} {why}")
    if not other_base:
        raise DataError(f"{said}; pass --other-base to apply it anyway")
    logger.warning("%s; applying it anyway (--other-base)", said)
