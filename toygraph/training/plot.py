"""``loss.png`` of a run from its ``events.jsonl``, when matplotlib is installed (optional)."""
from __future__ import annotations

import os
from pathlib import Path

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
    tmp = out / ".loss.png.tmp.png"
    try:
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, out / "loss.png")
    except OSError:
        tmp.unlink(missing_ok=True)  # the plot is a convenience; the events are the record
    finally:
        plt.close(fig)
