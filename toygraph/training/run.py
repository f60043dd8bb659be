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

import gc
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from toygraph import __version__
from toygraph.adapters.base import base_record, check_base
from toygraph.bounded import terminal_text
from toygraph.distributed import World, agreed_call, is_agreed, world
from toygraph.core.optimizer import AdamWSettings, Schedule
from toygraph.cpu import engine
from toygraph.errors import DataError, ToygraphError
from toygraph.models.stores import store_of
from toygraph.recipes import recipe_class
from toygraph.training.bus_error import BusErrorGuard
from toygraph.training.checkpoints import load_checkpoint, restore_swapped
from toygraph.training.guard import Diverged, DivergenceGuard
from toygraph.training.loop import Trainer
from toygraph.training.plot import plot_losses
from toygraph.training.prepare import Prepared, prepare
from toygraph.training.reporting import open_reporters
from toygraph.training.run_config import RunConfig, flag, recipe_options
from toygraph.training.lineage import check_claim, record_run_id, set_aside_newer
from toygraph.training.result import (final_text, restore_result, result_complete,
                                      set_aside_result, settle_result, write_top_level)
from toygraph.training.run_dir import (EVENTS_FILE, FINAL_ARTIFACTS, SUPERSEDED, EventLog,
                                       NullLog, RunError, io_error, open_run_dir)
from toygraph.training.run_file import RUN_FILE, write_run_file
from toygraph.training.supervisor import Progress, RunSupervisor, Signals
from toygraph.training.validation import end_of_run_fidelity

__all__ = ["RunConfig", "run_training", "make_recipe"]

#: Exit statuses of a run that reached its end (the adapter at the top is its result).
COMPLETED = ("completed", "early_stopped")
#: The exit status of a process whose run ended so (finetune's and the demo's).
EXIT_CODES = {"completed": 0, "early_stopped": 0, "diverged": 3, "unchanged": 4,
              "interrupted": 130}


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


def _realize(run_cfg: RunConfig, prep: Prepared, ranks: int = 1):
    recipe = make_recipe(run_cfg)
    share = recipe.labelled_share(prep.train, run_cfg.batch, run_cfg.seq_len, run_cfg.pack)
    recipe.realize(prep.model, prep.model.config,
                   replace(recipe_options(run_cfg, ranks), labelled_share=share))
    if run_cfg.adapter_init:
        _load_adapter_init(run_cfg, recipe, prep.model)
    if prep.resume_from is not None:
        _, weights, moments = load_checkpoint(prep.resume_from)
        want = {p.name for p in recipe.net.params}
        missing, unknown = sorted(want - set(weights)), sorted(set(weights) - want)
        if missing or unknown:   # a partial set would leave the rest at their initial values
            raise DataError(f"{prep.resume_from}: trainable.safetensors holds {len(weights)} "
                            f"tensors, the run trains {len(want)}"
                            + (f"; missing {missing[:3]}" if missing else "")
                            + (f"; unknown {unknown[:3]}" if unknown else ""))
        recipe.load_trainable(weights)
        recipe.load_optimizer_state(moments)
    return recipe


def _load_adapter_init(run_cfg: RunConfig, recipe, model):
    from toygraph.adapters.files import read_peft
    adapter = read_peft(run_cfg.adapter_init, recipe.model_cfg)
    check_base(run_cfg.adapter_init, model, run_cfg.other_base)
    rank, targets = adapter.rank, adapter.targets
    if rank != run_cfg.rank or set(targets) != set(run_cfg.targets):
        raise DataError(f"{run_cfg.adapter_init}: adapter has rank {rank} and targets "
                        f"{','.join(targets)}; the run asks for rank {run_cfg.rank} and targets "
                        f"{','.join(run_cfg.targets)}: give "
                        f"--targets {','.join(targets)} --rank {rank} --alpha {adapter.alpha:g} "
                        f"to continue it as it was trained")
    if adapter.alpha != float(run_cfg.alpha):   # refused, as rank is: run.yaml says the scale
        raise DataError(f"{run_cfg.adapter_init}: adapter has lora_alpha {adapter.alpha:g}; the run "
                        f"asks for --alpha {run_cfg.alpha:g} (the update's scale): give --alpha "
                        f"{adapter.alpha:g} to continue it as it was trained")
    for key, flag in (("rslora", "--rslora"), ("dora", "--dora")):
        want = bool(getattr(run_cfg, key, False))
        if getattr(adapter, key) != want:
            raise DataError(f"{run_cfg.adapter_init}: adapter has use_{key}="
                            f"{str(getattr(adapter, key)).lower()}; the run "
                            f"{'asks for' if want else 'does not ask for'} {flag}")
    missing = set(recipe.net.lora) - set(adapter.lora)
    if missing:
        raise DataError(f"{run_cfg.adapter_init}: adapter lacks {sorted(missing)[:3]}")
    recipe.load_adapter_init({f"{k}.lora_{s}": v for k, (a, b, *m) in adapter.lora.items()
                              for s, v in (("a", a), ("b", b), ("magnitude", (m or [None])[0]))
                              if v is not None})


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


def run_training(run_cfg: RunConfig, show_use: bool = True) -> dict:
    """Fine-tune per ``run_cfg``; returns a summary dict (also the run_end event). A run that
    fails with an error records ``run_end: failed`` and re-raises it. ``show_use=False``
    leaves the commands that use the result unsaid (the demo prints them at its end).

    Under ``mpirun -n N`` every rank calls this (data parallelism, see distributed.py):
    rank 0 alone writes into ``out``; an error every rank meets is raised on each, and a
    rank failing on its own aborts the job rather than leave the others waiting."""
    try:
        return _run_training(run_cfg, show_use)
    finally:
        # The run's session (arena, gradients, moments: GiBs on a 1.5B model) is held by
        # reference cycles (the graph's nodes, closures over the recipe) until the
        # collector next runs, which may be long after: collected here, once the run's
        # frames are gone, what the process does next (the demo's questions, an
        # evaluation) starts without it.
        gc.collect()


def _run_training(run_cfg: RunConfig, show_use: bool) -> dict:
    w = world()
    try:
        say = _say if w.rank == 0 and not run_cfg.quiet else (lambda text: None)
        prep = agreed_call(w, prepare, run_cfg, w.size, say)
        w.check_same_job(_job_facts(run_cfg, prep))
        # The model is mapped: a file truncated under the run is a SIGBUS (bus_error.py).
        with BusErrorGuard([prep.model.path], "toygraph finetune",
                           f"; restore it and continue with --resume {run_cfg.out}") as bus:
            new_dir = w.rank == 0 and not Path(run_cfg.out).exists()
            out, lock = agreed_call(w, _open_out, run_cfg, prep, w.rank)
            failed = True
            try:
                if lock is not None:
                    bus.last_words.append(lambda reason: lock.release())
                result = _run_locked(run_cfg, prep, out, w, say, bus.last_words, show_use)
                failed = False
                return result
            finally:
                engine.release()   # the kernels' kept memory serves training steps only
                if lock is not None:
                    lock.release()
                    if failed and new_dir:
                        _remove_if_empty(out)
    except BaseException as e:
        if w.size > 1 and not is_agreed(e):
            w.fail(f"failed: {_one_line(e)}")
        raise


def _remove_if_empty(out: Path) -> None:
    """A run that failed before writing anything (a reward file that does not load, a
    graph that does not build) takes away the directory it made: the user's --out is as
    it was, not an empty folder that looks like a run's."""
    try:
        out.rmdir()
    except OSError:   # it holds what the run wrote (its events, a checkpoint): kept
        pass


def _job_facts(run_cfg: RunConfig, prep: Prepared) -> dict:
    """What must be the same on every rank of a job (World.check_same_job): every option,
    the model and the data by their content (their paths may differ from node to node)."""
    facts = {flag(k): v for k, v in run_cfg.options().items() if k not in ("model", "data")}
    fingerprint = prep.state.model_fingerprint or {}
    return {"--model (its size and sampled sha256)":
            f"{fingerprint.get('size')} bytes, {str(fingerprint.get('sha256_sampled'))[:16]}",
            "--data (its sha256)": str(prep.state.data_hash)[:16], **facts}


def _say(text: str) -> None:
    """A line for the user watching the run (rank 0, not --quiet). Before the run has a
    directory there is nothing to record a lost terminal in: the progress line of the run
    itself meets it again and the run records the failure."""
    try:   # file names, paths and settings as typed: their escape sequences shown, not run
        print(terminal_text(text), file=sys.stderr, flush=True)
    except OSError:
        pass


def _open_out(run_cfg: RunConfig, prep: Prepared, rank: int):
    """Lock the run directory (rank 0 alone writes it), check under the lock that it still
    holds the run prepare found, and put right what a killed run may have left half done
    (a result set aside, best/ between its renames)."""
    if rank != 0:
        return Path(run_cfg.out), None
    out, lock = open_run_dir(run_cfg.out, resume=bool(run_cfg.resume),
                             overwrite=run_cfg.overwrite)
    try:
        if not (run_cfg.overwrite and not run_cfg.resume):   # --overwrite replaces any run
            check_claim(out, prep.dir_run_id)
        settle_result(out)
        restore_swapped(out / "best")   # a kill between best/'s two renames
    except BaseException:
        lock.release()
        raise
    return out, lock


def _ended(prep: Prepared, total: int) -> str | None:
    """The status a resumed run ends with when its training already ended (its top level
    is then all that is left to write), else None: its checkpoint is at the last step, or
    early stopping ended it before (a completed run given more --steps trains on)."""
    saved = prep.saved
    if saved is None:
        return None
    outcome = saved.outcome if saved.status == "finishing" else saved.status
    if saved.step >= total:
        return outcome if outcome in COMPLETED else "completed"
    return "early_stopped" if outcome == "early_stopped" else None


def _prepare_training(run_cfg: RunConfig, prep: Prepared, out: Path, say) -> None:
    """Rank 0, before a run trains (not when only its top level is left to write): the
    run's newer checkpoints set aside when it resumes from an earlier one, a finished
    result set aside when it is extended, the run file written."""
    if prep.resume_from is not None:
        moved = set_aside_newer(out, prep.state.step, prep.state.run_id)
        if moved:
            say(f"resume from step {prep.state.step}: moved the run's later checkpoints "
                f"({', '.join(moved)}) to {out / SUPERSEDED}; this run replaces them")
    if not set_aside_result(out):
        for name in FINAL_ARTIFACTS:   # what an interrupted write may have left
            (out / name).unlink(missing_ok=True)
    try:
        write_run_file(run_cfg, out)  # the options as they are now: --config repeats them
    except OSError as e:
        raise io_error(f"the run file into {out}", e) from None


def _run_locked(run_cfg: RunConfig, prep: Prepared, out: Path, w: World, say,
                last_words: list, show_use: bool = True) -> dict:
    """The run in its locked directory. ``last_words``: what a bus error (bus_error.py)
    calls before the process ends; the run adds its run_end and, while an extension
    trains, putting the finished result back."""
    t0 = time.perf_counter()
    say(f"building the training step ({run_cfg.recipe} on {run_cfg.backend}) ...")
    recipe = agreed_call(w, _realize, run_cfg, prep, w.size)
    realize_s = time.perf_counter() - t0
    micro_batch, n_batches = _epoch_batches(run_cfg, prep.train, prep.pad, recipe)
    total = run_cfg.steps or max(1, math.ceil((run_cfg.epochs or 1) * n_batches
                                                / run_cfg.grad_accum))
    complete = w.any([w.rank == 0 and result_complete(out)])[0]
    if prep.resume_from is not None and prep.state.step >= total and complete:
        # Nothing to do: the run's artifacts, events and run file stay as they are.
        reason = f"nothing to do: the checkpoint is at step {prep.state.step} of {total}"
        say(reason)
        return {"status": "completed", "reason": reason, "steps": prep.state.step,
                "best_val_loss": prep.state.best_val, "last_loss": None, "out": str(out)}
    ended = None if complete else _ended(prep, total)
    if ended is not None:
        say(f"the run's training ended at step {prep.state.step} but its result was not "
            f"written: writing it from {prep.resume_from}")
    elif w.rank == 0:
        _prepare_training(run_cfg, prep, out, say)
    warmup = (run_cfg.warmup if run_cfg.schedule == "constant"
              else min(run_cfg.warmup, total - 1))
    schedule = Schedule(run_cfg.lr, run_cfg.schedule, total=total, floor=run_cfg.min_lr,
                        warmup=warmup)
    adamw = AdamWSettings(run_cfg.beta1, run_cfg.beta2, run_cfg.eps, run_cfg.weight_decay)
    trainer = Trainer(recipe, micro_batch, schedule, total, state=prep.state, adamw=adamw,
                      resumed=prep.resume_from is not None, micro_per_epoch=n_batches,
                      rank=w.rank, ranks=w.size)
    ranks = w.gather_info() if w.size > 1 else None
    if w.rank == 0:
        record_run_id(out, prep.state.run_id)
    log = (EventLog(out / EVENTS_FILE, open_reporters(run_cfg.report_to, out, run_cfg.options()))
           if w.rank == 0 else NullLog())

    def trainer_words(reason):   # a bus error's run_end, while the trainer lives
        _last_words(log, trainer, out, reason)

    if w.rank == 0:
        last_words.insert(0, trainer_words)
    packing = recipe.packing_report(prep.train, run_cfg.batch, run_cfg.seq_len)
    _log_start(run_cfg, prep, log, recipe, total, realize_s, packing, ranks)
    progress = Progress(total, run_cfg.quiet or w.rank != 0, first_step=prep.state.step)
    rows = "rows" if run_cfg.pack else "sequences"
    intro = [f"train {len(prep.train)} / val {len(prep.val)} sequences; "
             f"{total} steps of {recipe.batch_rows()[0] * run_cfg.grad_accum} {rows} x "
             f"{run_cfg.seq_len} "
             f"tokens; realize {realize_s:.1f}s, {recipe.sess.plan.summary()}"
             f"{' (activations recomputed per block)' if run_cfg.checkpoint_activations else ''}"]
    if packing:
        intro += [f"packing efficiency (real tokens / slots): {packing['unpacked']:.1%} unpacked, "
                  f"{packing['packed']:.1%} packed{' (--pack)' if run_cfg.pack else ''}"]
    if recipe.opts.labelled_share is not None:
        intro += [f"labelled: {recipe.opts.labelled_share:.1%} of the slots; the head "
                  + ("fused with the loss (it computes on the labelled rows only)"
                     if getattr(recipe, "head_fused", False) else "and the loss apart")]
    # (line, shown even with --quiet): skipped checkpoints always show
    intro = [(line, False) for line in intro]
    intro += [(f"resume: skipped {path} ({why})", True) for path, why in prep.skipped]
    lora_meta = _lora_meta(run_cfg, prep, recipe)
    guard = DivergenceGuard(prep.state, run_cfg.diverge_factor)
    with Signals() as signals:
        progress.on_lost = signals.request_stop   # a closed log pipe stops as Ctrl-C does
        sup = RunSupervisor(run_cfg, out, recipe, log, progress, guard, signals, val=prep.val,
                            pad=prep.pad, lora_meta=lora_meta, world=w,
                            eval_every=(run_cfg.eval_every
                                        or max(1, n_batches // run_cfg.grad_accum)))
        signals.acknowledge = (lambda name: sup.acknowledge(trainer, name)) if w.rank == 0 else None
        error, status, reason = _loop(trainer, sup, guard, recipe, signals, intro, ended)
        final = None
        if status in (*COMPLETED, "interrupted"):
            error, status, reason, final = _finish(trainer, sup, out, recipe, lora_meta, status,
                                                   reason)
        if ended is not None and status in COMPLETED:
            reason = f"top level written from {prep.resume_from.name}"
    progress.close()
    # The final checkpoint is saved: only the top level is left, which --resume writes.
    finishing = trainer.state.status == "finishing" and sup.saved_step == trainer.state.step
    if w.rank == 0 and status not in COMPLETED and not finishing:
        restore_result(out)   # an extension that ended early: the finished run's result back
    resume = (f"toygraph finetune --config {shlex.quote(str(out / RUN_FILE))} "
              f"--resume {shlex.quote(str(out))}")
    # the command is in the summary too, so the log keeps it when stderr is gone
    resumable = w.rank == 0 and status not in COMPLETED and (
        finishing or (status == "interrupted" and trainer.state.step > 0))
    summary = {"status": status, "reason": reason, "steps": trainer.state.step,
               "best_val_loss": trainer.state.best_val,
               "last_loss": sup.losses[-1] if sup.losses else None, "out": str(out),
               **({"final": final} if final else {}), **({"resume": resume} if resumable else {})}
    _log_end(log, summary, error)
    if status != "failed" and w.rank == 0:
        plot_losses(out)
    if status in ("interrupted", "diverged"):
        progress.message(f"run {status}: {reason}", always=True)
    elif status == "unchanged":
        progress.message(f"warning: run unchanged: {reason}; no result written", always=True)
    if w.rank == 0 and status not in COMPLETED and finishing:
        progress.message(f"the training is done and its final checkpoint saved; write its "
                         f"result with:\n  {resume}", always=True)
    elif status == "interrupted" and w.rank == 0 and trainer.state.step:
        progress.message(f"continue it with:\n  {resume}", always=True)
    if final and w.rank == 0:
        progress.message(final_text(run_cfg, out, final, lora_meta is not None, show_use))
        if lora_meta is not None and not run_cfg.quiet:   # nobody would read it when quiet
            # The report builds a model per block type; the training's session (arena,
            # gradients, moments) goes first, so that the two do not stack: every holder
            # of the recipe let go, and the cycles among them collected.
            last_words.remove(trainer_words)
            signals.acknowledge = progress.on_lost = None
            del trainer, sup, recipe, micro_batch, trainer_words
            gc.collect()
            try:
                line = end_of_run_fidelity(run_cfg, prep, out)
            except (ToygraphError, MemoryError) as e:   # a report: the run has completed
                line = f"fidelity: not measured ({e})"
            if line:
                progress.message(line)
    if error is not None:
        raise error
    return summary


def _last_words(log, trainer, out: Path, reason: str) -> None:
    """What a run records when a bus error ends its process (no reporters: the event line
    alone), and an extension's finished result put back unless its training ended."""
    log.write_line("run_end", status="failed", reason=reason, steps=trainer.state.step,
                   best_val_loss=trainer.state.best_val, out=str(out))
    if trainer.state.status != "finishing":
        restore_result(out)


def _lora_meta(run_cfg: RunConfig, prep: Prepared, recipe) -> dict | None:
    """What the adapter files say about the run (None when it trains all weights)."""
    if not recipe.trains_adapter:
        return None
    return {"rank": run_cfg.rank, "alpha": run_cfg.alpha, "rslora": run_cfg.rslora,
            "lora_dropout": run_cfg.lora_dropout, "targets": list(run_cfg.targets),
            "base": run_cfg.model if store_of(run_cfg.model) else Path(run_cfg.model).name,
            "arch": prep.model.config.arch, "template": prep.template, "source": prep.source,
            "base_record": base_record(prep.model)}


def _loop(trainer, sup, guard, recipe, signals, intro: list[tuple[str, bool]],
          ended: str | None = None):
    """Run the loop; returns (error to re-raise or None, status, reason). ``ended``: the
    training ended before (the status it ended with); then only an evaluation its last step
    was due and did not get (a signal came first) is run, as the run would have."""
    try:
        for line, always in intro:
            sup.progress.message(line, always=always)
        if ended is not None:
            return None, ("early_stopped" if sup.pending_eval(trainer) else ended), None
        from_start = trainer.state.step == 0
        if from_start:
            guard.reference(recipe.trainable())
            if sup.val:
                sup.run_eval(trainer)  # the starting point: the curve shows what training changed
        trainer.run(sup)
        status = sup.stop_status or "completed"
        unchanged = _unchanged(sup, trainer.state.step) if from_start else None
        if status in COMPLETED and unchanged:
            return None, "unchanged", unchanged
        signal_name = signals.name or "a signal to another MPI rank"
        return None, status, (f"stopped by {signal_name}" if status == "interrupted" else None)
    except KeyboardInterrupt:   # the state may be half a step: no checkpoint is taken of it
        sup.aborted = True
        return (None, "interrupted",
                f"{signals.name or 'SIGINT'} twice: aborted during {signals.phase}, no "
                f"checkpoint written for it")
    except Diverged as e:
        return None, "diverged", str(e)
    except Exception as e:  # recorded as the run's failure, then re-raised to the caller
        return e, "failed", _one_line(e)


def _unchanged(sup, steps: int) -> str | None:
    """Why a run trained from step 0 changed nothing, or None: every step's gradient was
    exactly zero (so AdamW never moved a weight by more than its decay), with what made it
    so when the options say."""
    if sup.moved or steps == 0:
        return None
    why = ""
    if sup.recipe.trains_adapter and sup.run_cfg.init_scale == 0:
        why = ("; --init-scale 0 starts LoRA's A and B both at zero, so neither gets a "
               "gradient: give --init-scale > 0")
    elif sup.flat_rewards:
        why = ("; no group's rewards differed (GRPO learns from the differences): give a "
               "--reward that tells the completions apart")
    return f"every gradient of the run's {steps} steps was zero: nothing was learned{why}"


def _finish(trainer, sup, out, recipe, lora_meta, status, reason):
    """The final (or interrupt) checkpoint and, for a completed run, the top-level result:
    (error to re-raise or None, status, reason, what the top level holds or None). The
    final checkpoint says "finishing" (the top level is still to come), however the step's
    evaluation saved it before."""
    if trainer.state.step == 0 or sup.aborted:
        return None, status, reason, None
    if status == "interrupted":   # recorded in the checkpoint
        trainer.state.status, trainer.state.reason = status, reason
    else:
        trainer.state.status, trainer.state.outcome, trainer.state.reason = "finishing", status, None
    try:
        if status == "interrupted":
            sup.save(trainer, "interrupt")
            if sup.signals.waited:
                reason += "; a further signal during the checkpoint write waited for it"
            return None, status, reason, None
        sup.save(trainer, "final")
        if sup.world.rank != 0:
            return None, status, reason, None
        try:   # a signal now stops at once (a template or `ollama create` may be slow)
            with sup.signals.finishing():
                final = write_top_level(sup.run_cfg, out, recipe, lora_meta, trainer.state.step)
        except KeyboardInterrupt:
            return (None, "interrupted",
                    f"stopped by {sup.signals.name or 'SIGINT'} after the final checkpoint "
                    f"(step {trainer.state.step}) was saved; the top-level result was not "
                    f"written: --resume writes it from that checkpoint", None)
        return None, status, reason, final
    except Diverged as e:
        return None, "diverged", str(e), None
    except Exception as e:  # recorded as the run's failure, then re-raised to the caller
        return e, "failed", _one_line(e), None


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
              planned_bytes=recipe.sess.plan.arena_bytes, plan=recipe.sess.plan.report(),
              checkpoint_activations=recipe.opts.checkpoint_activations,
              arena_bytes=recipe.sess.plan.arena_bytes,
              **({"packing": {"pack": run_cfg.pack,
                              "efficiency": packing["packed" if run_cfg.pack else "unpacked"],
                              **packing}} if packing else {}),
              labelled_share=recipe.opts.labelled_share,
              head_fused=getattr(recipe, "head_fused", None),
              **({"ranks": ranks} if ranks else {}),
              **({"data_mix": prep.mix} if prep.mix else {}))


def _log_end(log, summary: dict, error):
    try:
        log.write("run_end", **summary)
    except RunError:
        if error is None:  # the run itself went well but its log cannot be written
            raise
    finally:
        log.close()
