"""The ``butter`` command line: each subcommand is a module with ``add_parser`` and ``run``.

Text goes to stdout, progress, warnings and errors to stderr. Exit codes: 0 on success,
2 on usage errors and bad input (a one-line message, no traceback), 1 when the reader of
stdout went away (``butter generate ... | head``), 130 on Ctrl-C (one line, no traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from butter_core.cli import bench_cmd, generate_cmd, inspect_cmd, plugins_cmd, quality_cmd, serve_cmd
from butter_core.errors import ButterError, ButterWarning

COMMANDS = [generate_cmd, serve_cmd, inspect_cmd, plugins_cmd, bench_cmd, quality_cmd]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="butter", description="MLX LLM inference with pluggable KV caches")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("always", ButterWarning)
        warnings.showwarning = _one_line_warnings(args.command, warnings.showwarning)
        try:
            return args.run(args) or 0
        except ButterError as exc:
            print(f"butter {args.command}: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"{chr(10) if sys.stderr.isatty() else ''}butter {args.command}: interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:
            # Python would report the closed pipe again when it flushes stdout at exit.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1


def _one_line_warnings(command: str, show):
    """``warnings.showwarning`` that prints butter's own warnings as ``butter CMD: warning: ...``."""

    def show_warning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, ButterWarning):
            print(f"butter {command}: warning: {message}", file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)

    return show_warning
