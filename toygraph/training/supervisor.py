"""What a training run does around its steps: events, evaluation, checkpoints, the
divergence guard, Ctrl-C / SIGTERM, progress on the terminal.

``RunSupervisor`` is the ``Hooks`` of a CLI/API run (see ``loop.py`` for the loop).
Checkpoints are written at every evaluation, every ``save_every`` steps, every
``save_minutes`` minutes, when the run is interrupted and at its end; each is checked by
the divergence guard first and the ``keep_checkpoints`` newest are kept.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from toygraph.bounded import terminal_text
from toygraph.distributed import World
from toygraph.training.guard import Diverged
from toygraph.training.checkpoints import (list_checkpoints, prune_checkpoints, save_checkpoint,
                                           step_dir_name, write_adapter)
from toygraph.training.loop import Hooks, shard


def rate_text(per_s: float) -> str:
    """A rate with the precision its size wants: 1,234 / 56.7 / 0.42."""
    return f"{per_s:,.0f}" if per_s >= 100 else f"{per_s:.1f}" if per_s >= 10 else f"{per_s:.2f}"


def duration_text(s: float) -> str:
    s = int(max(s, 0))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


class Ticker:
    """``progress(done, total)`` of a long piece of work (tokenizing, evaluating, an
    export) as a line through ``say`` every ``every_s`` seconds: nothing for work that ends
    sooner, the count, elapsed and time left otherwise."""

    def __init__(self, label: str, say, every_s: float = 5.0, clock=time.monotonic):
        self.label, self.say, self.every_s, self.clock = label, say, every_s, clock
        self.start = self.last = clock()

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if now - self.last < self.every_s or done == 0:
            return
        self.last = now
        elapsed = now - self.start
        self.say(f"{self.label}: {done:,} of {total:,} ({done / max(total, 1):.0%}), "
                 f"{duration_text(elapsed)} elapsed, {duration_text(elapsed / done * (total - done))} left")


class Progress:
    """Training progress on stderr: steps, loss, tokens/s, elapsed and ETA.

    On a terminal it is one line redrawn in place at every step, and every ``every_s``
    seconds while a long step runs (a heartbeat thread) so the line never sits still; to a
    file or pipe it is a plain line at the first and last step, every 5% of the steps, at
    least every ``every_s`` seconds, and whenever there is a note. ``quiet``: nothing.
    """

    def __init__(self, total: int, quiet: bool, *, first_step: int = 0, every_s: float = 10.0,
                 stream=None, clock=time.monotonic, tty: bool | None = None):
        self.total, self.quiet, self.first_step, self.every_s = total, quiet, first_step, every_s
        # told once, with the reason, when the stream cannot be written (a closed pipe:
        # ``finetune ... 2>&1 | head``; a closed terminal): the run stops and saves
        self.on_lost = None
        self.lost: str | None = None
        self.stream, self.clock = stream, clock
        self.tty = (self._out().isatty() if tty is None else tty)
        self.start = self.last_print = clock()
        self.line, self.step_started = "", None
        self._lock = threading.Lock()
        self._beat: threading.Thread | None = None
        self._stopped = threading.Event()

    def _out(self):
        return self.stream or sys.stderr

    def _write(self, text: str, end: str = "\n"):
        """Write a line; a stream that fails (a reader gone, a terminal closed) is not
        written again, and ``on_lost`` is told, as a signal would be, so the run saves
        its checkpoint and stops rather than failing with nothing saved."""
        if self.lost:
            return
        out = self._out()
        try:
            out.write(text + end)
            out.flush()
        except (OSError, ValueError) as e:   # ValueError: a stream already closed
            self.lost = f"a closed output ({getattr(e, 'strerror', None) or e})"
            if self.on_lost is not None:
                self.on_lost(self.lost)

    def update(self, t: int, loss: float, tok_s: float, extra: str = "", metrics: str = ""):
        """``extra`` is a note that always shows; ``metrics`` ride along on the line."""
        if self.quiet:
            return
        now = self.clock()
        elapsed = now - self.start
        eta = elapsed / max(t - self.first_step, 1) * (self.total - t)
        width = 24
        done = int(width * t / self.total)
        line = (f"step {t:>5}/{self.total} [{'#' * done}{'.' * (width - done)}] "
                f"loss {loss:.4f}  {metrics + '  ' if metrics else ''}{rate_text(tok_s)} tok/s  "
                f"{duration_text(elapsed)} elapsed, {duration_text(eta)} left"
                f"{'  ' + extra if extra else ''}")
        with self._lock:
            self.line, self.step_started = line, None
            if self.tty:
                self._write("\r" + line, end="" if t < self.total else "\n")
            elif (t in (self.first_step + 1, self.total) or extra
                  or t % max(1, self.total // 20) == 0 or now - self.last_print >= self.every_s):
                self._write(line)
                self.last_print = now

    def step_begins(self):
        """A step starts: on a terminal, the heartbeat shows it running if it takes long."""
        if self.quiet or not self.tty:
            return
        with self._lock:
            self.step_started = self.clock()
        if self._beat is None:
            self._beat = threading.Thread(target=self._heartbeat, daemon=True)
            self._beat.start()

    def _heartbeat(self):
        while not self._stopped.wait(self.every_s):
            with self._lock:
                if self.step_started is None or not self.line:
                    continue
                running = self.clock() - self.step_started
                if running >= self.every_s:
                    self._write(f"\r{self.line}  (step running {duration_text(running)})",
                                end="")
                    if self.lost:   # the terminal went away: the loop stops the run
                        return

    def close(self):
        self._stopped.set()

    def message(self, text: str, always: bool = False):
        if always or not self.quiet:
            with self._lock:   # a path or a name in the text: its escapes shown, not run
                self._write(("\n" if self.tty else "") + terminal_text(text))


#: The signals that stop a run as Ctrl-C does: SIGHUP is a closed terminal or a dropped
#: ssh session, which must not lose the steps trained.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Signals:
    """SIGINT (Ctrl-C), SIGTERM and SIGHUP ask the loop to stop between steps, so an update is
    never cut in half; the first is acknowledged at once (``acknowledge(signal name)``
    gives the line to print). A second one stops at once wherever the run is in an
    ``abortable(phase)`` block -- a step (sampling and reward calls included), an
    evaluation -- and the run ends there without a checkpoint of that phase (``phase``
    says which it was), but never in a checkpoint write: during ``saving()`` signals are
    only counted (``waited``), and the write completes. During ``finishing()`` (the
    top-level result, after the final checkpoint) the first one stops at once: that work
    can be redone from the checkpoint, and it may be running a model's chat template or
    ``ollama create``, which must not outlive the user's Ctrl-C."""

    def __init__(self, acknowledge=None):
        self.count, self.name, self.in_step, self._saving, self._old = 0, None, False, False, {}
        self._finishing = self._abortable = self.waited = False
        self.phase = "the run's start"
        self.acknowledge = acknowledge

    def _handler(self, signum, frame):
        self.count += 1
        self.name = signal.Signals(signum).name
        if self._finishing and not self._saving:
            self._finishing = False   # once: the cleanup that follows is not cut short
            raise KeyboardInterrupt
        if self.count == 1 and self.acknowledge is not None:
            text = self.acknowledge(self.name)
            if text:
                # os.write, not print: the handler may interrupt a print in progress, and
                # a buffered stream refuses a reentrant write.
                try:
                    os.write(2, ("\n" + text + "\n").encode())
                except OSError:
                    pass
        if self.count > 1 and self._saving:
            self.waited = True
        elif self.count > 1 and (self._abortable or self.in_step):
            self._abortable = self.in_step = False   # once: what follows the abort is not cut short
            raise KeyboardInterrupt

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # Python's rule for handlers
            for sig in STOP_SIGNALS:
                self._old[sig] = signal.signal(sig, self._handler)
        return self

    def request_stop(self, why: str) -> None:
        """Stop between steps as a first signal does, for ``why`` (the run's output is
        gone, so nothing is acknowledged); a signal already received keeps its name."""
        if self.count == 0:
            self.count, self.name = 1, why

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)

    @contextmanager
    def abortable(self, phase: str):
        """A second signal stops ``phase`` at once (a step, an evaluation); one that came
        before it does too, on entering."""
        was = self._abortable, self.phase
        self._abortable, self.phase = True, phase
        if self.count > 1:
            raise KeyboardInterrupt
        try:
            yield
        except BaseException:   # ``phase`` stays: the run's reason names it
            self._abortable = was[0]
            raise
        self._abortable, self.phase = was

    @contextmanager
    def saving(self):
        was, self._saving = self._saving, True
        try:
            yield
        finally:
            self._saving = was

    @contextmanager
    def finishing(self):
        """Signals raise KeyboardInterrupt at once in this block (not in a ``saving()``);
        one that came before it does too, on entering."""
        if self.count:
            raise KeyboardInterrupt
        self._finishing = True
        try:
            yield
        finally:
            self._finishing = False


def evaluate(recipe, items, batch: int, seq_len: int, pad: int,
             world: World = World(), progress=None) -> tuple[float, int, dict]:
    """Mean loss over ``items``, weighted by what each batch counts (the recipe's
    ``eval_unit``: tokens, or pairs), and the recipe's metrics (``last_metrics``) weighted alike.
    Batches are made by the recipe (packed when it packs); each rank of ``world``
    evaluates its shard of every batch of ``batch`` rows."""
    total, count, sums = 0.0, 0, {}
    batches = recipe.make_batches(items, batch, seq_len, pad, shuffle=False, seed=0, epoch=0)
    for i, b in enumerate(batches):
        if progress is not None:
            progress(i, len(batches))
        rows = [shard(a, world.rank, world.size, axis=0) for a in (b.tokens, b.positions, b.labels)]
        if b.segments is not None:
            rows.append(shard(b.segments, world.rank, world.size, axis=0))
        s, n = recipe.evaluate(*rows)
        total, count = total + s, count + n
        for k, v in recipe.last_metrics.items():
            if k != "loss" and n:
                sums[k] = sums.get(k, 0.0) + v * n
    if world.size > 1:
        total, count = map(float, world.sum([total, count]))
        count = int(count)
    metrics = {k: v / count for k, v in sums.items()}
    return (total / count if count else float("nan")), count, metrics


class RunSupervisor(Hooks):
    """Events, evaluation, checkpoints and the divergence guard of one run."""

    def __init__(self, run_cfg, out: Path, recipe, log, progress, guard, signals, *, val, pad,
                 eval_every: int, lora_meta: dict | None, world: World = World()):
        self.run_cfg, self.out, self.recipe = run_cfg, out, recipe
        self.log, self.progress = log, progress
        self.guard, self.signals, self.val, self.pad = guard, signals, val, pad
        self.eval_every, self.lora_meta, self.world = eval_every, lora_meta, world
        self.stop_status: str | None = None
        self.aborted = False   # a second signal stopped a step or evaluation midway
        self.saved_step: int | None = None
        self.last_save = time.monotonic()
        self.losses: list[float] = []
        # whether a step had a non-zero gradient, and whether every GRPO step's groups had
        # equal rewards: a run that never moved says so (run.py _unchanged)
        self.moved, self.flat_rewards = False, True

    # --- hooks ------------------------------------------------------------------------------
    def before_step(self, trainer):
        self.signals.in_step, self.signals.phase = True, f"step {trainer.state.step + 1}"
        self.progress.step_begins()

    def acknowledge(self, trainer, signal_name: str) -> str:
        """The line a first Ctrl-C / SIGTERM gets at once: what happens next, and where."""
        t = trainer.state.step + (1 if self.signals.in_step else 0)
        where = (f"; its checkpoint goes to {self.out / 'checkpoints' / step_dir_name(t)}"
                 if t > 0 else "")
        return (f"{signal_name}: stopping after step {t}{where} (again to stop at once, "
                f"without it)")

    def after_step(self, trainer, loss, micro, wall_s) -> bool:
        self.signals.in_step = False
        t, run_cfg = trainer.state.step, self.run_cfg
        grad_norm = self.recipe.last_grad_norm()
        tokens = sum(b.tokens.size for b in micro)  # preference batches hold 2 rows a pair
        real = int(sum(b.real_tokens for b in micro))   # not padding: what tok/s counts
        metrics = {k: v for k, v in self.recipe.last_metrics.items() if k != "loss"}
        self.log.write("step", step=t, loss=loss, lr=trainer.last_lr, grad_norm=grad_norm,
                       tokens=tokens, real_tokens=real,
                       targets=int(sum(b.n_targets for b in micro)),
                       wall_ms=round(wall_s * 1000, 2), **metrics)
        self._guarded(self.guard.check_step, t, loss, grad_norm)
        self.losses.append(loss)
        self.moved = self.moved or grad_norm != 0.0
        self.flat_rewards = self.flat_rewards and metrics.get("frac_reward_zero_std") == 1.0
        self.progress.update(t, loss, real / max(wall_s, 1e-9),
                             metrics=self.recipe.metrics_text(metrics))
        if self.world.any([self.signals.count])[0]:   # asked to stop: no evaluation first
            self.stop_status = "interrupted"
            return True
        stop = (t % self.eval_every == 0 or t == trainer.total) and self.run_eval(trainer)
        due_time = (run_cfg.save_minutes
                    and time.monotonic() - self.last_save >= 60 * run_cfg.save_minutes)
        # Every rank must check (save) and stop at the same steps: rank 0's clock decides
        # when a checkpoint is due; a signal to any rank (even one during the save) stops all.
        due_time = self.world.any([due_time and self.world.rank == 0])[0]
        due_step = run_cfg.save_every and t % run_cfg.save_every == 0
        if self.saved_step != t and (due_step or due_time):
            self.save(trainer, "periodic")
        if stop:
            self.stop_status = "early_stopped"
            self.progress.message(f"early stopping: no validation gain in {run_cfg.patience} "
                                  "evals")
        elif self.world.any([self.signals.count])[0]:
            self.stop_status = "interrupted"
        return self.stop_status is not None

    def _guarded(self, check, *args) -> None:
        """A guard's check, agreed by every rank (agree_on_divergence)."""
        try:
            check(*args)
        except Diverged as e:
            agree_on_divergence(self.world, e)
        else:
            agree_on_divergence(self.world, None)

    # --- evaluation and checkpoints -----------------------------------------------------------
    def run_eval(self, trainer) -> bool:
        """Evaluate, checkpoint (and mark best when it improved and passes the guard);
        returns True when early stopping says stop."""
        if not self.val:
            return False
        st, run_cfg, t = trainer.state, self.run_cfg, trainer.state.step
        with self.signals.abortable(f"the evaluation at step {t}"):
            vloss, n, metrics = evaluate(self.recipe, self.val, run_cfg.batch, run_cfg.seq_len,
                                         self.pad, self.world,
                                         Ticker(f"step {t}: evaluating, batch",
                                                self.progress.message))
        st.eval_step = t
        improved = math.isfinite(vloss) and (st.best_val is None or vloss < st.best_val)
        weights = moments = None
        if t > 0:  # the state after an update is checked before it may become best
            weights, moments = self.recipe.trainable(), self.recipe.optimizer_state()
            self._guarded(self.guard.check_state, t, weights, moments)
        st.bad_evals = 0 if improved else st.bad_evals + 1
        if improved:
            st.best_val = vloss
        if self.recipe.eval_unit == "tokens":   # a mean per-token loss: perplexity says it too
            ppl = math.exp(min(vloss, 700)) if math.isfinite(vloss) else vloss
            self.log.write("eval", step=t, val_loss=vloss, perplexity=ppl, tokens=n, best=improved,
                           **{f"val_{k}": v for k, v in metrics.items()})
            shown = f"(ppl {ppl:.2f}) {self.recipe.metrics_text(metrics)}".rstrip()
        else:                                    # e.g. a loss per preference pair
            self.log.write("eval", step=t, val_loss=vloss, best=improved,
                           **{self.recipe.eval_unit: n},
                           **{f"val_{k}": v for k, v in metrics.items()})
            shown = self.recipe.metrics_text(metrics)
        self.progress.message(f"step {t}: val loss {vloss:.4f} {shown}{' best' if improved else ''}")
        if t > 0:
            if improved:
                self.save(trainer, "best", weights, moments)
            self.save(trainer, "eval", weights, moments)
        return bool(run_cfg.patience) and st.bad_evals >= run_cfg.patience

    def pending_eval(self, trainer) -> bool:
        """The evaluation the last step was due and did not get (a signal stopped the run
        after the step, before it), as after_step would have run it; returns whether early
        stopping says stop."""
        t = trainer.state.step
        due = t % self.eval_every == 0 or t == trainer.total
        return bool(self.val) and due and trainer.state.eval_step != t and self.run_eval(trainer)

    def save(self, trainer, kind: str, weights=None, moments=None):
        """Checkpoint the current state (checked by the guard first) and prune old ones.
        A periodic or evaluation checkpoint of a step already saved is skipped; the final
        and interrupt ones are always written (their state says how the run ended)."""
        t = trainer.state.step
        if kind in ("periodic", "eval") and self.saved_step == t:
            return
        if weights is None:
            weights, moments = self.recipe.trainable(), self.recipe.optimizer_state()
            self._guarded(self.guard.check_state, t, weights, moments)
        if self.world.rank != 0:  # rank 0 alone writes; the others only kept the guard's pace
            if kind != "best":
                self.saved_step, self.last_save = t, time.monotonic()
            return
        dest = self.out / ("best" if kind == "best" else f"checkpoints/{step_dir_name(t)}")
        earlier = list_checkpoints(self.out)
        intact = (f"earlier checkpoints are intact (newest: {earlier[-1][1]})" if earlier
                  else "no earlier checkpoint exists")
        def adapter_files(tmp):
            write_adapter(tmp, self.recipe, self.lora_meta, gguf_too=False, values=weights)
        extra = adapter_files if self.lora_meta is not None else None
        with self.signals.saving():
            save_checkpoint(dest, weights, moments, trainer.state.to_json(), extra, intact)
            if kind != "best":
                self.saved_step, self.last_save = t, time.monotonic()
                prune_checkpoints(self.out, self.run_cfg.keep_checkpoints, trainer.state.run_id)
        self.log.write("checkpoint", step=t, kind=kind, path=str(dest))


def agree_on_divergence(world: World, error: Diverged | None) -> None:
    """Raise Diverged on every rank when any rank's guard saw a divergence (``error``:
    this rank's, or None). The ranks hold the same weights, so one rank's divergence is
    every rank's; a rank stopping alone would leave rank 0 recording "completed" beside a
    rank that exited 3."""
    if world.size > 1:
        said = world.gather(None if error is None else str(error))
        if error is None:
            error = next((Diverged(f"rank {r} of {world.size}: {text}")
                          for r, text in enumerate(said) if text is not None), None)
    if error is not None:
        raise error
