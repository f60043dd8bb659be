"""Flags and checks several commands share: the backend and precision, the sampling flags,
the model and adapter a command runs, and command-line text checked as UTF-8."""
from __future__ import annotations

import math

from toygraph.adapters.merge import ADAPTER_FORMS
from toygraph.bounded import excerpt, terminal_text, utf8_error
from toygraph.errors import ToygraphError
from toygraph.inference.sampling import SamplingOptions
from toygraph.models.catalog import model_forms, resolve_model


def utf8(flag: str, text: str) -> str:
    """Command-line text as valid Unicode: undecodable bytes in argv arrive as lone
    surrogates (Python's surrogateescape), which no tokenizer can encode."""
    why = utf8_error(text)
    if why:
        raise ToygraphError(f"{flag} is not valid UTF-8 text ({why})")
    return text


def add_model_arg(p, what: str = "") -> None:
    """``--model`` (required): a path or any name resolve_model takes, listed from the
    catalog itself."""
    p.add_argument("--model", required=True, help=f"{what}{model_forms()}")


def add_adapter_arg(p) -> None:
    """``--adapter``: the adapter eval, generate and chat apply (none: the base alone)."""
    p.add_argument("--adapter", help=f"the LoRA adapter to apply: {ADAPTER_FORMS} (default: "
                                     "none, the base model alone)")


def add_system_arg(p, what: str) -> None:
    """``--system``: the system message chat and generate put before the user's."""
    p.add_argument("--system", help=f"system message {what}, rendered by the chat template "
                                    "(default: none)")


def parse_ids(text: str) -> list[int]:
    """``--tokens``: comma-separated token ids."""
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ToygraphError(f"--tokens must be comma-separated integers, got {text!r}") from None


def add_backend_args(p, precision: bool = True) -> None:
    """``--backend`` and ``--precision`` (the matmuls' input precision), with the defaults of
    RecipeOptions and the choices of session.py, for every command that runs a model."""
    from toygraph.precision import BACKENDS, PRECISIONS
    from toygraph.recipes import RecipeOptions
    p.add_argument("--backend", default=RecipeOptions.backend, choices=list(BACKENDS),
                   help="where to compute: cpu (numpy and the CPU engine) or cuda (an NVIDIA "
                        "GPU)")
    if precision:
        p.add_argument("--precision", default=RecipeOptions.precision, choices=list(PRECISIONS),
                       help="matmul input precision (bf16/tf32: CUDA tensor cores, f32 "
                            "accumulation, f32 everything else)")


def add_threads_arg(p) -> None:
    """``--threads``: the threads the CPU engine and BLAS compute with (main sets them)."""
    p.add_argument("--threads", type=int, metavar="N",
                   help="threads to compute with on the CPU: the engine's decoders and "
                        "products, and BLAS (default: $TOYGRAPH_THREADS, else the CPUs this "
                        "process may use)")


def use_threads_of(args) -> None:
    """Compute with the threads ``--threads`` asks for (a command that has the flag)."""
    if not hasattr(args, "threads"):
        return
    if args.threads is not None and args.threads < 1:
        raise ToygraphError(f"--threads must be at least 1, got {args.threads}")
    from toygraph.cpu import engine
    engine.use_threads(args.threads)


def add_allow_merged_arg(p) -> None:
    """``--allow-merged``: apply an adapter the model already has merged in."""
    p.add_argument("--allow-merged", action="store_true",
                   help="apply the adapter even though the model already has it merged in "
                        "(its update then counts twice)")


def add_other_base_arg(p) -> None:
    """``--other-base``: apply an adapter that records another base model."""
    p.add_argument("--other-base", action="store_true",
                   help="apply the adapter even though it records another base model "
                        "(a one-line warning instead of the refusal)")


def add_template_arg(p) -> None:
    """``--template``: the chat template conversations are rendered with."""
    p.add_argument("--template", metavar="NAME|FILE",
                   help="chat template: gguf (the model's own), alpaca, chatml, or a Jinja file "
                        "(default: the adapter's, else the model's own, else alpaca)")


def language_model_from_args(args):
    """The LanguageModel of eval, generate and chat: --model, --adapter, --backend,
    --precision, --template."""
    from toygraph.precision import precision_error
    from toygraph.inference.language_model import LanguageModel
    why = precision_error(args.precision, args.backend)
    if why:
        raise ToygraphError(f"--precision {why}")
    return LanguageModel(resolve_model(args.model), adapter_dir=args.adapter,
                         backend=args.backend, precision=args.precision,
                         template=getattr(args, "template", None),
                         allow_merged=getattr(args, "allow_merged", False),
                         other_base=getattr(args, "other_base", False))


#: Tokens ``generate`` and ``chat`` produce at most unless --max-new-tokens says otherwise:
#: enough for a function with its docstring, or a few paragraphs.
MAX_NEW_TOKENS = 256
#: numpy's generators take seeds of 0 .. 2**128 - 1; a seed past 2**63 is surely a typo.
MAX_SEED = 2**63 - 1


def eval_sequences(args, lm) -> tuple[list, list | None] | None:
    """(sequences, target masks) of ``toygraph eval``'s --tokens, --text or --data (None
    when none is given), tokenized by ``lm``'s tokenizer."""
    if args.tokens is not None:
        return [parse_ids(args.tokens)], None
    if args.text is not None:
        return [lm.tokenizer.encode(utf8("--text", args.text), add_bos=None)], None
    if args.data is None:
        return None
    from toygraph.data.batches import encode_dataset
    from toygraph.data.examples import load_examples
    from toygraph.files import check_regular_file
    check_regular_file(args.data, "--data")   # a FIFO or a device would hang the reader
    enc = encode_dataset(load_examples(args.data), lm.tokenizer, lm.cfg.n_ctx - 1)
    if not enc.items:
        raise ToygraphError(f"{args.data}: no example has a target token")
    return [e.tokens for e in enc.items], [e.target_mask for e in enc.items]


def add_sampling_args(p) -> None:
    """The sampling flags of ``toygraph generate`` and ``toygraph chat``."""
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 = greedy (always the likeliest token)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample among the K likeliest tokens only; 0 = off")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the likeliest tokens holding this much probability; 1 = off")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than this times the likeliest one; 0 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide the logits of tokens already in the text by this; 1 = off")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the sampler (the same seed gives the same text)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when the output contains TEXT (repeatable; default: only the "
                        "model's end-of-turn token)")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS,
                   help="stop after this many new tokens (the end says when it stopped there)")
    p.add_argument("--no-kv-cache", dest="kv_cache", action="store_false",
                   help="rerun the whole window per token instead of decoding over a KV "
                        "cache (same output, much slower; for testing)")


def check_sampling_args(args) -> None:
    """Each sampling flag in its range, refused in one line naming the flag: argparse
    takes ``1e308``, ``nan`` and ``-1`` as numbers, and --stop bytes that are not UTF-8."""
    finite = math.isfinite
    rules = [("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 0, ">= 0"),
             ("--temperature", args.temperature,
              finite(args.temperature) and args.temperature >= 0, "a finite number >= 0"),
             ("--top-k", args.top_k, args.top_k >= 0, ">= 0 (0 = off)"),
             ("--top-p", args.top_p, finite(args.top_p) and 0 < args.top_p <= 1,
              "a number in (0, 1] (1 = off)"),
             ("--min-p", args.min_p, finite(args.min_p) and 0 <= args.min_p <= 1,
              "a number in [0, 1] (0 = off)"),
             ("--repetition-penalty", args.repetition_penalty,
              finite(args.repetition_penalty) and args.repetition_penalty > 0,
              "a finite number > 0 (1 = off)"),
             ("--seed", args.seed, 0 <= args.seed <= MAX_SEED, f"an integer in 0 .. {MAX_SEED}")]
    for flag, value, ok, rule in rules:
        if not ok:
            raise ToygraphError(f"{flag} must be {rule}, got {excerpt(value)}")
    for text in args.stop:
        utf8("--stop", text)
        if not text:
            raise ToygraphError("--stop must be a non-empty text")


def generation_kwargs(args, print_to=None) -> dict:
    """``LanguageModel.generate`` keyword arguments from the flags of add_sampling_args;
    with ``print_to`` (a text stream), the text is written there as it is produced."""
    kwargs = {f: getattr(args, f) for f in SamplingOptions.__dataclass_fields__}
    kwargs.update(max_new_tokens=args.max_new_tokens, stop=args.stop, kv_cache=args.kv_cache)
    if print_to is not None:
        # a vocabulary token may hold escape sequences (a clipboard write): shown escaped
        kwargs["on_text"] = lambda piece: (print_to.write(terminal_text(piece)), print_to.flush())
    return kwargs
