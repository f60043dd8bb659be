"""Everything a run checks and loads before its run directory is touched.

The order is the user's: what needs no model first (the options, ``--out``, the checkpoint
to resume, ``--adapter-init``, the data file's rows), so a typo fails in a second; then
the model ("loading ..."), the settings block, the tokenized data, and the checks that
need them (the checkpoint's options, data and model against this run's).
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from toygraph.data.batches import data_hash, pad_id_for, split_train_val
from toygraph.data.mixing import mix_hash, mix_rows, mix_summary, parse_data_specs
from toygraph.data.prompts import EncodedPrompt
from toygraph.errors import DataError, GGUFError, ToygraphError
from toygraph.files import check_regular_file
from toygraph.gguf.tokenizer import Tokenizer
from toygraph.models.model import GGUFModel
from toygraph.models.stores import Source, resolve_store, store_of
from toygraph.recipes import recipe_class
from toygraph.training.checkpoints import checkpoint_run_id, find_resumable, load_checkpoint
from toygraph.training.tokenized_size import (check_tokenized_memory, estimate_tokenized_bytes,
                                              rows_bytes)
from toygraph.training.lineage import lineage
from toygraph.training.loop import LoopState
from toygraph.training.reporting import reporter_names
from toygraph.training.resume import check_resume, model_fingerprint, model_identity
from toygraph.training.run_config import RunConfig, check_against_model
from toygraph.training.run_dir import check_run_dir
from toygraph.training.run_file import settings_block
from toygraph.training.supervisor import Ticker


def size_text(n: int) -> str:
    """Bytes as a person reads them: 512 B, 98.4 MiB, 4.9 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


@dataclass
class Prepared:
    """Everything checked and loaded before the run directory is touched."""
    model: GGUFModel
    enc: object
    train: list
    val: list
    pad: int
    state: LoopState
    template: tuple[str, str] = ("", "")   # (name, Jinja source) conversations render with
    source: Source | None = None   # where the model came from (the Modelfile names it)
    resume_from: Path | None = None
    skipped: list = field(default_factory=list)
    allowed: list = field(default_factory=list)
    mix: list | None = None   # each file's share of a mixed run's training rows (mixing.py)
    saved: LoopState | None = None   # the state of the checkpoint resumed from
    dir_run_id: str | None = None    # the run id --out holds (lineage.py), None: no run


def _model_source(model: str, say) -> Source:
    """Where --model's GGUF is: a path, or a store's name (``ollama:...``, models/stores.py),
    which the run keeps as a name so that its Modelfile can name the Ollama model."""
    if store_of(model) is not None:
        source = resolve_store(model)
        for warning in source.warnings:
            say(f"warning: {warning}")
        return source
    if not Path(model).is_file():
        raise GGUFError(f"{model}: no such GGUF file")
    return Source(path=Path(model), spec=model)


def prepare(run_cfg: RunConfig, ranks: int = 1, say=lambda text: None) -> Prepared:
    """Validate options, model, data and the checkpoint to resume: all before any write.
    ``say`` gets the lines a user watches (loading, the settings, tokenizing)."""
    run_cfg.validate()
    if run_cfg.batch % ranks:
        raise ToygraphError(f"--batch {run_cfg.batch} is the global batch and must divide "
                            f"evenly over the {ranks} MPI ranks; use a multiple of {ranks}")
    source = _model_source(run_cfg.model, say)
    model_path = source.path
    check_run_dir(run_cfg.out, resume=bool(run_cfg.resume), overwrite=run_cfg.overwrite)
    resume_from, skipped = (find_resumable(Path(run_cfg.resume)) if run_cfg.resume
                            else (None, []))
    run_id, dir_run_id = lineage(Path(run_cfg.out), resume_from,
                                 checkpoint_run_id(resume_from) if resume_from else None)
    if run_cfg.adapter_init and not Path(run_cfg.adapter_init).is_dir():
        raise DataError(f"--adapter-init {run_cfg.adapter_init}: no such adapter directory")
    reporter_names(run_cfg.report_to)   # an unknown name or a missing package: now
    cls = recipe_class(run_cfg.recipe)
    specs = parse_data_specs(run_cfg.data)
    for spec in specs:   # a FIFO or a device would hang the reader
        check_regular_file(spec.path, "--data", DataError)
    # the data's shape is checked before the model loads
    files = [cls.load_data(spec.path) for spec in specs]
    files = [rows[:run_cfg.max_examples] if run_cfg.max_examples else rows for rows in files]

    shown = run_cfg.model if store_of(run_cfg.model) else model_path.name   # not sha256-...
    say(f"loading {shown} ({size_text(model_path.stat().st_size)}) ...")
    model = GGUFModel(model_path)
    check_against_model(run_cfg, model.config)
    tok = Tokenizer.from_gguf(model.reader, source=str(model_path))
    tok.use_template(run_cfg.template)   # the model's own, its default, or --template
    say(settings_block(run_cfg))
    t0 = time.perf_counter()
    names = ", ".join(spec.name for spec in specs)
    n_rows = sum(map(len, files))
    estimates = [estimate_tokenized_bytes(
        lambda sample: cls.encode_data(sample, tok, run_cfg.seq_len), rows) for rows in files]
    known = [e for e in estimates if e is not None]
    memory = check_tokenized_memory(sum(known) if known else None, names, n_rows, size_text,
                                    held=rows_bytes(files))
    say(f"tokenizing {n_rows:,} rows of {names} (template: {tok.template_name}{memory}) ...")
    ticker = Ticker("tokenizing, row", say)
    encoded = [cls.encode_data(rows, tok, run_cfg.seq_len, progress=ticker) for rows in files]
    for spec, enc in zip(specs, encoded):
        if not enc.items:
            raise DataError(f"{spec.path}: no example has a target token within "
                            f"--seq-len {run_cfg.seq_len}")
    encoded = _prompt_ids_across_files(encoded)
    enc = encoded[0] if len(encoded) == 1 else _merged(encoded)
    say(f"tokenized in {time.perf_counter() - t0:.1f}s: {enc.report}")
    splits = [split_train_val(e.items, run_cfg.val_split, run_cfg.seed) for e in encoded]
    if len(specs) == 1:   # one file is taken whole, as it always was
        (train, val), mix, hashed = splits[0], None, data_hash(specs[0].path)
    else:
        weights = [s.weight for s in specs] if specs[0].weight is not None else None
        train = mix_rows([t for t, _ in splits], weights, run_cfg.seed)
        val = [row for _, v in splits for row in v]
        line, mix = mix_summary(specs, [len(t) for t, _ in splits], run_cfg.seed)
        say(line)
        hashed = mix_hash(specs, [data_hash(spec.path) for spec in specs])
    check_passes_per_step(run_cfg, len(train), say)
    state = LoopState(data_hash=hashed, options=run_cfg.options(),
                      model_fingerprint=model_fingerprint(model_path),
                      model_identity=model_identity(model),
                      reference_hash=_reference_hash(run_cfg), run_id=run_id)
    prep = Prepared(model, enc, train, val, pad_id_for(tok), state,
                    template=(tok.template_name, tok.chat_template), source=source,
                    resume_from=resume_from, skipped=skipped, mix=mix, dir_run_id=dir_run_id)
    if resume_from is not None:
        saved = LoopState.from_json(load_checkpoint(resume_from)[0],
                                    str(resume_from / "state.json"))
        prep.allowed = check_resume(asdict(saved), asdict(state), str(resume_from),
                                    set(run_cfg.allow_change))
        for name in ("step", "epoch", "best_val", "bad_evals", "recent_losses", "good_norm",
                     "eval_step"):
            setattr(state, name, getattr(saved, name))
        prep.saved = saved
    return prep


def _prompt_ids_across_files(encoded: list) -> list:
    """A prompt's ``index`` is its id in GRPO's batches (data/prompts.py), numbered from 0
    in each file; in a mix of files the later files' ids are offset, so that no two prompts
    share one and a rollout is scored against its own row's fields."""
    offset, out = 0, []
    for enc in encoded:
        if enc.items and isinstance(enc.items[0], EncodedPrompt):
            if offset:
                enc = replace(enc, items=[replace(item, index=item.index + offset)
                                          for item in enc.items])
            offset = max(item.index for item in enc.items) + 1
        out.append(enc)
    return out


def _merged(encoded: list):
    """One EncodedDataset of several files' (a mix's): their items in file order, their
    reports summed (counts add up, dropped lines are listed file by file)."""
    first = encoded[0]
    report = replace(first.report)
    for enc in encoded[1:]:
        for f in fields(report):
            mine, theirs = getattr(report, f.name), getattr(enc.report, f.name)
            if f.name != "max_len":   # the same --seq-len for every file
                setattr(report, f.name, max(mine, theirs) if f.name == "longest" else mine + theirs)
    return type(first)([item for enc in encoded for item in enc.items], report)


def check_passes_per_step(run_cfg: RunConfig, n_train: int, say) -> None:
    """One optimizer step over more than the training data is said, and over more than
    --max-passes-per-step of it refused: --grad-accum 100000 is a typo, not a plan."""
    passes = run_cfg.batch * run_cfg.grad_accum / max(n_train, 1)
    if run_cfg.max_passes_per_step and passes > run_cfg.max_passes_per_step:
        raise ToygraphError(f"one step of --batch {run_cfg.batch} x --grad-accum "
                            f"{run_cfg.grad_accum} is {passes:,.1f} passes over the "
                            f"{n_train} training examples; lower them, or raise "
                            f"--max-passes-per-step ({run_cfg.max_passes_per_step:g})")
    if passes > 1:
        say(f"warning: one step of --batch {run_cfg.batch} x --grad-accum {run_cfg.grad_accum} "
            f"is {passes:.1f} passes over the {n_train} training examples")


def _reference_hash(run_cfg: RunConfig) -> str | None:
    """A hash of the adapter the recipe's frozen reference model includes (DPO with
    --adapter-init), None when it has none. A missing file is left for the adapter loader
    to report."""
    from toygraph.adapters.files import CONFIG_FILE, WEIGHTS_FILE
    adapter = recipe_class(run_cfg.recipe).reference_adapter_dir(run_cfg)
    if not adapter:
        return None
    files = [Path(adapter) / name for name in (CONFIG_FILE, WEIGHTS_FILE)]
    if not all(f.is_file() for f in files):
        return None
    return hashlib.sha256("".join(data_hash(f) for f in files).encode()).hexdigest()
