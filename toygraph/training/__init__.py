"""Training runs: the run configuration, the one training loop, run directories and
events, checkpoints and resume, the divergence guard, and the supervisor that ties them
together around a recipe (toygraph.recipes).

>>> from toygraph.training import RunConfig, run_training                      # doctest: +SKIP
>>> run_training(RunConfig(model="m.gguf", data="d.jsonl", out="runs/x", steps=50))  # doctest: +SKIP
"""


def __getattr__(name):
    # on first use: importing one light module of this package (run_config, for the
    # command line's flags) must not import the whole training stack
    if name == "run_training":
        from toygraph.training.run import run_training
        return run_training
    if name == "RunConfig":
        from toygraph.training import run_config
        return getattr(run_config, name)
    raise AttributeError(f"module 'toygraph.training' has no attribute {name!r}")
