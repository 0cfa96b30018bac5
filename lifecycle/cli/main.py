"""The ``kvlife`` command line.

Each subcommand is one file in ``commands/`` exposing ``register(sub)``; the grammar they
share (one-line errors, ``--stack``, ``--json``, defaults in help) is in ``parsing``.
Exit codes: 0 ok, 1 a check found a problem, 2 bad input (one line on stderr),
130 interrupted (Ctrl-C), 143 terminated (SIGTERM).
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from kvlife.lifecycle.cli import commands
from kvlife.lifecycle.cli.extras import OPTIONAL_EXTRAS, MissingExtra
from kvlife.lifecycle.cli.parsing import KvlifeParser, UsageError, iter_parsers, one_line
from kvlife.lifecycle.config import ConfigError
from kvlife.lifecycle.profiles.catalog import ProfileError
from kvlife.lifecycle.traces.trace import TraceError
from kvlife.lifecycle.workloads.mooncake import WorkloadError
from kvlife.policies.base import PolicyError

__all__ = ["USER_ERRORS", "UsageError", "build_parser", "main"]

USER_ERRORS = (ConfigError, WorkloadError, PolicyError, TraceError, ProfileError)

# The order `kvlife --help` lists the commands in; a new file in commands/ comes after these.
TRACEBACK_HELP = ("when a policy's own code fails (import, constructor, hook), also print its Python traceback "
                  "after the one-line error (default: off)")
ORDER = ("run", "compare", "replay", "validate", "check", "explain", "export", "plot", "spec", "policies", "bench")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvlife")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


class _VersionAction(argparse._VersionAction):
    """``--version``: reads the installed metadata only when asked (importlib.metadata costs
    every other command ~10 ms of startup)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        self.version = f"kvlife {_version()}"
        super().__call__(parser, namespace, values, option_string)


def build_parser(argv: Sequence[str] | None = None) -> KvlifeParser:
    """The whole command line; given ``argv`` whose first word is a command, only that
    command's parser is built (24 subcommands cost a run ~10 ms of startup)."""
    parser = KvlifeParser(prog="kvlife", description="KV-cache request lifecycle engine. "
                                                     "`kvlife COMMAND --help` for a command's flags.")
    parser.add_argument("--version", action=_VersionAction)
    parser.add_argument("--traceback", action="store_true", default=False, help=TRACEBACK_HELP)
    parser.set_defaults(func=lambda args: parser.missing_subcommand("a command"))
    sub = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    names = [info.name for info in pkgutil.iter_modules(commands.__path__)]
    first = next((word for word in argv or () if not word.startswith("-")), None)
    if first in names:
        names = [first]
    for name in sorted(names, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n)):
        importlib.import_module(f"{commands.__name__}.{name}").register(sub)
    for each in iter_parsers(parser):  # the deepest parser's prog wins: "kvlife bench engine"
        each.set_defaults(command_prog=each.prog)
        if each is not parser:  # --traceback anywhere on the line (SUPPRESS: the top one's default stands)
            each.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS, help=TRACEBACK_HELP)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from kvlife.lifecycle.drivers.interrupts import (
        exit_code,
        install_sigint_handler,
        install_sigterm_handler,
        signal_name,
    )

    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    install_sigterm_handler()  # SIGTERM raises Terminated, a KeyboardInterrupt
    install_sigint_handler()  # Ctrl-C raises Interrupted: marked, unlike a policy's own KeyboardInterrupt
    try:
        return _main(argv)
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: the drivers closed their traces
        print(f"kvlife: interrupted ({signal_name(exc)})", file=sys.stderr)
        return exit_code(exc)
    finally:
        # Called in-process (tests, a notebook): leave the caller's signal handling as it was.
        for signum, handler in previous.items():
            if handler is not None and signal.getsignal(signum) is not handler:
                signal.signal(signum, handler)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser(tuple(sys.argv[1:] if argv is None else argv))  # a tuple: callers may cache it
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the subcommand that refused them, as every other flag error is
        prog = getattr(args, "command_prog", parser.prog)
        hint = ('; --policy is gone: one --stack "a,b" names the whole stack'
                if any(u.split("=")[0] == "--policy" for u in unknown) else "")
        parser.exit(2, f"{prog}: error: unrecognized arguments: {' '.join(unknown)}{hint}\n")
    try:
        result: int = args.func(args)
        return result
    except MissingExtra as exc:
        print(f"kvlife: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except UsageError as exc:  # a flag value only the command can judge: named like argparse's errors
        print(f"{args.command_prog}: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except USER_ERRORS as exc:
        print(f"kvlife: error: {one_line(exc)}", file=sys.stderr)
        cause = exc.__cause__
        if getattr(args, "traceback", False) and isinstance(exc, PolicyError) and cause is not None:
            print("traceback of the policy's code:", file=sys.stderr)
            print("".join(traceback.format_exception(cause)), end="", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        from kvlife.lifecycle.sweeps.executors import ExecutorUnavailable

        if not isinstance(exc, ExecutorUnavailable):
            raise
        print(f"{args.command_prog}: error: {one_line(exc)}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (kvlife ... | head): stop quietly, and keep Python from
        # complaining again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except ModuleNotFoundError as exc:
        # A safety net behind extras.require: an optional dependency some code path needed.
        module = (exc.name or "").partition(".")[0]
        if module not in OPTIONAL_EXTRAS:
            raise
        print(f"kvlife: error: {args.command_prog} needs {module}: pip install 'kvlife[{OPTIONAL_EXTRAS[module]}]'",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
