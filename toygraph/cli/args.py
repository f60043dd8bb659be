"""Flags and checks several commands share: the backend and precision, the sampling flags,
the model and adapter a command runs, and command-line text checked as UTF-8."""
from __future__ import annotations

from toygraph.bounded import utf8_error
from toygraph.errors import ToygraphError
from toygraph.inference.sampling import SamplingOptions
from toygraph.models.catalog import resolve_model


def utf8(flag: str, text: str) -> str:
    """Command-line text as valid Unicode: undecodable bytes in argv arrive as lone
    surrogates (Python's surrogateescape), which no tokenizer can encode."""
    why = utf8_error(text)
    if why:
        raise ToygraphError(f"{flag} is not valid UTF-8 text ({why})")
    return text


def parse_ids(text: str) -> list[int]:
    """``--tokens``: comma-separated token ids."""
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ToygraphError(f"--tokens must be comma-separated integers, got {text!r}") from None


def add_backend_args(p, precision: bool = True) -> None:
    """``--backend`` and ``--precision`` (the matmuls' input precision), with the defaults of
    RecipeOptions and the choices of session.py, for every command that runs a model."""
    from toygraph.core.precision import BACKENDS, PRECISIONS
    from toygraph.recipes import RecipeOptions
    p.add_argument("--backend", default=RecipeOptions.backend, choices=list(BACKENDS))
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


def add_template_arg(p) -> None:
    """``--template``: the chat template conversations are rendered with."""
    p.add_argument("--template", metavar="NAME|FILE",
                   help="chat template: gguf (the model's own), alpaca, chatml, or a Jinja file "
                        "(default: the adapter's, else the model's own, else alpaca)")


def language_model_from_args(args):
    """The LanguageModel of eval, generate and chat: --model, --adapter, --backend,
    --precision, --template."""
    from toygraph.core.precision import precision_error
    from toygraph.inference.language_model import LanguageModel
    why = precision_error(args.precision, args.backend)
    if why:
        raise ToygraphError(f"--precision {why}")
    return LanguageModel(resolve_model(args.model), adapter_dir=args.adapter,
                         backend=args.backend, precision=args.precision,
                         template=getattr(args, "template", None),
                         allow_merged=getattr(args, "allow_merged", False))


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
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when the output contains TEXT (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--no-kv-cache", dest="kv_cache", action="store_false",
                   help="rerun the whole window per token instead of decoding over a KV "
                        "cache (same output, much slower; for testing)")


def generation_kwargs(args, print_to=None) -> dict:
    """``LanguageModel.generate`` keyword arguments from the flags of add_sampling_args;
    with ``print_to`` (a text stream), the text is written there as it is produced."""
    kwargs = {f: getattr(args, f) for f in SamplingOptions.__dataclass_fields__}
    kwargs.update(max_new_tokens=args.max_new_tokens, stop=args.stop, kv_cache=args.kv_cache)
    if print_to is not None:
        kwargs["on_text"] = lambda piece: (print_to.write(piece), print_to.flush())
    return kwargs
