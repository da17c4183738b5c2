"""What several subcommands share: the usage error, the argument parser, argparse types for numbers, the
Hugging Face Hub options, the weight-dtype option and the built-in default model.

Only the standard library is imported at module level, so that the `prepare` hooks (see
xlagen.cli.__main__) can use these before TensorFlow is imported.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

SEED_MAX = 2**31 - 1  # seeds are int32 tensors
WEIGHT_DTYPE_HELP = ("bfloat16 / int8: the matrix products read their weights rounded to bfloat16 (about twice as "
                     "fast per token as float32 at batch 1) or quantized to int8 with a scale per output column "
                     "(2-5x, with a larger change to the logits), computing in float32, on a CPU with AVX-512 or "
                     "AVX2 + FMA (builds a C++ kernel once, on first use); default: float32")


class UsageError(ValueError):
    """A problem with the command line or the prompts (exit code 2)."""

    exit_code = 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser (its sub-parsers are of its class too) whose errors are one line on stderr, as every
    other error of the command: `xlagen: error: <message>`, exit code 2, without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog.split()[0]}: error: {message} (see {self.prog} --help)\n")


def _int_at_least(value: str, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if number < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {number}")
    return number


def positive_int(value: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(value, 1)


def non_negative_int(value: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(value, 0)


def _finite_float(value: str, minimum: float, inclusive: bool) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not (minimum <= number if inclusive else minimum < number) or not number < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number {'>=' if inclusive else '>'} {minimum:g}, "
                                         f"got {value}")
    return number


def non_negative_float(value: str) -> float:
    """argparse type: a finite number >= 0."""
    return _finite_float(value, 0.0, inclusive=True)


def positive_float(value: str) -> float:
    """argparse type: a finite number > 0 (seconds, sizes)."""
    return _finite_float(value, 0.0, inclusive=False)


def random_seed(value: str) -> int:
    """argparse type: a seed in [0, 2**31 - 1] (larger values would wrap around in int32)."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if not 0 <= number <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be between 0 and {SEED_MAX}, got {number}")
    return number


def int_list(value: str) -> tuple[int, ...]:
    """argparse type: comma-separated positive integers."""
    try:
        numbers = tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None
    if not numbers or min(numbers) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {value!r}")
    return numbers


def add_hub_arguments(group) -> None:
    """--revision, --cache-dir and --local-files-only on a parser or argument group."""
    group.add_argument("--revision", help="Hub branch, tag or commit")
    group.add_argument("--cache-dir", metavar="DIR", help="Hugging Face cache folder")
    group.add_argument("--local-files-only", action="store_true", help="never download; use the cache only")


def hub_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `from_pretrained` keyword arguments of `add_hub_arguments`' options."""
    return {"revision": args.revision, "cache_dir": args.cache_dir, "local_files_only": args.local_files_only}


def weight_dtypes() -> tuple[str, ...]:
    """The choices of --weight-dtype: float32 and the packed weight dtypes of xlagen's kernels."""
    from xlagen import native  # numpy only: TensorFlow is not loaded by this import

    return ("float32", *native.WEIGHT_DTYPES)


def add_weight_dtype_argument(group) -> None:
    """--weight-dtype (float32, bfloat16 or int8) on a parser or argument group."""
    group.add_argument("--weight-dtype", choices=weight_dtypes(), default="float32", help=WEIGHT_DTYPE_HELP)


def default_model_path() -> str | None:
    """The built-in default model (package data: a small GPT-2 trained on the King James Bible, whose model
    card is src/xlagen/default_model/README.md in the source repository), or None if this installation
    lacks it."""
    folder = Path(__file__).resolve().parents[1] / "default_model"
    return str(folder) if (folder / "model.safetensors").is_file() else None


# TensorFlow 2.21 logs two errors for every program it loads from its persistent XLA cache, which it then loads
# and runs: it tries the entry as a text proto before the binary one, and it compares the tuning features the
# compiler added (+prefer-no-scatter, +prefer-no-gather on AMD Zen) with the host's CPU features.
BENIGN_CACHE_LOG = (rb"^[EW]\d{4} [^\]]*text_format\.cc:\d+\] Error parsing text-format "
                    rb"tensorflow\.XlaSerializedCacheEntry",
                    rb"^[EW]\d{4} [^\]]*cpu_aot_loader\.cc:\d+\] Loading XLA:CPU AOT result\. Target machine feature "
                    rb"\+prefer-no-[a-z]+ is not +supported")
_LOG_LINE = re.compile(rb"^[IWEF]\d{4} ")


def drop_stderr_lines(patterns: tuple[bytes, ...]) -> None:
    """Drops the lines matching `patterns` from everything written to this process's stderr (file descriptor 2,
    so TensorFlow's C++ log too) from now on; the rest passes through as it is written.

    Only the command line calls this (without --verbose). A line is held back only while it may still be a
    C++ log line; other output (progress bars' carriage returns) passes at once.
    """
    import atexit
    import threading

    compiled = [re.compile(pattern) for pattern in patterns]
    sys.stderr.flush()
    target = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def forward() -> None:
        pending = b""
        while chunk := os.read(read_end, 65536):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            kept = [line + b"\n" for line in lines if not any(p.match(line) for p in compiled)]
            if pending and not _LOG_LINE.match(pending[:6]) and len(pending) >= 6:
                kept.append(pending)
                pending = b""
            if kept:
                os.write(target, b"".join(kept))
        if pending:
            os.write(target, pending)

    thread = threading.Thread(target=forward, name="xlagen-stderr", daemon=True)
    thread.start()

    def finish() -> None:  # the last lines, before the interpreter goes
        sys.stderr.flush()
        os.dup2(target, 2)
        thread.join(2)

    atexit.register(finish)
