"""``loss.png`` of a run from its ``events.jsonl``, when matplotlib is installed (optional)."""
from __future__ import annotations

from pathlib import Path

from toygraph.atomic import OutputPathError, atomic_write
from toygraph.training.run_dir import EVENTS_FILE, read_events


def plot_losses(out: Path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    steps, evals = [], []
    for e in read_events(out / EVENTS_FILE):
        if e["event"] == "step" and e.get("loss") is not None:
            steps.append((e["step"], e["loss"]))
        elif e["event"] == "eval" and e.get("val_loss") is not None:
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
    try:
        atomic_write(out / "loss.png", lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    except (OSError, OutputPathError):  # the plot is a convenience; the events are the record
        pass
    finally:
        plt.close(fig)
