"""The `kiln` command line: export a model, inspect a .kiln file, run it.

    kiln export model.py:make -o model.kiln
    kiln inspect model.kiln
    kiln run model.kiln --random --dim seq=16

Each command lives in its own module with `add_parser(subparsers)` and `run(args) -> exit code`. Importing this
package (and running `inspect` or `run`) never imports torch: only `export` does, inside its `run`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from kiln.cli import (
    bench_cmd,
    chat_cmd,
    classify_cmd,
    detect_cmd,
    export_cmd,
    export_llm_cmd,
    export_multimodal_cmd,
    export_parakeet_cmd,
    export_whisper_cmd,
    generate_cmd,
    inspect_cmd,
    ops_cmd,
    run_cmd,
    serve_cmd,
    transcribe_cmd,
)
from kiln.cli.common import CliError, error
from kiln.errors import (
    BackendUnavailableError,
    FileFormatError,
    InputError,
    KilnError,
    ProgramFormatError,
    TorchExportError,
    UnsupportedOpsError,
)

COMMANDS = (export_cmd, export_llm_cmd, export_whisper_cmd, export_parakeet_cmd, export_multimodal_cmd,
            inspect_cmd,
            run_cmd, bench_cmd, ops_cmd, classify_cmd, detect_cmd, generate_cmd, chat_cmd, transcribe_cmd, serve_cmd)

USER_ERRORS = (CliError, UnsupportedOpsError, TorchExportError, InputError, ProgramFormatError, FileFormatError,
               BackendUnavailableError)
"""Errors the user can fix from the message alone: printed without a traceback, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    from kiln import __version__

    parser = argparse.ArgumentParser(
        prog="kiln", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Export a PyTorch model to one .kiln file and run it without PyTorch.",
        epilog="examples:\n"
               "  kiln export model.py:make -o model.kiln     # needs torch\n"
               "  kiln inspect model.kiln\n"
               "  kiln run model.kiln -i x.npy -o outputs/\n\n"
               "Run `kiln COMMAND --help` for each command's options.")
    parser.add_argument("--version", action="version", version=f"kiln {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


PROGRESS_LOGGERS = ("kiln.runtime.cuda",)
"""Loggers whose INFO lines a command shows on stderr: the GPU backend's first compile of its kernels on a machine
(tens of seconds, once) would otherwise look like a hang."""


class _Stderr(logging.StreamHandler):
    """A handler that writes to sys.stderr as it is when a line is logged (main may run in-process, under a
    caller's redirected stderr)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def show_progress() -> None:
    """Give PROGRESS_LOGGERS a stderr handler at INFO, once (a command that sets up logging itself keeps its own)."""
    for name in PROGRESS_LOGGERS:
        logger = logging.getLogger(name)
        if not logger.handlers:
            handler = _Stderr()
            handler.setFormatter(logging.Formatter("kiln: %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with `argv` (default: sys.argv[1:]); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors: argparse has printed what to say
        return e.code if isinstance(e.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    show_progress()
    threads = getattr(args, "threads", None)
    before = os.environ.get("KILN_THREADS")
    if threads is not None:  # every session the command opens (and an engine process it starts) takes it
        os.environ["KILN_THREADS"] = str(threads)
    try:
        return args.handler(args)
    except USER_ERRORS as e:
        error(args.command, str(e))
        return 2
    except KilnError as e:  # a kernel failed at run time: not the user's input, but still no traceback
        error(args.command, str(e))
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if threads is not None:  # (main may run in-process: leave the environment as it was)
            if before is None:
                os.environ.pop("KILN_THREADS", None)
            else:
                os.environ["KILN_THREADS"] = before


__all__ = ["build_parser", "main"]
