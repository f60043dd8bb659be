"""Training runs: the run configuration, the one training loop, run directories and
events, checkpoints and resume, the divergence guard, and the supervisor that ties them
together around a recipe (toygraph.recipes).

>>> from toygraph.training import RunConfig, run_training                      # doctest: +SKIP
>>> run_training(RunConfig(model="m.gguf", data="d.jsonl", out="runs/x", steps=50))  # doctest: +SKIP
"""
from toygraph.training.run import run_training  # noqa: F401
from toygraph.training.run_config import RunConfig, TrainConfig  # noqa: F401
