"""The pieces of kvlife's command-line grammar that every subcommand shares.

* ``KvlifeParser``: an ``ArgumentParser`` whose errors are one line, ``PROG: error: MESSAGE``,
  exit code 2 (no usage dump), and whose help shows every flag's default.
* ``add_stack_flag``: ``--stack "a,b"``, one comma-separated stack. Single-stack commands
  refuse a second ``--stack``; ``compare`` takes it repeatedly, one column each.
* ``add_json_flag``: ``--json``, one JSON object on stdout (see ``kvlife.lifecycle.cli.output``).
* Value types that turn nonsense (``nan``, ``inf``, ``0``, ``-3``) into one-line errors.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from typing import Any, NoReturn

from kvlife.lifecycle.config import NON_NEGATIVE_INT, POSITIVE_INT, POSITIVE_NUMBER, TEXT


class UsageError(Exception):
    """A bad flag value the parser itself cannot catch: one line, exit code 2."""


def one_line(message: object) -> str:
    """An error message as one line, whatever a value quoted in it holds (a flag's value, a
    user policy's exception): line breaks become spaces."""
    return str(message).replace("\r\n", " ").replace("\r", " ").replace("\n", " ")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions keep their line breaks; every option with a real default shows it.

    A default of None or False (a flag that is off, an option whose absence means
    something) is described in the help text in words instead of "(default: None)".
    """

    def _split_lines(self, text: str, width: int) -> list[str]:
        # Never break inside a hyphenated word: flag names and policy names stay whole.
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        default = action.default
        if "%(default)" in help_text or "default" in help_text.lower():
            return help_text
        if default is None or default is False or default is argparse.SUPPRESS:
            return help_text
        if not action.option_strings:
            return help_text
        return f"{help_text} (default: %(default)s)"


class KvlifeParser(argparse.ArgumentParser):
    """Errors are one line, ``kvlife run: error: ...``, and exit 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if status == 2 and message:  # an error: one line, whatever the arguments held
            message = one_line(message.rstrip("\n")) + "\n"
        super().exit(status, message)

    def missing_subcommand(self, what: str) -> NoReturn:
        """``kvlife bench`` alone: the help that lists the choices, then the one error line."""
        self.print_help(file=sys.stderr)
        self.error(f"choose {what}")


def command_name(prog: str) -> str:
    """``"kvlife bench engine"`` -> ``"bench engine"``."""
    return prog.split(" ", 1)[1] if " " in prog else prog


# ---- value types ---------------------------------------------------------------------------
# Flags that mirror a config key take ``kvlife.lifecycle.config.flag_type(key)``; these are the
# same rules for flags of their own (``--limit``, ``--examples``), so a flag refuses ``nan``,
# ``inf``, ``0``, ``-3`` or ``2.5`` in the same words as a config file does.
def positive_int(text: str) -> int:
    """An integer >= 1 (and at most 2^63 - 1)."""
    value: int = POSITIVE_INT.parse(text)
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (and at most 2^63 - 1)."""
    value: int = NON_NEGATIVE_INT.parse(text)
    return value


def name_or_path(text: str) -> str:
    """A name or a file path: non-empty (``--workload ""`` is no workload, not the synthetic
    one) and without a NUL character (no file name holds one)."""
    value: str = TEXT.parse(text)
    if not value.strip():
        raise argparse.ArgumentTypeError(f"must name something, got {value!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0: ``nan``, ``inf`` and ``0`` are refused."""
    return float(POSITIVE_NUMBER.parse(text))


# ---- shared flags --------------------------------------------------------------------------
STACK_HELP = ('policy stack, comma-separated, top first: "async-lookup,shared-loads"; each entry a built-in '
              "name (kvlife policies), pkg.mod:Class or file.py:Class (loading one runs its module)")


class _SingleStack(argparse.Action):
    """Stores the one stack; counts how often it was given, so a second one is refused."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        count = getattr(namespace, "stack_given", 0) + 1
        if count > 1:
            name = command_name(parser.prog)
            parser.error(f"--stack given {count} times; {name} takes one stack (compare takes several)")
        namespace.stack_given = count
        setattr(namespace, self.dest, values)


def add_stack_flag(parser: argparse.ArgumentParser, *, repeated: bool = False, required: bool = False,
                   help_text: str = STACK_HELP, default_text: str = "baseline") -> None:
    if repeated:
        parser.add_argument("--stack", action="append", required=required, metavar="POLICIES",
                            help=f"{help_text}; repeat for one column per stack")
    else:
        parser.add_argument("--stack", action=_SingleStack, default=None, metavar="POLICIES",
                            help=f"{help_text} (default: {default_text})")


def add_json_flag(parser: argparse.ArgumentParser | Any, what: str = "the result") -> None:
    """``--json``: ``parser`` may be a mutually exclusive group."""
    parser.add_argument("--json", action="store_true",
                        help=f'print {what} as one JSON object ("kind", "schema": 1 first; see docs/cli.md)')


def iter_parsers(parser: argparse.ArgumentParser) -> Sequence[argparse.ArgumentParser]:
    """This parser and every subparser under it, depth first (tests walk them)."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for sub in action.choices.values():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    found.extend(iter_parsers(sub))
    return found
