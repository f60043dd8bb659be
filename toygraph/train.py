"""The fine-tuning loop: data -> recipe steps -> validation, checkpoints, events, adapter.

>>> cfg = TrainConfig(model="model.gguf", data="train.jsonl", out="runs/x", steps=50)  # doctest: +SKIP
>>> summary = run_training(cfg)                                                         # doctest: +SKIP

A run writes into ``out``: ``events.jsonl`` (one JSON object a line: run_start, step,
eval, checkpoint, run_end), ``checkpoints/step-N/`` (trainable weights, AdamW moments and
the loop state, each written atomically), ``best/`` (lowest validation loss), and at the
top the final adapter (PEFT files and ``adapter.gguf``) or, for full/scratch recipes,
``weights.safetensors``. ``resume`` continues a run exactly where a checkpoint left it:
the data order is a function of (seed, epoch), so only the step number is needed to
regenerate the batches that follow.
"""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import __version__
from .checkpoint import load_checkpoint, save_checkpoint, write_adapter
from .data import (batches, data_hash, encode_dataset, load_examples, pad_id_for,
                   split_train_val, steps_per_epoch)
from .errors import DataError, ToygraphError
from .gguf import GGUFModel
from .modelfile import write_modelfile
from .optim import Schedule, hp_row
from .tokenizer import Tokenizer


@dataclass
class TrainConfig:
    model: str
    data: str
    out: str
    recipe: str = "lora"
    targets: tuple[str, ...] = ("q", "v")
    rank: int = 8
    alpha: float = 16.0
    steps: int | None = None
    epochs: float | None = None
    batch: int = 4
    grad_accum: int = 1
    seq_len: int = 128
    lr: float = 1e-3
    schedule: str = "cosine"
    warmup: int = 0
    min_lr: float = 0.0
    clip: float = 1.0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    seed: int = 42
    init_scale: float = 0.01
    val_split: float = 0.1
    eval_every: int = 0            # 0: at the end of every epoch and at the last step
    patience: int = 0              # early stopping after this many evals without gain; 0 off
    save_every: int = 0            # periodic checkpoints; 0 off
    adapter_init: str | None = None
    resume: str | None = None
    backend: str = "cpu"
    max_examples: int | None = None
    quiet: bool = False
    extra: dict = field(default_factory=dict)

    def validate(self):
        if self.steps is not None and self.epochs is not None:
            raise ToygraphError("give --steps or --epochs, not both")
        if self.steps is not None and self.steps < 1:
            raise ToygraphError(f"--steps must be >= 1, got {self.steps}")
        if self.epochs is not None and self.epochs <= 0:
            raise ToygraphError(f"--epochs must be > 0, got {self.epochs}")
        if not 0 <= self.val_split < 1:
            raise ToygraphError(f"--val-split must be in [0, 1), got {self.val_split}")
        if self.lr <= 0:
            raise ToygraphError(f"--lr must be > 0, got {self.lr}")
        if self.recipe not in ("lora", "full", "scratch"):
            raise ToygraphError(f"--recipe must be lora, full or scratch, got {self.recipe!r}")
        if self.recipe != "lora" and self.adapter_init:
            raise ToygraphError("--adapter-init needs --recipe lora")


class EventLog:
    """Appends one JSON object a line and flushes, so a crash loses nothing written."""

    def __init__(self, path: Path):
        self.f = open(path, "a", encoding="utf-8")

    def write(self, event: str, **fields):
        self.f.write(json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n")
        self.f.flush()

    def close(self):
        self.f.close()


def _versions() -> dict:
    import numpy
    out = {"toygraph": __version__, "python": platform.python_version(), "numpy": numpy.__version__}
    for mod in ("gguf", "tokenizers"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # version is informational only
            pass
    return out


def make_recipe(cfg: TrainConfig):
    from toygraph.recipes import RECIPES
    if cfg.recipe == "lora":
        return RECIPES["lora"](targets=cfg.targets, rank=cfg.rank, alpha=cfg.alpha)
    return RECIPES[cfg.recipe]()


# --- evaluation --------------------------------------------------------------------------------
def evaluate(recipe, items, batch: int, seq: int, pad: int) -> tuple[float, int]:
    """Token-weighted mean loss over ``items``."""
    total, count = 0.0, 0
    for b in batches(items, batch, seq, pad, shuffle=False, seed=0, epoch=0):
        s, n = recipe.evaluate(b.tokens, b.positions, b.labels)
        total, count = total + s, count + n
    return (total / count if count else float("nan")), count


class Progress:
    """A one-line progress bar on a terminal; a plain line every few steps otherwise."""

    def __init__(self, total: int, quiet: bool):
        self.total, self.quiet = total, quiet
        self.tty = sys.stderr.isatty()

    def update(self, t: int, loss: float, tok_s: float, extra: str = ""):
        if self.quiet:
            return
        width = 24
        done = int(width * t / self.total)
        line = (f"step {t:>5}/{self.total} [{'#' * done}{'.' * (width - done)}] "
                f"loss {loss:.4f}  {tok_s:,.0f} tok/s {extra}")
        if self.tty:
            print("\r" + line, end="" if t < self.total else "\n", file=sys.stderr, flush=True)
        elif t == 1 or t == self.total or t % max(1, self.total // 20) == 0 or extra:
            print(line, file=sys.stderr, flush=True)

    def message(self, text: str):
        if not self.quiet:
            print(("\n" if self.tty else "") + text, file=sys.stderr, flush=True)


# --- the loop ----------------------------------------------------------------------------------
def run_training(cfg: TrainConfig) -> dict:
    """Fine-tune per ``cfg``; returns a summary dict (also the run_end event)."""
    from toygraph.recipes import RecipeOptions
    cfg.validate()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    model = GGUFModel(cfg.model)
    mcfg = model.config
    if cfg.seq_len > mcfg.n_ctx:
        raise ToygraphError(f"--seq-len {cfg.seq_len} exceeds {Path(cfg.model).name}'s context "
                            f"length {mcfg.n_ctx}")
    tok = Tokenizer.from_gguf(cfg.model)
    examples = load_examples(cfg.data)
    if cfg.max_examples:
        examples = examples[:cfg.max_examples]
    enc = encode_dataset(examples, tok, cfg.seq_len)
    if not enc.items:
        raise DataError(f"{cfg.data}: no example has a target token within --seq-len {cfg.seq_len}")
    train, val = split_train_val(enc.items, cfg.val_split, cfg.seed)
    pad = pad_id_for(tok)
    per_step = cfg.batch * cfg.grad_accum
    n_batches = steps_per_epoch(len(train), cfg.batch)          # micro-batches an epoch
    total = cfg.steps or max(1, math.ceil((cfg.epochs or 1) * n_batches / cfg.grad_accum))
    schedule = Schedule(cfg.lr, "constant" if cfg.schedule == "constant" else cfg.schedule,
                        warmup=min(cfg.warmup, total - 1) if cfg.schedule != "constant" else cfg.warmup,
                        total=total, floor=cfg.min_lr)
    recipe = make_recipe(cfg)
    opts = RecipeOptions(t_seq=cfg.seq_len, t_batch=cfg.batch, seed=cfg.seed,
                         init_scale=cfg.init_scale, grad_clip=cfg.clip,
                         grad_accum=cfg.grad_accum, backend=cfg.backend)
    t_realize = time.perf_counter()
    recipe.realize(model, mcfg, opts)
    realize_s = time.perf_counter() - t_realize
    lora_meta = ({"rank": cfg.rank, "alpha": cfg.alpha, "targets": list(cfg.targets),
                  "base": Path(cfg.model).name} if cfg.recipe == "lora" else None)

    state = {"step": 0, "best_val": None, "bad_evals": 0, "data_hash": data_hash(cfg.data)}
    if cfg.adapter_init:
        from .adapters import load_peft
        lora, rank, alpha, targets = load_peft(cfg.adapter_init, mcfg)
        if rank != cfg.rank or set(targets) != set(cfg.targets):
            raise DataError(f"{cfg.adapter_init}: adapter has rank {rank} and targets {targets}; "
                            f"the run asks for rank {cfg.rank} and {list(cfg.targets)}")
        missing = set(recipe.net.lora) - set(lora)
        if missing:
            raise DataError(f"{cfg.adapter_init}: adapter lacks {sorted(missing)[:3]}")
        recipe.load_trainable({f"{k}.lora_{s}": v for k, (a, b) in lora.items()
                               for s, v in (("a", a), ("b", b))})
    if cfg.resume:
        saved, weights, moments = load_checkpoint(Path(cfg.resume))
        if saved.get("data_hash") != state["data_hash"]:
            raise DataError(f"{cfg.resume}: checkpoint was trained on other data "
                            f"(hash {saved.get('data_hash', '?')[:12]}, now {state['data_hash'][:12]})")
        recipe.load_trainable(weights)
        recipe.load_optimizer_state(moments)
        state.update({k: saved[k] for k in ("step", "best_val", "bad_evals")})

    log = EventLog(out / "events.jsonl")
    config = {k: v for k, v in asdict(cfg).items() if k != "extra"}
    log.write("run_start", config=config, data_hash=state["data_hash"], versions=_versions(),
              model_config=asdict(mcfg), data_report=asdict(enc.report), train_items=len(train),
              val_items=len(val), total_steps=total, resumed_from=state["step"] or None,
              realize_s=round(realize_s, 3), planned_bytes=recipe.sess.plan.arena_bytes)
    progress = Progress(total, cfg.quiet)
    progress.message(f"{enc.report}\ntrain {len(train)} / val {len(val)} examples; "
                     f"{total} steps of {per_step} sequences x {cfg.seq_len} tokens; "
                     f"realize {realize_s:.1f}s, {recipe.sess.plan.summary()}")

    epoch_cache: dict[int, list] = {}

    def micro_batch(m: int):
        epoch, idx = divmod(m, n_batches)
        if epoch not in epoch_cache:
            epoch_cache.clear()
            epoch_cache[epoch] = batches(train, cfg.batch, cfg.seq_len, pad, shuffle=True,
                                         seed=cfg.seed, epoch=epoch)
        return epoch_cache[epoch][idx]

    def checkpoint(kind: str, t: int):
        dest = out / ("best" if kind == "best" else f"checkpoints/step-{t:06d}")
        save_checkpoint(dest, recipe, {**state, "step": t, "config": config}, lora_meta)
        log.write("checkpoint", step=t, kind=kind, path=str(dest))

    def run_eval(t: int) -> bool:
        """Evaluate; returns True when early stopping says stop."""
        if not val:
            return False
        vloss, n = evaluate(recipe, val, cfg.batch, cfg.seq_len, pad)
        improved = state["best_val"] is None or vloss < state["best_val"]
        state["bad_evals"] = 0 if improved else state["bad_evals"] + 1
        if improved:
            state["best_val"] = vloss
        log.write("eval", step=t, val_loss=vloss, perplexity=math.exp(min(vloss, 700)), tokens=n,
                  best=improved)
        progress.message(f"step {t}: val loss {vloss:.4f} (ppl {math.exp(min(vloss, 700)):.2f})"
                         f"{' best' if improved else ''}")
        if improved:
            checkpoint("best", t)
        return bool(cfg.patience) and state["bad_evals"] >= cfg.patience

    status, t, losses = "completed", state["step"], []
    eval_every = cfg.eval_every or max(1, n_batches // cfg.grad_accum)
    # Ctrl-C sets a flag that the loop honours between steps, so an update is never cut
    # in half; a second Ctrl-C stops at once (and then no checkpoint is written).
    sigint = {"asked": False, "in_step": False}

    def on_sigint(signum, frame):
        if sigint["asked"]:
            raise KeyboardInterrupt
        sigint["asked"] = True

    old_handler = _install_sigint(on_sigint)
    try:
        if state["step"] == 0 and val:
            run_eval(0)  # the starting point, so the curve shows what training changed
        while t < total:
            t += 1
            t0 = time.perf_counter()
            mbs = [micro_batch((t - 1) * cfg.grad_accum + j) for j in range(cfg.grad_accum)]
            stack = (lambda f: np.stack([getattr(b, f) for b in mbs])) if cfg.grad_accum > 1 \
                else (lambda f: getattr(mbs[0], f))
            lr = schedule(t)
            hp = hp_row(t, lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay)
            sigint["in_step"] = True
            loss = recipe.step(stack("tokens"), stack("positions"), stack("labels"), hp,
                               is_first=(t == 1 and not cfg.resume))
            state["step"] = t
            sigint["in_step"] = False
            wall = time.perf_counter() - t0
            if not math.isfinite(loss):
                status = "diverged"
                raise ToygraphError(f"step {t}: loss is {loss}; lower --lr or set --clip")
            tokens = per_step * cfg.seq_len
            losses.append(loss)
            log.write("step", step=t, loss=loss, lr=lr, grad_norm=recipe.last_grad_norm(),
                      tokens=tokens, targets=int(sum(b.n_targets for b in mbs)),
                      wall_ms=round(wall * 1000, 2))
            progress.update(t, loss, tokens / wall)
            stop = (t % eval_every == 0 or t == total) and run_eval(t)
            if cfg.save_every and t % cfg.save_every == 0:
                checkpoint("periodic", t)
            if stop:
                status = "early_stopped"
                progress.message(f"early stopping: no validation gain in {cfg.patience} evals")
                break
            if sigint["asked"]:
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        status = "aborted" if sigint["in_step"] else "interrupted"
        progress.message(f"interrupted: saving a checkpoint at step {state['step']}"
                         if status == "interrupted" else "aborted in the middle of a step")
    finally:
        _install_sigint(old_handler)
        saved = (out / "checkpoints" / f"step-{state['step']:06d}").is_dir()
        if status in ("interrupted", "early_stopped", "completed") and state["step"] > 0 and not saved:
            checkpoint("interrupt" if status == "interrupted" else "final", state["step"])
        if status in ("early_stopped", "completed") and state["step"] > 0:
            if lora_meta is not None:
                write_adapter(out, recipe, lora_meta)
                write_modelfile(out, cfg.model)  # Ollama: FROM base + ADAPTER ./adapter.gguf
            else:
                from safetensors.numpy import save_file
                tmp = out / ".weights.safetensors.tmp"
                save_file(recipe.trainable(), str(tmp))
                os.replace(tmp, out / "weights.safetensors")
        summary = {"status": status, "steps": state["step"], "best_val_loss": state["best_val"],
                   "last_loss": losses[-1] if losses else None, "out": str(out)}
        log.write("run_end", **summary)
        log.close()
    _plot_losses(out)
    return summary


def _install_sigint(handler):
    """Swap the SIGINT handler where Python allows it (the main thread); returns the old."""
    import signal
    import threading
    if handler is None or threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, handler)


def _plot_losses(out: Path):
    """loss.png from events.jsonl, when matplotlib is installed (optional)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    steps, evals = [], []
    for line in (out / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["event"] == "step":
            steps.append((e["step"], e["loss"]))
        elif e["event"] == "eval":
            evals.append((e["step"], e["val_loss"]))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if steps:
        ax.plot(*zip(*steps), label="train loss", lw=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.legend()
    fig.tight_layout()
    tmp = out / ".loss.png.tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out / "loss.png")
