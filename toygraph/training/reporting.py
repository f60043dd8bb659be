"""``--report-to``: the scalars of ``events.jsonl`` also sent to TensorBoard or W&B.

The event log (run_dir.EventLog) hands every event it writes to the reporters the run
asked for; each takes the numbers it holds. A ``step`` event's numbers become
``train/<field>`` (loss, lr, grad_norm, tokens, real_tokens, targets, wall_ms and the
recipe's metrics), plus ``train/tokens_per_s`` (real tokens / wall time, what the progress
line shows); an ``eval`` event's become ``eval/<field>`` (val_loss, perplexity, ...). The
step is the event's ``step``. So the curves are exactly the log's numbers.

- ``tensorboard``: event files in ``RUN_DIR/tensorboard/`` (toygraph.training.tensorboard
  writes them: no TensorFlow, PyTorch or protobuf); ``tensorboard --logdir runs`` shows
  every run.
- ``wandb``: one W&B run per training run (``WANDB_MODE=offline`` works with no network),
  its config the run's options; the project is ``$WANDB_PROJECT``, else "toygraph". The W&B
  run id is kept in ``RUN_DIR/wandb/toygraph-run-id`` so that a resumed run continues it.
"""
from __future__ import annotations

import math
from pathlib import Path

from toygraph.atomic import atomic_write, check_replaceable
from toygraph.errors import ToygraphError

#: What --report-to accepts ("none": nothing, the default).
REPORTERS = ("tensorboard", "wandb")
#: The run directory's entries the reporters write (removed by --overwrite).
REPORT_DIRS = ("tensorboard", "wandb")


def reporter_names(values) -> list[str]:
    """The reporters a --report-to list names (repeated flags or commas; "none" is none),
    each once; a one-line error for an unknown name or a missing package."""
    names = []
    for value in values:
        for name in (v.strip() for v in str(value).split(",")):
            if name in ("", "none"):
                continue
            if name not in REPORTERS:
                raise ToygraphError(f"--report-to {name}: unknown; choose from "
                                    f"{', '.join(REPORTERS)} or none")
            if name not in names:
                names.append(name)
    if "wandb" in names:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ToygraphError("--report-to wandb: the wandb package is not installed "
                                "(pip install wandb)") from None
    return names


def scalars(event: str, fields: dict) -> tuple[int, dict[str, float]] | None:
    """(step, {tag: value}) of an event's numbers, or None for an event without any."""
    if event not in ("step", "eval") or "step" not in fields:
        return None
    prefix = "train" if event == "step" else "eval"
    out = {f"{prefix}/{k}": float(v) for k, v in fields.items()
           if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    if event == "step" and fields.get("wall_ms") and "real_tokens" in fields:
        out["train/tokens_per_s"] = fields["real_tokens"] / (fields["wall_ms"] / 1000)
    return int(fields["step"]), out


class TensorBoardReporter:
    def __init__(self, out: Path, options: dict):
        from toygraph.training.tensorboard import ScalarWriter
        self.writer = ScalarWriter(Path(out) / "tensorboard")

    def write(self, event: str, fields: dict):
        found = scalars(event, fields)
        if found:
            self.writer.add_scalars(found[1], step=found[0])

    def close(self):
        self.writer.close()


class WandbReporter:
    def __init__(self, out: Path, options: dict):
        import os
        import uuid

        import wandb
        folder = Path(out) / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / "toygraph-run-id"
        check_replaceable(id_file)   # read and rewritten: a regular file, never a link or FIFO
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
        try:
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "toygraph"),
                                  name=Path(out).resolve().name, dir=str(out), id=run_id,
                                  resume="allow", config=options)
        except Exception as e:   # not logged in, no network, ...: W&B's reason, one line
            reason = " ".join(str(e).split()) or type(e).__name__
            raise ToygraphError(f"--report-to wandb: could not start a W&B run: {reason} "
                                f"(WANDB_MODE=offline logs without a network)") from None
        atomic_write(id_file, lambda tmp: Path(tmp).write_text(run_id))

    def write(self, event: str, fields: dict):
        found = scalars(event, fields)
        if found:
            step, values = found
            self.run.log({k: v for k, v in values.items() if math.isfinite(v)}, step=step)

    def close(self):
        self.run.finish()


_CLASSES = {"tensorboard": TensorBoardReporter, "wandb": WandbReporter}


def open_reporters(names, out: Path, options: dict) -> list:
    """The reporters of a run (rank 0's): each gets every event the log writes."""
    return [_CLASSES[name](out, options) for name in reporter_names(names)]
