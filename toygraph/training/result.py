"""A completed run's result at the top of its run directory: written all at once or not at
all, and a finished run's result kept safe while an extension of it trains.

The top level (the adapter files and ``adapter.gguf`` with its ``Modelfile``, or
``weights.safetensors``) is written into a temp folder, then moved into place file by file
with the result file itself (``adapter_model.safetensors`` / ``weights.safetensors``) last:
the top level is complete exactly when that file is there (``result_complete``). Whatever
stops the writing (a signal, a full disk, a MemoryError, a model file gone for the
Modelfile's template) takes back what was moved, so a resume of the run, which looks for the
result file, writes it again from the final checkpoint.

Extending a finished run (``--resume`` with more steps) first moves its result to
``.previous-result/`` (the result file first, so the top level is at once no longer
complete). The extension's own result replaces it; an extension that ends before its final
checkpoint (an error, a signal, a divergence) moves it back (the result file last), and a
run killed in between finds it there at its next start (``settle_result``).
"""
from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

from toygraph.adapters.modelfile import ollama_create, write_modelfile
from toygraph.atomic import check_replaceable, temp_dir
from toygraph.bounded import terminal_text
from toygraph.training.checkpoints import load_checkpoint, step_dir_name, write_final
from toygraph.training.run_dir import FINAL_ARTIFACTS, RESULT_ASIDE, RESULT_FILES, io_error


def result_complete(out: Path) -> bool:
    """Whether ``out``'s top level holds a complete result (its result file is moved last)."""
    return any((Path(out) / name).is_file() for name in RESULT_FILES)


def _result_last(names) -> list[str]:
    return sorted(names, key=lambda n: (n in RESULT_FILES, n))


def _move_all(src: Path, dest: Path, names: list[str]) -> None:
    for name in names:
        os.replace(src / name, dest / name)


def publish(tmp: Path, out: Path) -> None:
    """Move every file of ``tmp`` into ``out``, the result file last; on any failure (or
    signal) take back what was moved, so ``out``'s top level is complete or holds none of it."""
    names = _result_last(p.name for p in tmp.iterdir())
    for name in names:   # nothing moved over a device, a FIFO, a link or a directory
        check_replaceable(out / name)
    moved = []
    try:
        for name in names:
            os.replace(tmp / name, out / name)
            moved.append(name)
    except BaseException:
        for name in reversed(moved):
            try:
                (out / name).unlink()
            except OSError:   # the resume rewrites it anyway: the result file is not there
                pass
        raise


# --- the result of a finished run that an extension trains on from ---------------------------
def set_aside_result(out: Path) -> bool:
    """Move a complete result at ``out``'s top to ``.previous-result/`` (the result file
    first); returns whether there was one."""
    out = Path(out)
    if not result_complete(out):
        return False
    aside = out / RESULT_ASIDE
    try:
        aside.mkdir(exist_ok=True)
        names = [n for n in FINAL_ARTIFACTS if (out / n).is_file()]
        _move_all(out, aside, list(reversed(_result_last(names))))
    except OSError as e:
        raise io_error(f"(setting aside) the finished run's result in {out}", e,
                       "nothing was trained yet") from None
    return True


def restore_result(out: Path) -> bool:
    """Put a result set aside back at ``out``'s top (the result file last), unless the top
    level holds a complete result; returns whether one was put back."""
    out, aside = Path(out), Path(out) / RESULT_ASIDE
    if not aside.is_dir() or result_complete(out):
        return False
    _move_all(aside, out, _result_last(p.name for p in aside.iterdir()))
    aside.rmdir()
    return True


def settle_result(out: Path) -> None:
    """At a run's start: a result set aside whose extension wrote its own is removed;
    otherwise it stays aside until the extension writes its result or ends without one."""
    aside = Path(out) / RESULT_ASIDE
    if aside.is_dir() and result_complete(out):
        shutil.rmtree(aside, ignore_errors=True)


# --- writing the top level ----------------------------------------------------------------------
def final_source(run_cfg, out: Path, step: int) -> tuple[dict | None, dict]:
    """(the weights the top level gets, or None for the last step's; what they are):
    best/'s when --final best, or by default when there was a validation split, and a
    best/ exists; else the last step's (``step``)."""
    choice = run_cfg.final or ("best" if run_cfg.val_split else "last")
    last = {"from": "last", "step": step}
    if choice == "last" or not (out / "best").is_dir():
        return None, last
    state, weights, _ = load_checkpoint(out / "best")
    return weights, {"from": "best", "step": state.get("step"), "val_loss": state.get("best_val"),
                     "last_step": step}


def write_top_level(run_cfg, out: Path, recipe, lora_meta, step: int) -> dict:
    """A completed run's result at the top of ``out``: the adapter (or weights) and the
    Modelfile, all or none of it (``publish``), then the Ollama model with --to-ollama;
    returns what it holds (final_text)."""
    values, final = final_source(run_cfg, out, step)
    tmp = None
    try:
        tmp = temp_dir(out, prefix=".final.")
        write_final(tmp, recipe, lora_meta, values)
        if lora_meta is not None and not run_cfg.dora:   # DoRA: no adapter.gguf
            # Ollama: FROM base + ADAPTER ./adapter.gguf, prompts in the run's template
            source = lora_meta["source"]   # ollama:NAME: FROM the Ollama model
            write_modelfile(tmp, source.path, template=lora_meta["template"], source=source)
        publish(tmp, out)
    except OSError as e:
        raise io_error(f"the final adapter into {out}", e,
                       "the final checkpoint in checkpoints/ is intact") from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(out / RESULT_ASIDE, ignore_errors=True)   # an extension's: replaced now
    if lora_meta is not None and not run_cfg.dora and run_cfg.to_ollama:
        final = {**final, "ollama": ollama_create(run_cfg.to_ollama, out / "Modelfile")}
    return final


def use_commands(model: str, out, name: str | None = None) -> list[tuple[str, str]]:
    """The commands that use the finished run directory ``out`` (trained on ``model``),
    each with what it is for: the one list both ``finetune`` and ``demo`` print, written
    to run as printed (quoted; a catalog model by its name; ``name`` the Ollama model to
    create, default from the run directory's name)."""
    from toygraph.adapters.modelfile import ollama_name_error
    from toygraph.models.catalog import catalog_name
    model = catalog_name(model) or str(model)
    if name is None:   # the run directory's name when Ollama takes it, else a plain one
        name = Path(out).name.lower()
        name = name if name and not ollama_name_error(name) else "my-model"
    run_dir, merged, modelfile = (shlex.quote(str(p)) for p in
                                  (out, Path(out) / "merged.gguf", Path(out) / "Modelfile"))
    model = shlex.quote(model)
    return [
        (f"toygraph chat --model {model} --adapter {run_dir}",
         "talk to the fine-tuned model here (/reset, /exit)"),
        (f"toygraph export --model {model} --adapter {run_dir} --out {merged}",
         "one self-contained GGUF with the adapter merged in (llama.cpp, LM Studio, Ollama)"),
        (f"ollama create {shlex.quote(name)} -f {modelfile} && ollama run {shlex.quote(name)}",
         "Ollama: the base GGUF plus adapter.gguf, as the Modelfile beside it says"),
    ]


def use_text(model: str, out, name: str | None = None) -> str:
    """:func:`use_commands` as the block both commands print."""
    return "\n".join(f"  {command}\n      # {why}" for command, why in use_commands(model, out, name))


def final_text(run_cfg, out: Path, final: dict, adapter: bool, show_use: bool = True) -> str:
    """Which result the run directory's top level holds, where the other one is, and (with
    ``show_use``) the commands that use it."""
    what = "adapter" if adapter else "weights (weights.safetensors)"
    if final["from"] == "best" and final["step"] == final["last_step"]:
        lines = [f"final {what}: {out} (the last step, {final['step']}, which also has the "
                 f"lowest validation loss, {final['val_loss']:.4f})"]
    elif final["from"] == "best":
        lines = [f"final {what}: {out} = best/ (step {final['step']}, the lowest validation "
                 f"loss {final['val_loss']:.4f}); the last step's ({final['last_step']}) is "
                 f"{out / 'checkpoints' / step_dir_name(final['last_step'])}"]
    else:
        lines = [f"final {what}: {out} (the last step, {final['step']})"
                 + (f"; the lowest validation loss is in {out / 'best'}" if (out / "best").is_dir()
                    else "")]
    if adapter and show_use:
        lines += ["use the result:", use_text(run_cfg.model, out),
                  "(any checkpoint directory works as --adapter too)"]
    if "ollama" in final:
        lines.append(f"--to-ollama: {final['ollama']['message']}")
    return terminal_text("\n".join(lines))   # paths and names as typed: escapes shown, not run
