"""The `xlagen` command: `xlagen SUBCOMMAND [options]` (also `python -m xlagen.cli`).

Each subcommand is a module of this package listed in `SUBCOMMANDS`. It provides
`add_parser(subparsers, parents) -> argparse.ArgumentParser`, whose parser sets through
`set_defaults`:

- `run=<function>`: `run(args) -> int` does the work and returns the exit code;
- optionally `prepare=<function>`: `prepare(args) -> None` runs BEFORE TensorFlow is imported. It
  makes the cheap checks (prompts given, input files readable and decodable, output writable) so
  that a mistake is reported in a fraction of a second, and sets what TensorFlow reads when it
  starts (environment variables such as TF_XLA_FLAGS). It must not import TensorFlow;
- optionally `configure_tensorflow=<function>`: `configure_tensorflow(args) -> None` runs right
  after TensorFlow is imported and before its devices start (e.g. thread pools, which cannot be
  changed afterwards);
- optionally `log_noise=<tuple of str>`: log records that contain one of these texts (warnings
  a library logs on every run, such as Apache Beam's) are dropped while the command runs, unless
  `--verbose` is given.

Subcommand modules import TensorFlow and the rest of xlagen lazily, so that `main` can run these
hooks, configure the environment and logging first.

Errors: every error is reported ONCE, as one line `xlagen: error: <message>` on stderr, with no
traceback unless `--verbose` is given (then the traceback comes first). The exit code is the
exception's `exit_code` attribute if it has one (2 for usage errors, as for argparse's), else 1.
argparse's own errors (an option's bad value, a missing or unknown argument) are one line too, without
its usage block (`common.ArgumentParser`), with exit code 2.
The documented error types of the library (`OSError`, `ValueError`, `TypeError`,
`xlagen.native.NativeUnavailable`) and TensorFlow's `tf.errors.OpError` print their message (only
its first line for an `OpError`, whose message continues with graph context); any other exception
is a bug: its type and first line are printed, with "run with --verbose for the traceback".
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence

from xlagen.cli.common import ArgumentParser

PROG = "xlagen"
SUBCOMMANDS = ("generate", "transcribe", "serve", "pipeline", "hlo", "bench", "export", "aot")
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The library's messages name its keyword arguments; the command line's user knows options.
_CLI_WORDING = (("local_files_only=True was passed", "--local-files-only was given"),
                ("local_files_only=False, ", "without --local-files-only, "))


def _version() -> str:
    """The installed distribution's version, read without importing xlagen's TensorFlow modules."""
    import importlib.metadata  # here: a Ctrl-C during the imports before `main` runs escapes its handling

    try:
        return importlib.metadata.version("xlagen")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """Builds the top-level parser with one sub-parser per module in `SUBCOMMANDS`.

    Returns:
        The parser; `parse_args` gives a namespace with `command`, `verbose`, `quiet` and `run`.
    """
    parser = ArgumentParser(prog=PROG, description="XLA-compiled text and speech generation with TensorFlow on "
                            "Hugging Face checkpoints.")
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


def _start_tensorflow(quiet: bool, configure: Callable[[], None] | None = None) -> None:
    """Imports TensorFlow, runs `configure` (settings that must precede its initialisation), then
    initialises its devices; with `quiet`, the native stderr points at /dev/null meanwhile.

    TensorFlow 2.21 prints oneDNN / CUDA notices from C++ before its logging is set up, so
    TF_CPP_MIN_LOG_LEVEL cannot hide them; `--verbose` keeps them. Python errors are unaffected (an
    exception raised by `configure` propagates, and is printed once stderr is back).
    """
    if "tensorflow" in sys.modules:  # Already running (tests, notebooks): settings may not apply any more.
        if configure is not None:
            configure()
        return
    sys.stderr.flush()
    saved = os.dup(2) if quiet else None
    try:
        if saved is not None:
            with open(os.devnull, "w") as devnull:
                os.dup2(devnull.fileno(), 2)
        import tensorflow as tf

        if configure is not None:
            configure()
        tf.config.list_logical_devices("CPU")  # the CUDA probe happens here
    finally:
        if saved is not None:
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


class _DropNoise(logging.Filter):
    """Drops the records whose message contains one of `texts`."""

    def __init__(self, texts: Sequence[str]):
        super().__init__()
        self.texts = tuple(texts)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in self.texts)


def _silence_stdout() -> None:
    """Points stdout at /dev/null so that flushing it at exit does not raise again (Python's SIGPIPE recipe)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (e.g. captured); nothing to protect.
        pass


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _cli_wording(message: str) -> str:
    """The message with the Python API's option names replaced by the command line's."""
    for api, cli in _CLI_WORDING:
        message = message.replace(api, cli)
    return message


def _describe(error: BaseException) -> tuple[str, int]:
    """(one-line message, exit code) of an exception that reached `main`."""
    native = sys.modules.get("xlagen.native")
    tensorflow = sys.modules.get("tensorflow")
    known: tuple[type, ...] = (OSError, ValueError, TypeError)
    if native is not None:
        known += (native.NativeUnavailable,)
    if isinstance(error, known):
        message = str(error).strip() or type(error).__name__
        return _cli_wording(" ".join(message.splitlines())), getattr(error, "exit_code", 1)
    if tensorflow is not None and isinstance(error, tensorflow.errors.OpError):
        return f"TensorFlow {type(error).__name__}: {_first_line(error)}", 1
    return f"unexpected {type(error).__name__}: {_first_line(error)} (run with --verbose for the traceback)", 1


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `xlagen` command line.

    A Ctrl-C (SIGINT) ends the command with exit code 130 and the line `xlagen: interrupted`, once what it
    printed is flushed (an `--output` file keeps its previous content). When `main` runs the process's own
    command line (`argv` None), further Ctrl-Cs are ignored while the process winds down (TensorFlow's
    teardown takes a while), so that the exit code stays 130.

    Args:
        argv: Arguments without the program name; defaults to `sys.argv[1:]`.

    Returns:
        The exit code: 0 on success, 1 when the work failed, 2 for a usage error, 130 when interrupted.
    """
    try:
        return _run(argv)
    except KeyboardInterrupt:
        return _interrupted(own_process=argv is None)


def _interrupted(own_process: bool) -> int:
    """Reports an interrupt; returns its exit code (130)."""
    if own_process and threading.current_thread() is threading.main_thread():
        # Python would exit by the signal itself (status -2) if a second KeyboardInterrupt escaped, and puts
        # its own handlers back to the default as it finalizes; an ignored signal stays ignored.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sys.stdout.flush()
    except (OSError, ValueError):  # A reader that left, or a closed stdout: nothing to flush to.
        pass
    print(f"{PROG}: interrupted", file=sys.stderr, flush=True)
    return 130


def _run(argv: Sequence[str] | None) -> int:
    """`main` but for interrupts."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, or an argparse usage error (already printed).
        return exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    _configure_environment(args.verbose)
    previous_level = _configure_logging(args.verbose, args.quiet)
    # On the root logger (records logged to it) and its handlers (records propagated from other loggers,
    # such as Beam's worker processes' records re-logged by its job service).
    noise = _DropNoise(() if args.verbose else getattr(args, "log_noise", ()))
    filtered = [logging.getLogger(), *logging.getLogger().handlers]
    for target in filtered:
        target.addFilter(noise)
    try:
        if getattr(args, "prepare", None) is not None:
            args.prepare(args)
        configure = getattr(args, "configure_tensorflow", None)
        _start_tensorflow(quiet=not args.verbose, configure=None if configure is None else lambda: configure(args))
        return args.run(args)
    except BrokenPipeError:  # `xlagen generate ... | head`: the reader left; not an error worth a message.
        _silence_stdout()
        return 1
    except Exception as error:  # noqa: BLE001 - every error becomes one line (see the module docstring).
        message, code = _describe(error)
        if args.verbose:
            traceback.print_exc(file=sys.stderr)
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return code
    finally:  # `main` may run several times in one process (tests, notebooks).
        logging.getLogger("xlagen").setLevel(previous_level)
        for target in filtered:
            target.removeFilter(noise)


if __name__ == "__main__":
    sys.exit(main())
