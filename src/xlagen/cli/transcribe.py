"""`xlagen transcribe`: audio files -> transcripts (txt, json, srt or vtt) with a Whisper checkpoint.

Each file is decoded as a whole (audio longer than 30 s in sequential windows, see `xlagen.speech.transcribe`),
with one compiled program reused for every window and file. Every FILE must exist and be a regular file, and
no two transcripts may go to the same output file (checked by `prepare` before TensorFlow is imported); a file
that cannot be decoded is reported, naming it, and the others are still transcribed (exit code 1 at the end).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from xlagen.cli.common import UsageError, add_hub_arguments, add_weight_dtype_argument, hub_options, positive_int

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "openai/whisper-tiny"
FORMATS = ("txt", "json", "srt", "vtt")


def add_parser(subparsers, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Registers `transcribe` on the `xlagen` sub-parsers (see `xlagen.cli.__main__`)."""
    parser = subparsers.add_parser("transcribe", parents=parents, help="transcribe or translate audio files",
                                   description="Transcribe (or translate to English) audio files with a Whisper "
                                   "checkpoint compiled with XLA. Reads wav/flac/ogg/mp3 at any sampling rate.")
    parser.add_argument("files", nargs="+", metavar="FILE", help="audio files")
    parser.add_argument("--model", "-m", default=DEFAULT_MODEL, metavar="PATH_OR_ID",
                        help=f"Whisper checkpoint folder or Hub id (default: {DEFAULT_MODEL}, downloaded once)")
    add_hub_arguments(parser)
    parser.add_argument("--language", help="language of the audio (code or name, e.g. fr or french); "
                        "default: detected from the first 30 s")
    parser.add_argument("--task", choices=("transcribe", "translate"),
                        help="transcribe, or translate to English (default: the model's, transcribe for "
                        "multilingual models; English-only models take no task)")
    parser.add_argument("--timestamps", action="store_true",
                        help="segment timestamps in txt output (json/srt/vtt always have them)")
    parser.add_argument("--format", "-f", choices=FORMATS, default="txt", help="output format (default: txt)")
    parser.add_argument("--output", "-o", metavar="PATH",
                        help="output file (one input) or folder (one FILE.<format> per input, named after the "
                        "input without its folder and extension: inputs with the same name are refused); "
                        "default: stdout")
    parser.add_argument("--num-beams", type=positive_int, metavar="K", help="beam search with K beams")
    parser.add_argument("--max-new-tokens", type=positive_int, metavar="N", help="token limit per 30 s window")
    add_weight_dtype_argument(parser)
    parser.set_defaults(run=run, prepare=prepare)
    return parser


def prepare(args: argparse.Namespace) -> None:
    """Checks, before TensorFlow is imported, that every audio file exists and is a readable regular file, and
    that no two transcripts would be written to the same file.

    Raises:
        FileNotFoundError, IsADirectoryError, PermissionError: naming the file(s).
        UsageError: naming two inputs whose transcripts would overwrite each other, and the output file.
    """
    missing = [f for f in args.files if not os.path.exists(f)]
    if missing:
        raise FileNotFoundError(f"audio file(s) not found: {', '.join(missing)}")
    for source in args.files:
        if os.path.isdir(source):
            raise IsADirectoryError(f"{source} is a folder, not an audio file")
        if not os.path.isfile(source) or not os.access(source, os.R_OK):
            raise PermissionError(f"{source} is not a readable regular file")
    written: dict[str, str] = {}
    for source in args.files:
        target = _destination(args, source)
        if target is None:
            continue
        key = os.path.normcase(os.path.abspath(target))
        if key in written:
            raise UsageError(f"{written[key]} and {source} would both be written to {target}: give the inputs "
                             "different names, or transcribe them into different --output folders")
        written[key] = source


def _destination(args: argparse.Namespace, source: str) -> Path | None:
    """Where the transcript of `source` goes: None for stdout; in a folder (several inputs, or an existing
    folder), the input's name without its folder and extension."""
    if args.output is None or args.output == "-":
        return None
    target = Path(args.output)
    if len(args.files) > 1 or target.is_dir():
        return target / f"{Path(source).stem}.{args.format}"
    return target


def run(args: argparse.Namespace) -> int:
    """Runs `xlagen transcribe`; returns 0, or 1 when a file could not be transcribed."""
    from tqdm import tqdm

    from xlagen.modeling import TFAutoModelForSpeechSeq2Seq
    from xlagen.speech.processing import WhisperProcessor
    from xlagen.speech.transcribe import Transcriber, render
    from xlagen.speech.whisper_decoding import check_options, language_id

    hub = hub_options(args)
    model = TFAutoModelForSpeechSeq2Seq.from_pretrained(args.model, weight_dtype=args.weight_dtype, **hub)
    processor = WhisperProcessor.from_pretrained(args.model, **hub)
    transcriber = Transcriber(model, processor)
    options = {key: value for key, value in (("num_beams", args.num_beams), ("max_new_tokens", args.max_new_tokens))
               if value is not None}
    if model.generation_config.is_multilingual is False:
        given = [f"--{name} {value}" for name, value in (("language", args.language), ("task", args.task)) if value]
        if given:
            raise UsageError(f"{' and '.join(given)}: '{args.model}' is an English-only Whisper model "
                             "(generation_config.json is_multilingual=false); it takes no language or task. "
                             "Leave the option out, or use a multilingual checkpoint.")
    try:
        config = model.generation_config.update(language=args.language, task=args.task, **options)
        check_options(config)
        if args.language is not None:
            language_id(args.language, config)
    except ValueError as error:
        raise UsageError(str(error)) from None
    failures = 0
    show = not args.quiet and sys.stderr.isatty()
    for source in args.files:
        bar = tqdm(total=1, desc=Path(source).name, unit="frame", disable=not show, leave=False)

        def progress(done: int, total: int, bar=bar) -> None:
            bar.total = total
            bar.update(done - bar.n)

        try:
            transcript = transcriber(source, language=args.language, task=args.task,
                                     return_timestamps=args.timestamps or args.format != "txt", progress=progress,
                                     **options)
        except (OSError, ValueError) as error:
            failures += 1
            print(f"xlagen: error: {error}", file=sys.stderr)  # Once: nothing else reports it.
            continue
        finally:
            bar.close()
        text = render(transcript, args.format, args.timestamps, source)
        target = _destination(args, source)
        if target is None:
            sys.stdout.write(text)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
            logger.info("%s -> %s", source, target)
    return 1 if failures else 0
