"""The argument parser every ``toygraph`` command uses: argparse with abbreviations off
(``--step`` is not taken for ``--steps``), each option's default in its help line, and an
unknown option named under the command's own usage with the known one it probably meant.

>>> build_parser().parse_args(["generate", "--promt", "hi"])     # doctest: +SKIP
usage: toygraph generate [-h] --model MODEL ...
toygraph generate: error: unknown --promt; did you mean --prompt?
"""
from __future__ import annotations

import argparse
import difflib
import sys


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already says its
    default, the option is required, or it is a flag (``store_true``: off unless given)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.help is argparse.SUPPRESS or "default" in text or action.required \
                or action.nargs == 0 or action.default in (None, argparse.SUPPRESS, [], ()):
            return text
        value = action.default
        shown = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
        return f"{text} (default: {shown.replace('%', '%%')})"


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` (sub-parsers are made of the same class) with
    ``allow_abbrev=False`` and :class:`DefaultsHelpFormatter`. A command's parser refuses an
    unknown option before anything else is checked, so ``generate --promt hi`` names
    ``--promt`` and ``--prompt`` instead of only saying that --prompt is required."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        if self._subparsers is not None:   # the top level: its options, then the command's
            command = next((i for i, a in enumerate(args) if not a.startswith("-")), len(args))
            self._refuse_unknown_options(args[:command])
            return super().parse_known_args(args, namespace)
        # a command: every argument it gets is its own, so anything left over is said
        # here, under this command's usage, not the top level's
        self._refuse_unknown_options(args)
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unexpected argument{'s' if len(extras) > 1 else ''}: {' '.join(extras)}")
        return namespace, extras

    def _refuse_unknown_options(self, args: list[str]) -> None:
        for arg in args:
            if arg == "--":   # what follows is positional
                return
            name = arg.split("=", 1)[0]
            if self._is_option_like(arg) and name not in self._option_string_actions:
                self.error(f"unknown {name}; {self._nearest(name)}")

    def _is_option_like(self, arg: str) -> bool:
        """Whether argparse would read ``arg`` as an option, not a value: a leading dash,
        no space, and not a negative number (argparse's own rules)."""
        if len(arg) < 2 or arg[0] not in self.prefix_chars or " " in arg:
            return False
        return not (self._negative_number_matcher.match(arg)
                    and not self._has_negative_number_optionals)

    def _nearest(self, name: str) -> str:
        known = [o for o in self._option_string_actions if o.startswith("--")]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        if close:
            return f"did you mean {close[0]}?"
        return f"`{self.prog} --help` lists the options"
