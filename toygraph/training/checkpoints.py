"""Checkpoints and adapter files of a training run, each written atomically and verifiable.

A checkpoint directory (``checkpoints/step-N/`` or ``best/``) holds
``trainable.safetensors`` (every trainable tensor by graph name), ``optimizer.safetensors``
(AdamW moments), ``state.json`` (the loop state: step, best validation loss, options,
data hash, model fingerprint) and, for LoRA, the PEFT adapter files, so a checkpoint can
be evaluated or used as ``--adapter-init`` directly. ``manifest.json`` (size and sha256 of
every other file) is written last; the directory is built beside its destination and
renamed into place, so a checkpoint either verifies completely or is skipped on resume.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np

from toygraph.atomic import file_sha256, temp_dir
from toygraph.bounded import excerpt, load_json
from toygraph.errors import DataError
from toygraph.training.run_dir import io_error

MANIFEST = "manifest.json"
REQUIRED = ("state.json", "trainable.safetensors", "optimizer.safetensors")
#: state.json holds the loop state and options (kilobytes; a bound for a hostile one).
STATE_BYTES = 64 << 20
_STEP_DIR = re.compile(r"step-(\d+)")


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"  # six digits for a tidy listing; ordering is numeric anyway


# --- writing -----------------------------------------------------------------------------------
def _write_manifest(folder: Path):
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST)
    doc = {p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)} for p in files}
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, folder / MANIFEST)


def save_checkpoint(dest: Path, weights: dict, moments: dict, state: dict,
                    write_extra=None, intact: str = ""):
    """Write a verifiable checkpoint into ``dest`` atomically: everything goes to a temp
    dir beside it (``write_extra(tmp)`` adds e.g. adapter files), the manifest last, then
    one rename. A filesystem error becomes a one-line RunError naming ``dest`` and
    ``intact`` (what earlier state survives); ``dest`` is then untouched."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file
    tmp = None
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_dir(dest.parent, prefix=f".{dest.name}.")
        save_file({k: np.ascontiguousarray(v, np.float32) for k, v in weights.items()},
                  str(tmp / "trainable.safetensors"))
        save_file({k: np.ascontiguousarray(v, np.float32) for k, v in moments.items()},
                  str(tmp / "optimizer.safetensors"))
        if write_extra is not None:
            write_extra(tmp)
        (tmp / "state.json").write_text(json.dumps(state, indent=1, allow_nan=False))
        _write_manifest(tmp)
        old = dest.with_name(dest.name + ".old")
        shutil.rmtree(old, ignore_errors=True)  # left by a process killed between the renames
        if dest.exists():
            os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    except (OSError, SafetensorError) as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        err = e if isinstance(e, OSError) else OSError(0, str(e))
        raise io_error(f"checkpoint {dest}", err, intact) from None
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def restore_swapped(dest: Path):
    """Put ``dest.old`` back when a process died between the two renames that replace
    ``dest`` (only ``best/`` is ever replaced)."""
    old = dest.with_name(dest.name + ".old")
    if old.is_dir() and not dest.exists():
        os.replace(old, dest)


# --- finding and verifying ---------------------------------------------------------------------
def list_checkpoints(run: Path) -> list[tuple[int, Path]]:
    """(step, path) of every ``checkpoints/step-N`` in ``run``, oldest first, by number."""
    folder = Path(run) / "checkpoints"
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir()
             if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))]
    return sorted(found)


def verify_checkpoint(path: Path) -> str | None:
    """None when every file the manifest lists has its size and sha256; else the reason."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        missing = [n for n in REQUIRED if not (path / n).is_file()]
        return f"missing {missing[0]}" if missing else f"no {MANIFEST} (incomplete write)"
    try:   # bounded: toygraph/bounded.py
        doc = load_json(manifest, max_bytes=1 << 20)
    except DataError as e:
        return f"unreadable {MANIFEST}: {e}"
    if not isinstance(doc, dict) or not set(REQUIRED) <= set(doc):
        return f"{MANIFEST} does not list {', '.join(REQUIRED)}"
    for name, want in doc.items():
        if not isinstance(want, dict):
            return f"{MANIFEST} gives {excerpt(name)} no size and sha256"
        f = path / name
        if not f.is_file():
            return f"missing {name}"
        if f.stat().st_size != want.get("size"):
            return f"{name} has {f.stat().st_size} bytes, the manifest says {want.get('size')}"
        if file_sha256(f) != want.get("sha256"):
            return f"{name} does not match its sha256 in the manifest"
    return None


def find_resumable(path: Path) -> tuple[Path, list[tuple[Path, str]]]:
    """The checkpoint to resume from: ``path`` itself, or a run directory's newest
    checkpoint that verifies. Returns it with the (path, reason) of those skipped."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        skipped = []
        for _, ck in reversed(list_checkpoints(path)):
            reason = verify_checkpoint(ck)
            if reason is None:
                return ck, skipped
            skipped.append((ck, reason))
        why = "; ".join(f"{p.name}: {r}" for p, r in skipped) or "none saved"
        raise DataError(f"{path}: no checkpoint to resume from ({why})")
    if not path.is_dir():
        raise DataError(f"{path}: not a checkpoint or run directory")
    reason = verify_checkpoint(path)
    if reason is not None:
        raise DataError(f"{path}: not a checkpoint ({reason})")
    return path, []


def load_checkpoint(path: Path) -> tuple[dict, dict, dict]:
    """(state, trainable weights, optimizer moments) of a verified checkpoint directory."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file
    try:
        state = load_json(path / "state.json", max_bytes=STATE_BYTES)
        return (state, load_file(str(path / "trainable.safetensors")),
                load_file(str(path / "optimizer.safetensors")))
    except (ValueError, OSError, SafetensorError, DataError) as e:
        raise DataError(f"{path}: unreadable checkpoint: {e}") from None


def checkpoint_run_id(path: Path) -> str | None:
    """The run id a checkpoint's state records (toygraph/training/lineage.py); None for a
    checkpoint written before runs had ids, or one whose state cannot be read."""
    try:
        run_id = json.loads((Path(path) / "state.json").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return run_id if isinstance(run_id, str) else None


def prune_checkpoints(run: Path, keep: int, run_id: str | None = None) -> list[Path]:
    """Delete all but the ``keep`` newest step checkpoints of run ``run_id`` (``best/``
    lives apart and the newest is the final one, so both stay) and leftovers of interrupted
    writes. A checkpoint of another run (its state names another run id) is never deleted;
    one with no run id predates them and counts as the directory's own."""
    folder = Path(run) / "checkpoints"
    ours = [p for _, p in list_checkpoints(run)
            if run_id is None or checkpoint_run_id(p) in (run_id, None)]
    gone = ours[:-keep] if keep > 0 else []
    if folder.is_dir():
        gone += [p for p in folder.iterdir() if p.name.startswith(".") or p.name.endswith(".old")]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


# --- adapters ----------------------------------------------------------------------------------
def lora_arrays(recipe, values: dict | None = None) -> dict:
    """{GGUF weight name: (A, B)} of a LoRA recipe, from ``values`` or the session."""
    vals = values if values is not None else recipe.trainable()
    mags = recipe.net.magnitudes  # DoRA: (A, B, m)
    return {name: (vals[a.name], vals[b.name], *([vals[mags[name].name]] if name in mags else []))
            for name, (a, b) in recipe.net.lora.items()}


def write_adapter(dest: Path, recipe, meta: dict, gguf_too: bool = True, values: dict | None = None):
    """The PEFT adapter files (and llama.cpp's ``adapter.gguf``) of a LoRA recipe."""
    from toygraph.adapters.files import save_gguf_adapter, save_peft
    lora = lora_arrays(recipe, values)
    save_peft(dest, lora, recipe.model_cfg, rank=meta["rank"], alpha=meta["alpha"],
              targets=meta["targets"], base_model_name=meta["base"],
              template=meta.get("template"), rslora=meta.get("rslora", False),
              lora_dropout=meta.get("lora_dropout", 0.0), base=meta.get("base_record"))
    # llama.cpp has no DoRA: its adapter.gguf is left out (the merged export serves it)
    if gguf_too and not recipe.net.magnitudes:
        save_gguf_adapter(dest / "adapter.gguf", lora, recipe.model_cfg, alpha=meta["alpha"],
                          base_arch=recipe.model_cfg.arch, rslora=meta.get("rslora", False),
                          base=meta.get("base_record"))


def write_final(folder: Path, recipe, lora_meta: dict | None, values: dict | None = None):
    """The run's result files into ``folder`` (a temp folder that result.publish moves to
    the top of the run directory): the adapter (LoRA) or ``weights.safetensors``, of
    ``values`` (a checkpoint's weights: best/'s) or else the recipe's current weights. A
    safetensors failure is an OSError like any other write's."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file
    try:
        if lora_meta is not None:
            write_adapter(folder, recipe, lora_meta, values=values)
        else:
            save_file(values if values is not None else recipe.trainable(),
                      str(folder / "weights.safetensors"))
    except SafetensorError as e:
        raise OSError(0, str(e)) from None
