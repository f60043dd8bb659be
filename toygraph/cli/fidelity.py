"""``toygraph eval --adapter RUN --quants q8_0,q6_k,q4_k``: the fidelity report of
toygraph/inference/fidelity.py, over the run's validation split (or --data/--text/--tokens)."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from toygraph.errors import DataError, ToygraphError
from toygraph.inference.fidelity import MERGED_TYPES, QUANTS, TOLERANCE


def add_fidelity_args(p) -> None:
    """The flags of the report, on ``toygraph eval``."""
    p.add_argument("--quants", metavar="LIST",
                   help="fidelity report: the adapter's loss and KL against the trained base "
                        "with the base requantized in memory to each of these block types "
                        f"(comma-separated: {','.join(QUANTS)}); data: the run's validation "
                        "split unless --data/--text/--tokens (default: none, no report)")
    p.add_argument("--merged-types", metavar="LIST", default=",".join(MERGED_TYPES),
                   help="with --quants: also the merged export at each of these --type values "
                        "('none' for no merged rows; default: %(default)s)")
    p.add_argument("--write-quants", metavar="DIR",
                   help="with --quants: also write each requantized base there as "
                        "<model>.<type>.gguf (by default nothing is written)")
    p.add_argument("--tolerance", type=float, default=TOLERANCE, metavar="NATS",
                   help="with --quants: a type holds while its loss and KL rise at most this "
                        "(default: %(default)s)")


def _type_list(flag: str, text: str, allowed) -> list[str]:
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    if names == ["none"] and flag == "--merged-types":
        return []
    bad = [t for t in names if t not in allowed]
    if bad or not names:
        raise ToygraphError(f"{flag} {text!r}: {'unknown type ' + repr(bad[0]) if bad else 'no type'}"
                            f"; choose among {', '.join(allowed)}")
    return names


def refuse_report_flags(args) -> None:
    """The report's flags do nothing without --quants: said, not ignored."""
    for flag, given in (("--merged-types", args.merged_types != ",".join(MERGED_TYPES)),
                        ("--write-quants", args.write_quants is not None),
                        ("--tolerance", args.tolerance != TOLERANCE)):
        if given:
            raise ToygraphError(f"{flag} is for the fidelity report: give --quants too")


def cmd_fidelity(args) -> int:
    from toygraph.cli.args import eval_sequences, language_model_from_args
    from toygraph.inference.fidelity import fidelity_report
    if args.adapter is None:
        raise ToygraphError("--quants needs --adapter: the report compares an adapter's "
                            "requantized and merged forms with the pair it was trained as")
    if not args.tolerance >= 0:
        raise ToygraphError(f"--tolerance must be a number >= 0, got {args.tolerance}")
    quants = _type_list("--quants", args.quants, QUANTS)
    merged = _type_list("--merged-types", args.merged_types, MERGED_TYPES)
    lm = language_model_from_args(args)   # checks model, adapter and flags; its tokenizer
    # the flags' text, ids or data file, else the run directory's validation split
    given = eval_sequences(args, lm)
    if given is None:
        from toygraph.training.validation import run_validation
        given = run_validation(args.adapter, lm.tokenizer)
    sequences, masks = given
    if args.write_quants:   # first: a file in the way is said before the report's passes
        _write_quants(lm.model.path, quants, Path(args.write_quants))
    report = fidelity_report(lm.model.path, args.adapter, sequences, masks, quants=quants,
                             merged_types=merged, tolerance=args.tolerance,
                             backend=args.backend, precision=args.precision,
                             template=args.template,
                             progress=lambda text: print(text, file=sys.stderr))
    if args.json:   # a candidate whose numbers overflow: null, as JSON has no nan
        rows = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in vars(r).items()} for r in report.rows]
        print(json.dumps({"tokens": report.tokens, "tolerance": report.tolerance,
                          "verdict": report.verdict(), "rows": rows}, allow_nan=False))
    else:
        print(report.table())
        print(report.verdict())
    return 0


def _write_quants(model_path: Path, quants: list[str], folder: Path) -> None:
    """--write-quants: each requantized base as a file; an existing one is not replaced."""
    from toygraph.inference.fidelity import write_requantized
    outs = [folder / f"{model_path.stem}.{q}.gguf" for q in quants]
    for out in outs:
        if out.exists() or out.is_symlink():
            raise ToygraphError(f"--write-quants: {out} exists; remove it or choose another "
                                "folder")
    folder.mkdir(parents=True, exist_ok=True)
    for q, out in zip(quants, outs):
        write_requantized(model_path, q, out)
        print(f"wrote {out} ({out.stat().st_size / 2**20:,.1f} MiB)", file=sys.stderr)


#: Rows of the run's data ``toygraph export`` checks the merged file on, by default.
CHECK_ROWS = 16


def _rows(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return n


def add_check_arg(p) -> None:
    """``--check N`` of ``toygraph export``."""
    p.add_argument("--check", type=_rows, default=CHECK_ROWS, metavar="N",
                   help="evaluate the merged file against base + adapter on N rows of the run's "
                        "validation split (else its training data) and print both losses and "
                        "the KL; 0 = no check (default: %(default)s)")


def print_merge_check(args, model_path, out, say=print) -> None:
    """``toygraph export``'s check of the file it wrote (``--check`` rows of the run's data),
    or a line saying why there is none."""
    from toygraph.inference.fidelity import merge_check
    from toygraph.inference.language_model import LanguageModel
    from toygraph.training.run_file import RUN_FILE
    from toygraph.training.validation import run_sample
    if args.check == 0:
        return
    if not (Path(args.adapter) / RUN_FILE).is_file():
        say(f"not checked: {args.adapter} is not a run directory (no {RUN_FILE}), so there is "
            f"no run data; `toygraph eval --adapter DIR --quants q8_0 --data FILE` checks an "
            f"adapter's merges on a file of yours")
        return
    tok = LanguageModel(model_path, adapter_dir=args.adapter, template=args.template).tokenizer
    try:
        sequences, masks, what = run_sample(args.adapter, tok, args.check)
    except DataError as e:   # the file is written: a check with no rows to run is said, not failed
        say(f"not checked: {e}")
        return
    check = merge_check(model_path, args.adapter, out, sequences, masks, template=args.template)
    say(f"check on {what}: {check.text()}")
