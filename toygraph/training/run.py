"""Fine-tuning runs: options, checks, and setup around the one training loop.

>>> train_cfg = TrainConfig(model="model.gguf", data="train.jsonl", out="runs/x", steps=50)  # doctest: +SKIP
>>> summary = run_training(train_cfg)                                                 # doctest: +SKIP

``train_cfg`` is always the run's options (TrainConfig); the model's shape (ModelConfig) is
``model_cfg`` / ``model.config``.

A run writes into ``out`` (refused when it already holds a run, unless ``resume`` or
``overwrite``; locked while the run lives): ``events.jsonl`` (one strict-JSON object a
line: run_start, step, eval, checkpoint, run_end), ``checkpoints/step-N/`` (trainable
weights, AdamW moments, the loop state and a manifest; the ``keep_checkpoints`` newest),
``best/`` (lowest validation loss), and, only when the run completed, the final adapter
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
from toygraph.core.optimizer import Schedule
from toygraph.data.batches import (data_hash, encode_dataset, load_examples, pad_id_for,
                                   split_train_val)
from toygraph.data.packing import packing_efficiency
from toygraph.data.preference import encode_pairs, load_pairs
from toygraph.errors import DataError, ToygraphError
from toygraph.gguf.tokenizer import Tokenizer
from toygraph.models.model import GGUFModel
from toygraph.training.checkpoints import (find_resumable, load_checkpoint, restore_swapped,
                                           write_final)
from toygraph.training.guard import Diverged, DivergenceGuard
from toygraph.training.loop import AdamW, LoopState, Trainer
from toygraph.training.plot import plot_losses
from toygraph.training.resume import check_resume, model_fingerprint
from toygraph.training.run_config import (ADAPTER_RECIPES, PREFERENCE_RECIPES, TrainConfig,
                                          check_against_model)
from toygraph.training.run_dir import (EVENTS_FILE, FINAL_ARTIFACTS, EventLog, NullLog, RunError,
                                       open_run_dir)
from toygraph.training.supervisor import Progress, RunSupervisor, Signals

__all__ = ["TrainConfig", "run_training", "make_recipe"]

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


def make_recipe(train_cfg: TrainConfig):
    from toygraph.recipes import RECIPES
    if train_cfg.recipe == "dpo":
        return RECIPES["dpo"](targets=train_cfg.targets, rank=train_cfg.rank, alpha=train_cfg.alpha,
                              beta=train_cfg.beta, label_smoothing=train_cfg.label_smoothing,
                              reference_adapter=bool(train_cfg.adapter_init))
    if train_cfg.recipe == "orpo":
        return RECIPES["orpo"](targets=train_cfg.targets, rank=train_cfg.rank,
                               alpha=train_cfg.alpha, beta=train_cfg.beta)
    if train_cfg.recipe == "lora":
        return RECIPES["lora"](targets=train_cfg.targets, rank=train_cfg.rank,
                               alpha=train_cfg.alpha)
    return RECIPES[train_cfg.recipe]()


def _encode(train_cfg: TrainConfig, tok):
    """The data file parsed and encoded: examples, or preference pairs for dpo/orpo."""
    if train_cfg.recipe in PREFERENCE_RECIPES:
        load, encode = load_pairs, encode_pairs
    else:
        load, encode = load_examples, encode_dataset
    rows = load(train_cfg.data)
    rows = rows[:train_cfg.max_examples] if train_cfg.max_examples else rows
    return encode(rows, tok, train_cfg.seq_len)


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


def _prepare(train_cfg: TrainConfig, ranks: int = 1) -> Prepared:
    """Validate options, model, data and the checkpoint to resume: all before any write."""
    train_cfg.validate()
    if train_cfg.batch % ranks:
        raise ToygraphError(f"--batch {train_cfg.batch} is the global batch and must divide "
                            f"evenly over the {ranks} MPI ranks; use a multiple of {ranks}")
    model = GGUFModel(train_cfg.model)
    check_against_model(train_cfg, model.config)
    tok = Tokenizer.from_gguf(train_cfg.model)
    enc = _encode(train_cfg, tok)
    if not enc.items:
        raise DataError(f"{train_cfg.data}: no example has a target token within "
                        f"--seq-len {train_cfg.seq_len}")
    train, val = split_train_val(enc.items, train_cfg.val_split, train_cfg.seed)
    state = LoopState(data_hash=data_hash(train_cfg.data), options=train_cfg.options(),
                      model_fingerprint=model_fingerprint(train_cfg.model),
                      reference_hash=_reference_hash(train_cfg))
    prep = Prepared(model, enc, train, val, pad_id_for(tok), state)
    if train_cfg.resume:
        prep.resume_from, prep.skipped = find_resumable(Path(train_cfg.resume))
        saved = LoopState.from_json(load_checkpoint(prep.resume_from)[0])
        prep.allowed = check_resume(asdict(saved), asdict(state), str(prep.resume_from),
                                    set(train_cfg.allow_change))
        for name in ("step", "epoch", "best_val", "bad_evals", "recent_losses", "good_norm"):
            setattr(state, name, getattr(saved, name))
    return prep


def _reference_hash(train_cfg: TrainConfig) -> str | None:
    """DPO with --adapter-init: a hash of that adapter, its reference model (None otherwise).
    A missing file is left for the adapter loader to report."""
    from toygraph.adapters.files import CONFIG_FILE, WEIGHTS_FILE
    if train_cfg.recipe != "dpo" or not train_cfg.adapter_init:
        return None
    files = [Path(train_cfg.adapter_init) / name for name in (CONFIG_FILE, WEIGHTS_FILE)]
    if not all(f.is_file() for f in files):
        return None
    return hashlib.sha256("".join(data_hash(f) for f in files).encode()).hexdigest()


def _realize(train_cfg: TrainConfig, prep: Prepared, ranks: int = 1):
    from toygraph.recipes import RecipeOptions
    recipe = make_recipe(train_cfg)
    shared = {name: getattr(train_cfg, name) for name in RecipeOptions.names()
              if hasattr(train_cfg, name)}  # the options both share, by one name
    # --batch is the job's batch: with several ranks each realizes its share of it
    opts = RecipeOptions(**{**shared, "batch": train_cfg.batch // ranks,
                            "data_parallel": ranks > 1})
    recipe.realize(prep.model, prep.model.config, opts)
    if train_cfg.adapter_init:
        _load_adapter_init(train_cfg, recipe)
    if prep.resume_from is not None:
        _, weights, moments = load_checkpoint(prep.resume_from)
        recipe.load_trainable(weights)
        recipe.load_optimizer_state(moments)
    return recipe


def _load_adapter_init(train_cfg: TrainConfig, recipe):
    from toygraph.adapters.files import load_peft
    lora, rank, alpha, targets = load_peft(train_cfg.adapter_init, recipe.model_cfg)
    if rank != train_cfg.rank or set(targets) != set(train_cfg.targets):
        raise DataError(f"{train_cfg.adapter_init}: adapter has rank {rank} and targets {targets}; "
                        f"the run asks for rank {train_cfg.rank} and {list(train_cfg.targets)}")
    missing = set(recipe.net.lora) - set(lora)
    if missing:
        raise DataError(f"{train_cfg.adapter_init}: adapter lacks {sorted(missing)[:3]}")
    recipe.load_adapter_init({f"{k}.lora_{s}": v for k, (a, b) in lora.items()
                              for s, v in (("a", a), ("b", b))})


def _epoch_batches(train_cfg: TrainConfig, train: list, pad: int, recipe):
    """micro_batch(m) over epochs; the order (and packing) of epoch e is a function of
    (seed, e), and so is the number of batches an epoch has."""
    n = recipe.batches_per_epoch(train, train_cfg.batch, train_cfg.seq_len)
    cache: dict[int, list] = {}

    def micro_batch(m: int):
        epoch, idx = divmod(m, n)
        if epoch not in cache:
            cache.clear()
            cache[epoch] = recipe.make_batches(train, train_cfg.batch, train_cfg.seq_len, pad,
                                               shuffle=True, seed=train_cfg.seed, epoch=epoch)
        return cache[epoch][idx]
    return micro_batch, n


def run_training(train_cfg: TrainConfig) -> dict:
    """Fine-tune per ``train_cfg``; returns a summary dict (also the run_end event). A run that
    fails with an error records ``run_end: failed`` and re-raises it.

    Under ``mpirun -n N`` every rank calls this (data parallelism, see distributed.py):
    rank 0 alone writes into ``out``; an error every rank meets is raised on each, and a
    rank failing on its own aborts the job rather than leave the others waiting."""
    w = world()
    try:
        prep = agreed_call(w, _prepare, train_cfg, w.size)
        out, lock = agreed_call(w, _open_out, train_cfg, w.rank)
        try:
            return _run_locked(train_cfg, prep, out, w)
        finally:
            if lock is not None:
                lock.release()
    except BaseException as e:
        if w.size > 1 and not is_agreed(e):
            w.fail(f"failed: {_one_line(e)}")
        raise


def _open_out(train_cfg: TrainConfig, rank: int):
    if rank != 0:  # rank 0 alone writes the run directory
        return Path(train_cfg.out), None
    return open_run_dir(train_cfg.out, resume=bool(train_cfg.resume),
                        overwrite=train_cfg.overwrite)


def _run_locked(train_cfg: TrainConfig, prep: Prepared, out: Path, w: World) -> dict:
    if w.rank == 0:
        for name in FINAL_ARTIFACTS:
            (out / name).unlink(missing_ok=True)  # present again only if this run completes
        restore_swapped(out / "best")
    t0 = time.perf_counter()
    recipe = agreed_call(w, _realize, train_cfg, prep, w.size)
    realize_s = time.perf_counter() - t0
    micro_batch, n_batches = _epoch_batches(train_cfg, prep.train, prep.pad, recipe)
    total = train_cfg.steps or max(1, math.ceil((train_cfg.epochs or 1) * n_batches
                                                / train_cfg.grad_accum))
    warmup = (train_cfg.warmup if train_cfg.schedule == "constant"
              else min(train_cfg.warmup, total - 1))
    schedule = Schedule(train_cfg.lr, train_cfg.schedule, total=total, floor=train_cfg.min_lr,
                        warmup=warmup)
    adamw = AdamW(train_cfg.beta1, train_cfg.beta2, train_cfg.eps, train_cfg.weight_decay)
    trainer = Trainer(recipe, micro_batch, schedule, total, state=prep.state, adamw=adamw,
                      resumed=prep.resume_from is not None, micro_per_epoch=n_batches,
                      rank=w.rank, ranks=w.size)
    ranks = w.gather_info() if w.size > 1 else None
    log = EventLog(out / EVENTS_FILE) if w.rank == 0 else NullLog()
    packing = (None if train_cfg.recipe in PREFERENCE_RECIPES
               else packing_efficiency(prep.train, train_cfg.batch, train_cfg.seq_len))
    _log_start(train_cfg, prep, log, recipe, total, realize_s, packing, ranks)
    progress = Progress(total, train_cfg.quiet or w.rank != 0)
    rows = "rows" if train_cfg.pack else "sequences"
    intro = [f"{prep.enc.report}\ntrain {len(prep.train)} / val {len(prep.val)} sequences; "
             f"{total} steps of {recipe.batch_rows()[0] * train_cfg.grad_accum} {rows} x "
             f"{train_cfg.seq_len} "
             f"tokens; realize {realize_s:.1f}s, {recipe.sess.plan.summary()}"
             f"{' (activations recomputed per block)' if train_cfg.checkpoint_activations else ''}"]
    if packing:
        intro += [f"packing efficiency (real tokens / slots): {packing['unpacked']:.1%} unpacked, "
                  f"{packing['packed']:.1%} packed{' (--pack)' if train_cfg.pack else ''}"]
    intro += [f"resume: skipped {path} ({why})" for path, why in prep.skipped]
    lora_meta = ({"rank": train_cfg.rank, "alpha": train_cfg.alpha,
                  "targets": list(train_cfg.targets),
                  "base": Path(train_cfg.model).name, "arch": prep.model.config.arch}
                 if train_cfg.recipe in ADAPTER_RECIPES else None)
    guard = DivergenceGuard(prep.state, train_cfg.diverge_factor)
    with Signals() as signals:
        sup = RunSupervisor(train_cfg, out, recipe, log, progress, guard, signals, val=prep.val,
                            pad=prep.pad, lora_meta=lora_meta, world=w,
                            eval_every=(train_cfg.eval_every
                                        or max(1, n_batches // train_cfg.grad_accum)))
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
            write_modelfile(out, sup.train_cfg.model)  # Ollama: FROM base + ADAPTER ./adapter.gguf
        return None, status, reason
    except Diverged as e:
        return None, "diverged", str(e)
    except Exception as e:  # recorded as the run's failure, then re-raised to the caller
        return e, "failed", _one_line(e)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _log_start(train_cfg, prep: Prepared, log, recipe, total: int, realize_s: float,
               packing: dict | None, ranks=None):
    log.write("run_start", config=train_cfg.options(), data_hash=prep.state.data_hash,
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
              **({"packing": {"pack": train_cfg.pack,
                              "efficiency": packing["packed" if train_cfg.pack else "unpacked"],
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
