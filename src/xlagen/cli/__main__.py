"""The `xlagen` command: `xlagen SUBCOMMAND [options]` (also `python -m xlagen.cli`).

Each subcommand is a module of this package listed in `SUBCOMMANDS`. It provides
`add_parser(subparsers, parents) -> argparse.ArgumentParser`, whose parser sets `run=<function>`
through `set_defaults`; `run(args) -> int` does the work and returns the exit code. Subcommand
modules import TensorFlow and the rest of xlagen lazily inside `run`, so that this module can
configure the environment and logging first.

Errors: a subcommand raises `OSError` or `ValueError` with a message for the user; `main` prints
`xlagen: error: <message>` (no traceback) and returns the exception's `exit_code` attribute if it
has one (2 for usage errors), else 1.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import os
import sys
from collections.abc import Sequence

PROG = "xlagen"
SUBCOMMANDS = ("generate", "transcribe", "hlo", "bench", "export", "aot")
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _version() -> str:
    """The installed distribution's version, read without importing xlagen's TensorFlow modules."""
    try:
        return importlib.metadata.version("xlagen")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """Builds the top-level parser with one sub-parser per module in `SUBCOMMANDS`.

    Returns:
        The parser; `parse_args` gives a namespace with `command`, `verbose`, `quiet` and `run`.
    """
    parser = argparse.ArgumentParser(prog=PROG, description="XLA-compiled text and speech generation with TensorFlow "
                                     "on Hugging Face checkpoints.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true",
                        help="log at INFO level (timings included) and keep TensorFlow's C++ messages")
    common.add_argument("-q", "--quiet", action="store_true", help="no progress bar and only errors in the log")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"xlagen.cli.{name}").add_parser(subparsers, [common])
    return parser


def _configure_environment(verbose: bool) -> None:
    """Silences TensorFlow's C++ INFO/WARNING messages unless asked to be verbose or the user chose a level.

    Must run before TensorFlow is imported: TensorFlow reads the variable once.
    """
    if not verbose:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _load_tensorflow_quietly() -> None:
    """Imports TensorFlow and initialises its devices with the native stderr pointed at /dev/null.

    TensorFlow 2.21 prints oneDNN / CUDA notices from C++ before its logging is set up, so
    TF_CPP_MIN_LOG_LEVEL cannot hide them; `--verbose` keeps them. Python errors are unaffected.
    """
    if "tensorflow" in sys.modules:
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            import tensorflow as tf

            tf.config.list_logical_devices("CPU")  # the CUDA probe happens here
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _configure_logging(verbose: bool, quiet: bool) -> int:
    """Sends log records to stderr; xlagen's own at INFO with --verbose, ERROR with --quiet.

    Returns:
        The previous level of the "xlagen" logger, for `main` to restore.
    """
    logging.basicConfig(format=_LOG_FORMAT, stream=sys.stderr)  # No-op if the host already set up logging.
    package_logger = logging.getLogger("xlagen")
    previous = package_logger.level
    package_logger.setLevel(logging.INFO if verbose else logging.ERROR if quiet else logging.WARNING)
    return previous


def _silence_stdout() -> None:
    """Points stdout at /dev/null so that flushing it at exit does not raise again (Python's SIGPIPE recipe)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (e.g. captured); nothing to protect.
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `xlagen` command line.

    Args:
        argv: Arguments without the program name; defaults to `sys.argv[1:]`.

    Returns:
        The exit code: 0 on success, 1 when the work failed, 2 for a usage error.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, or an argparse usage error (already printed).
        return exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    _configure_environment(args.verbose)
    if not args.verbose:
        _load_tensorflow_quietly()
    previous_level = _configure_logging(args.verbose, args.quiet)
    try:
        return args.run(args)
    except BrokenPipeError:  # `xlagen generate ... | head`: the reader left; not an error worth a message.
        _silence_stdout()
        return 1
    except (OSError, ValueError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return getattr(error, "exit_code", 1)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    finally:  # `main` may run several times in one process (tests, notebooks).
        logging.getLogger("xlagen").setLevel(previous_level)


if __name__ == "__main__":
    sys.exit(main())
