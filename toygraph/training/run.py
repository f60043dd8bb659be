"""Fine-tuning runs: checks and setup around the one training loop.

>>> run_cfg = RunConfig(model="model.gguf", data="train.jsonl", out="runs/x", steps=50)  # doctest: +SKIP
>>> summary = run_training(run_cfg)                                                 # doctest: +SKIP

``run_cfg`` is always the run's options (RunConfig, run_config.py); the model's shape
(ModelConfig) is ``model_cfg`` / ``model.config``. Nothing here knows a recipe by name:
the recipe class the configuration names (toygraph.recipes.recipe_class) says how its data
is read and encoded, whether it trains an adapter and what its reference model holds.

A run writes into ``out`` (refused when it already holds a run, unless ``resume`` or
``overwrite``; locked while the run lives): ``events.jsonl`` (one strict-JSON object a
line: run_start, step, eval, checkpoint, run_end), ``checkpoints/step-N/`` (trainable
weights, AdamW moments, the loop state and a manifest; the ``keep_checkpoints`` newest),
``best/`` (lowest validation loss), ``run.yaml`` (the options, which repeat the run) and,
only when the run completed, the final adapter
at the top (PEFT files and ``adapter.gguf``) or, for full/scratch recipes,
``weights.safetensors``. ``resume`` continues from a checkpoint (or a run directory's
newest checkpoint that verifies) exactly where it left off, after checking that the
options, data and model are the ones it was made with.
"""
from __future__ import annotations

import hashlib
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from toygraph import __version__
from toygraph.adapters.modelfile import write_modelfile
from toygraph.core.distributed import World, agreed_call, is_agreed, world
from toygraph.core.optimizer import AdamWSettings, Schedule
from toygraph.data.batches import data_hash, pad_id_for, split_train_val
from toygraph.errors import DataError, ToygraphError
from toygraph.gguf.tokenizer import Tokenizer
from toygraph.models.model import GGUFModel
from toygraph.recipes import recipe_class
from toygraph.training.checkpoints import (find_resumable, load_checkpoint, restore_swapped,
                                           write_final)
from toygraph.training.guard import Diverged, DivergenceGuard
from toygraph.training.loop import LoopState, Trainer
from toygraph.training.plot import plot_losses
from toygraph.training.resume import check_resume, model_fingerprint
from toygraph.training.run_config import RunConfig, check_against_model, recipe_options
from toygraph.training.run_file import settings_block, write_run_file
from toygraph.training.run_dir import (EVENTS_FILE, FINAL_ARTIFACTS, EventLog, NullLog, RunError,
                                       io_error, open_run_dir)
from toygraph.training.supervisor import Progress, RunSupervisor, Signals

__all__ = ["RunConfig", "run_training", "make_recipe"]

#: Exit statuses of a run that reached its end (the adapter at the top is its result).
COMPLETED = ("completed", "early_stopped")


def _versions() -> dict:
    import numpy
    out = {"toygraph": __version__, "python": platform.python_version(), "numpy": numpy.__version__}
    for mod in ("gguf", "tokenizers"):
        try:
            out[mod] = __import__(mod).__version__
        except (ImportError, AttributeError):  # version is informational only
            pass
    return out


def make_recipe(run_cfg: RunConfig):
    """The recipe the run configuration names, made from its options."""
    return recipe_class(run_cfg.recipe).from_options(run_cfg)


def _encode(run_cfg: RunConfig, tok):
    """The data file read and encoded the way the recipe takes it (examples, or pairs)."""
    cls = recipe_class(run_cfg.recipe)
    rows = cls.load_data(run_cfg.data)
    rows = rows[:run_cfg.max_examples] if run_cfg.max_examples else rows
    return cls.encode_data(rows, tok, run_cfg.seq_len)


@dataclass
class Prepared:
    """Everything checked and loaded before the run directory is touched."""
    model: GGUFModel
    enc: object
    train: list
    val: list
    pad: int
    state: LoopState
    resume_from: Path | None = None
    skipped: list = field(default_factory=list)
    allowed: list = field(default_factory=list)


def _prepare(run_cfg: RunConfig, ranks: int = 1) -> Prepared:
    """Validate options, model, data and the checkpoint to resume: all before any write."""
    run_cfg.validate()
    if run_cfg.batch % ranks:
        raise ToygraphError(f"--batch {run_cfg.batch} is the global batch and must divide "
                            f"evenly over the {ranks} MPI ranks; use a multiple of {ranks}")
    model = GGUFModel(run_cfg.model)
    check_against_model(run_cfg, model.config)
    tok = Tokenizer.from_gguf(run_cfg.model)
    enc = _encode(run_cfg, tok)
    if not enc.items:
        raise DataError(f"{run_cfg.data}: no example has a target token within "
                        f"--seq-len {run_cfg.seq_len}")
    train, val = split_train_val(enc.items, run_cfg.val_split, run_cfg.seed)
    state = LoopState(data_hash=data_hash(run_cfg.data), options=run_cfg.options(),
                      model_fingerprint=model_fingerprint(run_cfg.model),
                      reference_hash=_reference_hash(run_cfg))
    prep = Prepared(model, enc, train, val, pad_id_for(tok), state)
    if run_cfg.resume:
        prep.resume_from, prep.skipped = find_resumable(Path(run_cfg.resume))
        saved = LoopState.from_json(load_checkpoint(prep.resume_from)[0])
        prep.allowed = check_resume(asdict(saved), asdict(state), str(prep.resume_from),
                                    set(run_cfg.allow_change))
        for name in ("step", "epoch", "best_val", "bad_evals", "recent_losses", "good_norm"):
            setattr(state, name, getattr(saved, name))
    return prep


def _reference_hash(run_cfg: RunConfig) -> str | None:
    """A hash of the adapter the recipe's frozen reference model includes (DPO with
    --adapter-init), None when it has none. A missing file is left for the adapter loader
    to report."""
    from toygraph.adapters.files import CONFIG_FILE, WEIGHTS_FILE
    adapter = recipe_class(run_cfg.recipe).reference_adapter_dir(run_cfg)
    if not adapter:
        return None
    files = [Path(adapter) / name for name in (CONFIG_FILE, WEIGHTS_FILE)]
    if not all(f.is_file() for f in files):
        return None
    return hashlib.sha256("".join(data_hash(f) for f in files).encode()).hexdigest()


def _realize(run_cfg: RunConfig, prep: Prepared, ranks: int = 1):
    recipe = make_recipe(run_cfg)
    recipe.realize(prep.model, prep.model.config, recipe_options(run_cfg, ranks))
    if run_cfg.adapter_init:
        _load_adapter_init(run_cfg, recipe)
    if prep.resume_from is not None:
        _, weights, moments = load_checkpoint(prep.resume_from)
        recipe.load_trainable(weights)
        recipe.load_optimizer_state(moments)
    return recipe


def _load_adapter_init(run_cfg: RunConfig, recipe):
    from toygraph.adapters.files import load_peft
    lora, rank, alpha, targets = load_peft(run_cfg.adapter_init, recipe.model_cfg)
    if rank != run_cfg.rank or set(targets) != set(run_cfg.targets):
        raise DataError(f"{run_cfg.adapter_init}: adapter has rank {rank} and targets {targets}; "
                        f"the run asks for rank {run_cfg.rank} and {list(run_cfg.targets)}")
    missing = set(recipe.net.lora) - set(lora)
    if missing:
        raise DataError(f"{run_cfg.adapter_init}: adapter lacks {sorted(missing)[:3]}")
    recipe.load_adapter_init({f"{k}.lora_{s}": v for k, (a, b) in lora.items()
                              for s, v in (("a", a), ("b", b))})


def _epoch_batches(run_cfg: RunConfig, train: list, pad: int, recipe):
    """micro_batch(m) over epochs; the order (and packing) of epoch e is a function of
    (seed, e), and so is the number of batches an epoch has."""
    n = recipe.batches_per_epoch(train, run_cfg.batch, run_cfg.seq_len)
    cache: dict[int, list] = {}

    def micro_batch(m: int):
        epoch, idx = divmod(m, n)
        if epoch not in cache:
            cache.clear()
            cache[epoch] = recipe.make_batches(train, run_cfg.batch, run_cfg.seq_len, pad,
                                               shuffle=True, seed=run_cfg.seed, epoch=epoch)
        return cache[epoch][idx]
    return micro_batch, n


def run_training(run_cfg: RunConfig) -> dict:
    """Fine-tune per ``run_cfg``; returns a summary dict (also the run_end event). A run that
    fails with an error records ``run_end: failed`` and re-raises it.

    Under ``mpirun -n N`` every rank calls this (data parallelism, see distributed.py):
    rank 0 alone writes into ``out``; an error every rank meets is raised on each, and a
    rank failing on its own aborts the job rather than leave the others waiting."""
    w = world()
    try:
        prep = agreed_call(w, _prepare, run_cfg, w.size)
        out, lock = agreed_call(w, _open_out, run_cfg, w.rank)
        try:
            return _run_locked(run_cfg, prep, out, w)
        finally:
            if lock is not None:
                lock.release()
    except BaseException as e:
        if w.size > 1 and not is_agreed(e):
            w.fail(f"failed: {_one_line(e)}")
        raise


def _open_out(run_cfg: RunConfig, rank: int):
    if rank != 0:  # rank 0 alone writes the run directory
        return Path(run_cfg.out), None
    return open_run_dir(run_cfg.out, resume=bool(run_cfg.resume),
                        overwrite=run_cfg.overwrite)


def _run_locked(run_cfg: RunConfig, prep: Prepared, out: Path, w: World) -> dict:
    if w.rank == 0:
        for name in FINAL_ARTIFACTS:
            (out / name).unlink(missing_ok=True)  # present again only if this run completes
        restore_swapped(out / "best")
        try:
            write_run_file(run_cfg, out)  # the options as they are now: --config repeats them
        except OSError as e:
            raise io_error(f"the run file into {out}", e) from None
    t0 = time.perf_counter()
    recipe = agreed_call(w, _realize, run_cfg, prep, w.size)
    realize_s = time.perf_counter() - t0
    micro_batch, n_batches = _epoch_batches(run_cfg, prep.train, prep.pad, recipe)
    total = run_cfg.steps or max(1, math.ceil((run_cfg.epochs or 1) * n_batches
                                                / run_cfg.grad_accum))
    warmup = (run_cfg.warmup if run_cfg.schedule == "constant"
              else min(run_cfg.warmup, total - 1))
    schedule = Schedule(run_cfg.lr, run_cfg.schedule, total=total, floor=run_cfg.min_lr,
                        warmup=warmup)
    adamw = AdamWSettings(run_cfg.beta1, run_cfg.beta2, run_cfg.eps, run_cfg.weight_decay)
    trainer = Trainer(recipe, micro_batch, schedule, total, state=prep.state, adamw=adamw,
                      resumed=prep.resume_from is not None, micro_per_epoch=n_batches,
                      rank=w.rank, ranks=w.size)
    ranks = w.gather_info() if w.size > 1 else None
    log = EventLog(out / EVENTS_FILE) if w.rank == 0 else NullLog()
    packing = recipe.packing_report(prep.train, run_cfg.batch, run_cfg.seq_len)
    _log_start(run_cfg, prep, log, recipe, total, realize_s, packing, ranks)
    progress = Progress(total, run_cfg.quiet or w.rank != 0)
    rows = "rows" if run_cfg.pack else "sequences"
    intro = [f"{settings_block(run_cfg)}\n{prep.enc.report}\ntrain {len(prep.train)} / val {len(prep.val)} sequences; "
             f"{total} steps of {recipe.batch_rows()[0] * run_cfg.grad_accum} {rows} x "
             f"{run_cfg.seq_len} "
             f"tokens; realize {realize_s:.1f}s, {recipe.sess.plan.summary()}"
             f"{' (activations recomputed per block)' if run_cfg.checkpoint_activations else ''}"]
    if packing:
        intro += [f"packing efficiency (real tokens / slots): {packing['unpacked']:.1%} unpacked, "
                  f"{packing['packed']:.1%} packed{' (--pack)' if run_cfg.pack else ''}"]
    intro += [f"resume: skipped {path} ({why})" for path, why in prep.skipped]
    lora_meta = ({"rank": run_cfg.rank, "alpha": run_cfg.alpha,
                  "targets": list(run_cfg.targets),
                  "base": Path(run_cfg.model).name, "arch": prep.model.config.arch}
                 if recipe.trains_adapter else None)
    guard = DivergenceGuard(prep.state, run_cfg.diverge_factor)
    with Signals() as signals:
        sup = RunSupervisor(run_cfg, out, recipe, log, progress, guard, signals, val=prep.val,
                            pad=prep.pad, lora_meta=lora_meta, world=w,
                            eval_every=(run_cfg.eval_every
                                        or max(1, n_batches // run_cfg.grad_accum)))
        error, status, reason = _loop(trainer, sup, guard, recipe, signals, intro)
        if status in (*COMPLETED, "interrupted"):
            error, status, reason = _finish(trainer, sup, out, recipe, lora_meta, status, reason)
    summary = {"status": status, "reason": reason, "steps": trainer.state.step,
               "best_val_loss": trainer.state.best_val,
               "last_loss": sup.losses[-1] if sup.losses else None, "out": str(out)}
    _log_end(log, summary, error)
    if status != "failed" and w.rank == 0:
        plot_losses(out)
    if status in ("interrupted", "diverged"):
        progress.message(f"run {status}: {reason}", always=True)
    if error is not None:
        raise error
    return summary


def _loop(trainer, sup, guard, recipe, signals, intro: list[str]):
    """Run the loop; returns (error to re-raise or None, status, reason)."""
    try:
        for i, line in enumerate(intro):
            sup.progress.message(line, always=i > 0)  # skipped checkpoints always show
        if trainer.state.step == 0:
            guard.reference(recipe.trainable())
            if sup.val:
                sup.run_eval(trainer)  # the starting point: the curve shows what training changed
        trainer.run(sup)
        status = sup.stop_status or "completed"
        signal_name = signals.name or "a signal to another MPI rank"
        return None, status, (f"stopped by {signal_name}" if status == "interrupted" else None)
    except KeyboardInterrupt:
        return (None, "interrupted",
                f"{signals.name or 'SIGINT'} twice: aborted during step {trainer.state.step + 1}, "
                f"no checkpoint written for it")
    except Diverged as e:
        return None, "diverged", str(e)
    except Exception as e:  # recorded as the run's failure, then re-raised to the caller
        return e, "failed", _one_line(e)


def _finish(trainer, sup, out, recipe, lora_meta, status, reason):
    """The final (or interrupt) checkpoint and, for a completed run, the top-level result."""
    if trainer.state.step == 0:
        return None, status, reason
    trainer.state.status, trainer.state.reason = status, reason  # recorded in the checkpoint
    try:
        if status == "interrupted":
            sup.save(trainer, "interrupt")
            if sup.signals.count > 1:
                reason += "; a further signal during the checkpoint write waited for it"
            return None, status, reason
        sup.save(trainer, "final")
        if sup.world.rank != 0:
            return None, status, reason
        write_final(out, recipe, lora_meta)
        if lora_meta is not None:
            write_modelfile(out, sup.run_cfg.model)  # Ollama: FROM base + ADAPTER ./adapter.gguf
        return None, status, reason
    except Diverged as e:
        return None, "diverged", str(e)
    except Exception as e:  # recorded as the run's failure, then re-raised to the caller
        return e, "failed", _one_line(e)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _log_start(run_cfg, prep: Prepared, log, recipe, total: int, realize_s: float,
               packing: dict | None, ranks=None):
    log.write("run_start", config=run_cfg.options(), data_hash=prep.state.data_hash,
              model_fingerprint=prep.state.model_fingerprint, versions=_versions(),
              model_config=asdict(prep.model.config), data_report=asdict(prep.enc.report),
              train_items=len(prep.train), val_items=len(prep.val), total_steps=total,
              resumed_from=prep.state.step or None, pid=os.getpid(),
              resumed_checkpoint=str(prep.resume_from) if prep.resume_from else None,
              skipped_checkpoints=[{"path": str(p), "reason": r} for p, r in prep.skipped],
              allowed_changes=prep.allowed, realize_s=round(realize_s, 3),
              planned_bytes=recipe.sess.plan.arena_bytes,
              checkpoint_activations=recipe.opts.checkpoint_activations,
              arena_bytes=recipe.sess.plan.arena_bytes,
              **({"packing": {"pack": run_cfg.pack,
                              "efficiency": packing["packed" if run_cfg.pack else "unpacked"],
                              **packing}} if packing else {}),
              **({"ranks": ranks} if ranks else {}))


def _log_end(log, summary: dict, error):
    try:
        log.write("run_end", **summary)
    except RunError:
        if error is None:  # the run itself went well but its log cannot be written
            raise
    finally:
        log.close()
