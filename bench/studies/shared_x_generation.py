"""Generation with q, k, v and gate, up of one x as one engine call each (replay.SIBLINGS)
against the separate products, in one process, alternating, the same model and prompt.

    python bench/studies/shared_x_generation.py [GGUF ...] [--rounds 9] [--new 64]

Both models are loaded here, one with the sibling replays taken away before its graphs
compile; their greedy texts must be equal (the products give the same bits). Prints the
median tokens/s of each over the rounds and the load average.
"""
from __future__ import annotations

import argparse
import os

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", help="GGUF paths (default: SmolLM2 from the catalog)")
    ap.add_argument("--rounds", type=int, default=9, help="alternations (default 9)")
    ap.add_argument("--new", type=int, default=64, help="new tokens a generation (default 64)")
    args = ap.parse_args(argv)
    from toygraph.cpu import replay
    from toygraph.inference.language_model import LanguageModel
    from toygraph.models.catalog import smollm2_path
    prompt = "Tell me about the sea."
    for path in args.models or [str(smollm2_path())]:
        saved = dict(replay.SIBLINGS)
        replay.SIBLINGS.clear()
        separate = LanguageModel(path)
        text_separate = separate.generate(prompt, chat=True, max_new_tokens=args.new)
        replay.SIBLINGS.update(saved)
        together = LanguageModel(path)
        text_together = together.generate(prompt, chat=True, max_new_tokens=args.new)
        if text_separate != text_together:
            raise SystemExit(f"{path}: the two texts differ")
        rates: dict[str, list] = {"separate": [], "one x, one call": []}
        load = os.getloadavg()
        for _ in range(args.rounds):
            for name, lm in (("separate", separate), ("one x, one call", together)):
                lm.generate(prompt, chat=True, max_new_tokens=args.new)
                g = lm.last_generation
                rates[name].append(g["new_tokens"] / g["seconds"])
        a, b = (float(np.median(v)) for v in rates.values())
        print(f"{os.path.basename(path)}: separate {a:.1f} tok/s, one x one call {b:.1f} "
              f"tok/s ({b / a:.3f}x), medians of {args.rounds}; load {load[0]:.2f} at the "
              f"start; the same text")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
