"""``toygraph finetune``: the run's flags, made from the run configuration
(toygraph.training.run_config.RunConfig, one flag per field, its help and default shown),
an optional run file (``--config run.yaml``) under them, and the run.

Precedence: the fields' defaults, then the run file, then the flags given on the command
line. ``--config runs/x/run.yaml --out runs/y`` repeats run x into runs/y.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import MISSING

from toygraph.distributed import world
from toygraph.files import check_regular_file
from toygraph.models.catalog import resolve_source
from toygraph.models.stores import store_of
from toygraph.training.run_config import GROUPS, RunConfig, coerce, flag
from toygraph.training.run_file import load_run_file

#: Exit codes of ``finetune`` by run status (errors before or during the run exit 2).


def add_finetune_parser(sub) -> None:
    p = sub.add_parser("finetune", help="fine-tune a GGUF model on a JSONL dataset",
                       description="Fine-tune a GGUF model on a JSONL dataset. Every option "
                                   "can also come from a YAML run file (--config); flags given "
                                   "here override it.")
    p.add_argument("--config", metavar="RUN.yaml",
                   help="YAML run file: option: value, the keys being these flags' names with "
                        "_ (a run directory's run.yaml repeats that run; default: none, the "
                        "flags alone)")
    for group, title in GROUPS.items():
        g = p.add_argument_group(title)
        for name in RunConfig.names():
            if RunConfig.meta(name)["group"] == group:
                _add_option(g, name)
    p.set_defaults(fn=cmd_finetune)


def _add_option(g, name: str) -> None:
    """The flag of one RunConfig field. Its default is argparse.SUPPRESS, so the parsed
    namespace holds only the flags given, which then override the run file."""
    kind, meta, default = RunConfig.kind(name), RunConfig.meta(name), RunConfig.default(name)
    shown = "required" if default is MISSING else _shown(default)
    used = RunConfig.recipes_using(name)
    for_recipes = "" if RunConfig.for_every_recipe(name) else f"[{', '.join(used)}] "
    help_text = f"{for_recipes}{meta['help']} (default: {shown})"
    kwargs = dict(dest=name, default=argparse.SUPPRESS, help=help_text)
    if kind is bool:
        g.add_argument(flag(name), action=argparse.BooleanOptionalAction, **kwargs)
        return
    choices = RunConfig.choices(name)
    if kind is tuple:
        kwargs["metavar"] = "A,B,..."
    elif kind is list:   # repeatable: each flag adds one item (which may hold commas)
        kwargs.update(action="append", metavar="SPEC")
    elif kind in (int, float):
        kwargs["type"] = kind
    if choices:
        kwargs["choices"] = list(choices)
    g.add_argument(flag(name), **kwargs)


def _shown(default) -> str:
    if default is None:
        return "none"
    if isinstance(default, tuple):
        return ",".join(default) or "none"
    return str(default)


def run_config_from_args(args) -> RunConfig:
    """The RunConfig of a parsed command line: the defaults, then the run file
    (``--config``), then the flags given (the model name resolved to its file)."""
    if args.config:   # a FIFO or a device would hang the YAML reader
        check_regular_file(args.config, "--config")
    given = load_run_file(args.config) if args.config else {}
    flags = {name: coerce(name, value) for name, value in vars(args).items()
             if name in RunConfig.names()}
    if "allow_change" in flags:   # flag spellings are fine here: --allow-change seq-len
        flags["allow_change"] = tuple(n.replace("-", "_") for n in flags["allow_change"])
    given.update(flags)
    # A path or catalog name is resolved now (a bad one fails at once, smollm2 is fetched);
    # a store's name (ollama:...) stays a name, which prepare.py resolves first thing.
    if "model" in given and store_of(given["model"]) is None:
        given["model"] = str(resolve_source(given["model"]).path)
    return RunConfig.from_options(given)


def cmd_finetune(args):
    from toygraph.training.run import EXIT_CODES, run_training   # the whole stack: when running
    summary = run_training(run_config_from_args(args))
    if world().rank == 0:  # under mpirun every rank returns the same summary
        try:
            print(json.dumps(summary), flush=True)
        except OSError:   # stdout closed (`finetune ... | head`): the run and its log stand
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no exit-time error
    return EXIT_CODES.get(summary["status"], 1)
