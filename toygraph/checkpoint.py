"""Checkpoints and adapter files of a training run, each written atomically.

A checkpoint directory holds ``trainable.safetensors`` (every trainable tensor by graph
name), ``optimizer.safetensors`` (AdamW moments), ``state.json`` (step, best validation
loss, data hash, config) and, for LoRA, the PEFT adapter files, so a checkpoint can be
evaluated or used as ``--adapter-init`` directly.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .errors import DataError


# --- checkpoints -------------------------------------------------------------------------------
def save_checkpoint(dest: Path, recipe, state: dict, lora_meta: dict | None):
    """Write trainable weights, AdamW moments and loop state into ``dest`` atomically:
    everything goes to a temp dir beside it, which then replaces ``dest`` in one rename."""
    from safetensors.numpy import save_file
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        save_file({k: np.ascontiguousarray(v, np.float32) for k, v in recipe.trainable().items()},
                  str(tmp / "trainable.safetensors"))
        save_file({k: np.ascontiguousarray(v, np.float32) for k, v in recipe.optimizer_state().items()},
                  str(tmp / "optimizer.safetensors"))
        if lora_meta is not None:
            write_adapter(tmp, recipe, lora_meta, gguf_too=False)
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        old = dest.with_name(dest.name + ".old")
        if dest.exists():
            os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_checkpoint(path: Path) -> tuple[dict, dict, dict]:
    from safetensors.numpy import load_file
    path = Path(path)
    if (path / "checkpoints").is_dir():  # a run directory: take its latest checkpoint
        found = sorted((path / "checkpoints").glob("step-*"))
        if not found:
            raise DataError(f"{path}: no checkpoints to resume from")
        path = found[-1]
    for name in ("state.json", "trainable.safetensors", "optimizer.safetensors"):
        if not (path / name).is_file():
            raise DataError(f"{path}: not a checkpoint (missing {name})")
    try:
        state = json.loads((path / "state.json").read_text())
        return (state, load_file(str(path / "trainable.safetensors")),
                load_file(str(path / "optimizer.safetensors")))
    except (ValueError, OSError) as e:
        raise DataError(f"{path}: unreadable checkpoint: {e}") from None


def _lora_arrays(recipe) -> dict:
    vals = recipe.trainable()
    return {name: (vals[a.name], vals[b.name]) for name, (a, b) in recipe.net.lora.items()}


def write_adapter(dest: Path, recipe, meta: dict, gguf_too: bool = True):
    from .adapters import save_gguf_adapter, save_peft
    lora = _lora_arrays(recipe)
    save_peft(dest, lora, recipe.cfg, rank=meta["rank"], alpha=meta["alpha"],
              targets=meta["targets"], base_model_name=meta["base"])
    if gguf_too:
        save_gguf_adapter(dest / "adapter.gguf", lora, recipe.cfg, alpha=meta["alpha"],
                          base_arch=recipe.cfg.arch)
