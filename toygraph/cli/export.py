"""``toygraph export``: merge a LoRA adapter into the base GGUF (toygraph.adapters.merge)."""
from __future__ import annotations

from toygraph.adapters.merge import OUT_TYPES, export_merged
from toygraph.models.catalog import resolve_model


def add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="merge a LoRA adapter into the base GGUF")
    p.add_argument("--model", required=True, help="base GGUF file, or 'smollm2'")
    p.add_argument("--adapter", required=True,
                   help="run directory (PEFT files), or a llama.cpp adapter .gguf")
    p.add_argument("--out", required=True, help="merged GGUF to write")
    p.add_argument("--type", default="f16", choices=OUT_TYPES,
                   help="type of the merged weights; other tensors keep theirs")
    p.set_defaults(fn=_cmd_export)


def _cmd_export(args) -> int:
    out = export_merged(resolve_model(args.model), args.adapter, args.out, args.type)
    print(f"wrote {out}")
    return 0
