"""``toygraph export``: merge a LoRA adapter into the base GGUF (toygraph.adapters.merge)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from toygraph.adapters.merge import ADAPTER_FORMS, OUT_TYPES, PROVENANCE, export_merged
from toygraph.atomic import check_replaceable
from toygraph.bounded import terminal_text
from toygraph.cli.args import add_allow_merged_arg, add_model_arg, add_other_base_arg, add_template_arg
from toygraph.cli.fidelity import add_check_arg, print_merge_check
from toygraph.errors import ToygraphError
from toygraph.limits import disk_full_text
from toygraph.models.catalog import resolve_model
from toygraph.models.model import GGUFModel
from toygraph.training.run_dir import FINAL_ARTIFACTS
from toygraph.training.supervisor import Ticker


def add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="merge a LoRA adapter into the base GGUF")
    add_model_arg(p, "the base model: ")
    p.add_argument("--adapter", required=True, help=f"the LoRA adapter to merge: {ADAPTER_FORMS}")
    p.add_argument("--out", required=True, help="merged GGUF to write")
    p.add_argument("--type", default="f16", choices=OUT_TYPES,
                   help="type of the merged weights; other tensors keep theirs")
    add_template_arg(p)
    add_allow_merged_arg(p)
    add_other_base_arg(p)
    add_check_arg(p)
    p.set_defaults(fn=_cmd_export)


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file: the same path once links are resolved, or
    the same inode (a hard link)."""
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:   # one of them does not exist: two different files
        return False


def check_out_is_not_read(out: str, adapter: str) -> None:
    """``--out`` must not be the adapter the export reads, nor a file of the run directory
    (or checkpoint) it reads it from: the merged GGUF would replace it, without a word."""
    out_path, source = Path(out), Path(adapter)
    files = [source / name for name in FINAL_ARTIFACTS] if source.is_dir() else [source]
    for f in files:
        if _same_file(out_path, f):
            what = "the adapter" if f == source else f"{f.name} of the adapter directory {source}"
            raise ToygraphError(f"--out {out} is {what}, which the export reads; choose another "
                                f"path for the merged GGUF")


def _cmd_export(args) -> int:
    check_replaceable(args.out, "--out")   # before the merge: /dev/null is no file to replace
    check_out_is_not_read(args.out, args.adapter)
    model_path = resolve_model(args.model)
    try:
        out = export_merged(model_path, args.adapter, args.out, args.type,
                            template=args.template, allow_merged=args.allow_merged,
                            other_base=args.other_base,
                            progress=Ticker("merging, tensor",
                                            lambda text: print(text, file=sys.stderr)))
    except OSError as e:   # the written file is a temporary one: --out is left as it was
        full = disk_full_text(e, args.out)
        if full is None:
            raise
        raise ToygraphError(full) from None
    merged = GGUFModel(out)
    meta = {k: merged.metadata(f"{PROVENANCE}.{k}") for k in ("rank", "alpha", "tensors", "template")}
    # the paths as typed and the template's name from the file: escapes shown, not run
    print(terminal_text(f"wrote {out} ({out.stat().st_size / 2**20:,.1f} MiB): "
                        f"{Path(args.model).name} with the adapter {args.adapter} (rank "
                        f"{meta['rank']}, alpha {meta['alpha']:g}) merged into "
                        f"{len(meta['tensors'])} tensors stored as {args.type}; chat template "
                        f"{meta['template']}"))
    print_merge_check(args, model_path, out)
    return 0
