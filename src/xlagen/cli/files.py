"""Files of the command line: prompts in (.txt / .jsonl / stdin, UTF-8 checked with file and line) and
an output file replaced only when the work succeeded. Free of TensorFlow, so that the `prepare` hooks
(see xlagen.cli.__main__) run these checks before TensorFlow is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xlagen.cli.common import UsageError


@dataclass(frozen=True)
class Prompt:
    """One input: the text, and the other keys of its JSONL record (carried into the output).

    Attributes:
        text: The prompt.
        extra: Other keys of the input record, in their order.
    """

    text: str
    extra: dict[str, Any] = field(default_factory=dict)


def _parse_jsonl(lines: Iterator[str], source: str) -> list[Prompt]:
    """Reads JSONL records holding a "prompt" string; blank lines are skipped."""
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise UsageError(f"{source}:{number}: not valid JSON ({error.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise UsageError(f'{source}:{number}: expected a JSON object with a "prompt" string')
        prompts.append(Prompt(record["prompt"], {k: v for k, v in record.items() if k != "prompt"}))
    return prompts


def _decode(data: bytes, source: str) -> str:
    """UTF-8 text (a leading byte-order mark dropped); a UsageError naming the file and line otherwise."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise UsageError(f"{source}:{line}: not UTF-8 text (byte 0x{data[error.start]:02x}): save the prompts "
                         "as UTF-8") from None


def _read_input(path: str, input_format: str | None) -> list[Prompt]:
    """Reads prompts from a .txt or .jsonl file, or from stdin for `-`."""
    if input_format is None:
        input_format = "jsonl" if path != "-" and Path(path).suffix.lower() in (".jsonl", ".ndjson") else "txt"
    if path == "-":
        source, data = "<stdin>", sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    else:
        source = path
        try:
            data = Path(path).read_bytes()
        except OSError as error:
            raise type(error)(f"cannot read the prompts file --input {path}: {error.strerror or error}") from error
    text = data if isinstance(data, str) else _decode(data, source)
    if input_format == "jsonl":
        return _parse_jsonl(iter(text.splitlines()), source)
    return [Prompt(line) for line in text.splitlines() if line.strip()]


def read_prompts(args: argparse.Namespace) -> list[Prompt]:
    """Collects the prompts of the command line or of `--input`.

    Args:
        args: The parsed `generate` arguments.

    Returns:
        The prompts, in order.

    Raises:
        UsageError: If there are no prompts, both sources are given, a prompt is empty, a JSONL
            line is malformed or the input is not UTF-8 (naming the file and line).
        OSError: If the input file cannot be read.
    """
    if args.prompts and args.input is not None:
        raise UsageError("give prompts as arguments or with --input, not both")
    prompts = _read_input(args.input, args.input_format) if args.input is not None else [
        Prompt(text) for text in args.prompts]
    if not prompts:
        raise UsageError("no prompts: give them as arguments or with --input FILE (- for stdin)")
    for number, prompt in enumerate(prompts, 1):
        if not prompt.text:
            raise UsageError(f"prompt {number} is empty")
    return prompts


def check_output(path: str | None) -> None:
    """Checks that `--output` names a file that can be written (its folder exists and is writable).

    Raises:
        IsADirectoryError, FileNotFoundError, PermissionError: naming the path and what to do.
    """
    if path in (None, "-"):
        return
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise IsADirectoryError(f"--output {path} is a folder: give a file name such as {target / 'out.jsonl'}")
    if not folder.is_dir():
        raise FileNotFoundError(f"--output {path}: the folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise PermissionError(f"--output {path}: no permission to write there; choose another path")


@contextmanager
def open_output(path: str):
    """A text stream for `path`: a temporary file beside it, moved onto `path` when the block ends
    without error and deleted otherwise (an existing file stays untouched)."""
    target = Path(path)
    stream = tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=target.parent,  # noqa: SIM115
                                         prefix=f".{target.name}.", suffix=".partial", delete=False)
    try:
        with stream:
            yield stream
        mode = target.stat().st_mode & 0o777 if target.exists() else 0o666 & ~_umask()
        os.chmod(stream.name, mode)  # mkstemp's files are private (0600); give the usual permissions.
        os.replace(stream.name, target)
    except BaseException:
        Path(stream.name).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
