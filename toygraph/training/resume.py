"""What a checkpoint must agree on before a run may continue from it.

A checkpoint records every option of its run and a fingerprint of the model file. On
resume each option that changes what is trained (the recipe, optimizer, schedule, seed,
batch shape, ...) must be the same, or be listed in ``--allow-change``; those that change
the trainable tensors' shapes can never change. Operational options (where to write, how
often to save, how chatty) may differ freely, and the model, the data and DPO's reference
adapter are compared by content, not by path. Which option is which is each RunConfig
field's ``resume`` rule (run_config.py).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import MISSING
from pathlib import Path

from toygraph.errors import ToygraphError
from toygraph.training.run_config import RunConfig, flag

#: Options that only steer how the run is carried out, never what it computes, or that are
#: compared by content: ``adapter_init`` only sets the starting weights, which the checkpoint
#: replaces (DPO's reference adapter is compared by content, ``reference_hash``); ``data``
#: and ``model`` by hash and fingerprint; ``checkpoint_activations`` gives bit-identical
#: gradients (recompute.py).
OPERATIONAL = frozenset(n for n in RunConfig.names() if RunConfig.meta(n)["resume"] == "free")
#: Options that shape the trainable tensors: a checkpoint cannot be loaded across them.
SHAPE = frozenset(n for n in RunConfig.names() if RunConfig.meta(n)["resume"] == "never")

_HEAD_BYTES = 1 << 20      # the GGUF header and metadata live at the start
_SAMPLES, _SAMPLE_BYTES = 32, 4096


def model_fingerprint(path: str) -> dict:
    """Size + sha256 of the first MiB (header, metadata, tensor index) and of 32 evenly
    spaced 4 KiB samples of the rest: cheap on a multi-GB file, and a different model of
    the same shape differs in its tensor bytes."""
    h = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        h.update(f.read(_HEAD_BYTES))
        if size > _HEAD_BYTES:
            stride = (size - _HEAD_BYTES) // _SAMPLES
            for i in range(_SAMPLES):
                f.seek(_HEAD_BYTES + i * stride)
                h.update(f.read(_SAMPLE_BYTES))
    return {"name": Path(path).name, "size": size, "sha256_sampled": h.hexdigest()}


def model_identity(model) -> dict:
    """What a checkpoint's weights fit: the architecture and every tensor's shape (hashed).
    Another file of the same model (requantized, moved) has the same identity; another
    model does not, and its checkpoint's adapters would be misread on it."""
    from toygraph.adapters.base import tensor_table_sha256
    return {"arch": model.config.arch, "shapes_sha256": tensor_table_sha256(model)}


class ResumeMismatch(ToygraphError):
    """A checkpoint was made under different options than the resumed run asks for."""


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a == b


def _option_defaults() -> dict:
    """Each option's default: what a checkpoint written before that option existed was
    trained with."""
    return {n: RunConfig.default(n) for n in RunConfig.names()
            if RunConfig.default(n) is not MISSING}


def check_resume(saved: dict, now: dict, where: str, allow: set[str]) -> list[str]:
    """Raise ResumeMismatch for the first option that differs and is not allowed to;
    returns the allowed options that did change. ``saved``/``now`` hold ``options``,
    ``data_hash`` and ``model_fingerprint``. An option missing from ``saved`` (the
    checkpoint predates it) counts as its default."""
    old_id, new_id = saved.get("model_identity"), now.get("model_identity")
    if old_id and new_id and old_id != new_id:   # no --allow-change reaches across models
        what = ("another architecture" if old_id["arch"] != new_id["arch"]
                else "the same architecture with other tensor shapes")
        raise ResumeMismatch(f"{where}: the checkpoint was trained on a {old_id['arch']} model; "
                             f"{now['model_fingerprint']['name']} is {new_id['arch']} ({what}), "
                             f"so its weights cannot continue there; start a new run")
    changed = []
    old_opts, new_opts = {**_option_defaults(), **saved.get("options", {})}, now["options"]
    pairs = [(k, old_opts.get(k), new_opts.get(k)) for k in new_opts if k not in OPERATIONAL]
    pairs.append(("model", saved.get("model_fingerprint"), now["model_fingerprint"]))
    pairs.append(("data", saved.get("data_hash"), now["data_hash"]))
    # DPO's reference model is base + the --adapter-init adapter: the path may change,
    # the adapter may not (its content is compared, like the data's).
    pairs.append(("adapter_init", saved.get("reference_hash"), now.get("reference_hash")))
    # a change no --allow-change can permit is named first: it is the one that decides
    for name, old, new in sorted(pairs, key=lambda p: p[0] not in SHAPE):
        if _same(old, new):
            continue
        if name in SHAPE or name not in allow:
            hint = ("it shapes the trainable tensors" if name in SHAPE
                    else f"pass --allow-change {name} if that is meant")
            raise ResumeMismatch(f"{where}: {flag(name)} was {_show(name, old)} in the checkpoint, "
                                 f"now {_show(name, new)}; {hint}")
        changed.append(name)
    return changed


def _show(name: str, value) -> str:
    if name == "model" and isinstance(value, dict):
        return f"{value.get('name')} ({value.get('size')} bytes, {str(value.get('sha256_sampled'))[:12]})"
    if name == "data" and isinstance(value, str):
        return f"data with sha256 {value[:12]}"
    if name == "adapter_init":
        return "no adapter" if value is None else f"an adapter with sha256 {value[:12]}"
    return repr(value)
