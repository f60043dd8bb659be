"""``toygraph chat``: an interactive multi-turn chat over stdin (toygraph.inference.chat)."""
from __future__ import annotations

import sys

from toygraph.cli.args import (add_adapter_arg, add_allow_merged_arg, add_backend_args,
                               add_model_arg, add_other_base_arg, add_sampling_args,
                               add_system_arg, add_template_arg, check_sampling_args,
                               generation_kwargs, language_model_from_args, utf8)
from toygraph.inference.chat import chat_loop


def add_chat_parser(sub) -> None:
    p = sub.add_parser("chat", help="interactive multi-turn chat (reads stdin)")
    add_model_arg(p)
    add_adapter_arg(p)
    add_system_arg(p, "to start every conversation with")
    add_sampling_args(p)
    add_backend_args(p)
    add_template_arg(p)
    add_allow_merged_arg(p)
    add_other_base_arg(p)
    p.set_defaults(fn=_cmd_chat)


def _cmd_chat(args) -> int:
    check_sampling_args(args)
    system = utf8("--system", args.system) if args.system is not None else None
    if hasattr(sys.stdin, "reconfigure"):   # undecodable bytes reach chat_loop, which says so
        sys.stdin.reconfigure(errors="surrogateescape")
    lm = language_model_from_args(args)
    try:
        return chat_loop(lm, sys.stdin, sys.stdout, system=system, **generation_kwargs(args))
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        return 0
