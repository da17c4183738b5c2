"""`xlagen pipeline generate|transcribe`: the same work as `xlagen generate` / `xlagen transcribe` as an
Apache Beam pipeline (`xlagen.beam`'s model handlers in RunInference), embedded or on a cluster.

    xlagen pipeline generate --input 'prompts/*.jsonl' --output out/generated --max-new-tokens 64
    xlagen pipeline transcribe --input 'audio/*.wav' --output out/transcripts --subtitles srt
    xlagen pipeline generate --input 'gs://b/p/*.txt' --output gs://b/out/g --runner dataflow -- \\
        --project P --region R --temp_location gs://b/tmp --requirements_file requirements.txt

Inputs: generation reads text files (one prompt per non-empty line) or JSONL files (`.jsonl` / `.ndjson`:
objects with a "prompt" string, an optional "options" object of generation options for that prompt,
and other keys carried into the output); transcription reads the audio files the glob matches.
Outputs: `PREFIX-SSSSS-of-NNNNN.jsonl` with one record per input, `PREFIX-failed-...jsonl` with one
record per input that failed (`{"input", "error"}`), and for transcription with `--subtitles` one
`.srt` / `.vtt` per file beside the prefix. Every input ends in one of the two JSONL outputs; the exit
code is 1 when some failed. On a terminal, a progress bar counts the inputs done when the pipeline runs in
this process (`--runner direct` without multi-processing); a cluster's runner shows its own.

`--runner direct` (the default) runs the pipeline in this process with Beam's FnApiRunner, named
explicitly: Beam's default DirectRunner first tries its Prism runner, a binary it downloads. Options after
`--` go to Beam unchanged (e.g. `--direct_num_workers 2 --direct_running_mode multi_processing`, or a
cluster runner's own options); see docs/scale-out.md.
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import logging
import sys
from pathlib import Path
from typing import Any

from xlagen.cli.common import (UsageError, add_hub_arguments, add_weight_dtype_argument, default_model_path, hub_options,
                               positive_int)
from xlagen.cli.generate import add_decoding_arguments, decoding_options
from xlagen.cli.transcribe import DEFAULT_MODEL as WHISPER_MODEL

RUNNERS = {"direct": None, "flink": "FlinkRunner", "spark": "SparkRunner", "dataflow": "DataflowRunner"}
SUBTITLES = ("srt", "vtt")
_FAILED = "failed"
# Warnings Beam logs on every run that say nothing about it: the BigQuery client it does not use, and the
# memory figure of a model manager it does not start.
BEAM_NOISE = ("apitools not found", "Resource module is not available")
# Each input's output record is logged here at DEBUG; `run` counts them on its progress bar (the pipeline's
# steps are unpickled copies, so a logger, found by name, is what reaches the bar in this process).
_done = logging.getLogger(__name__ + ".done")


def add_parser(subparsers, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Registers `pipeline generate|transcribe` on the `xlagen` sub-parsers (see `xlagen.cli.__main__`)."""
    parser = subparsers.add_parser("pipeline", help="generate or transcribe as an Apache Beam pipeline",
                                   description="Generation or transcription over many files as an Apache Beam "
                                   "pipeline, embedded or on Flink, Spark or Dataflow (needs xlagen[beam]).")
    kinds = parser.add_subparsers(dest="pipeline", metavar="KIND", required=True)
    generate = kinds.add_parser("generate", parents=parents, help="continue prompts read from text or JSONL files")
    _add_common(generate, "prompt files: .txt (one prompt per line) or .jsonl ({'prompt': ...})")
    generate.add_argument("--model", "-m", metavar="PATH_OR_ID",
                          help="checkpoint folder or Hub id, readable by every worker (default: the built-in model)")
    add_decoding_arguments(generate)
    generate.set_defaults(run=run, prepare=prepare, log_noise=BEAM_NOISE)
    transcribe = kinds.add_parser("transcribe", parents=parents, help="transcribe audio files")
    _add_common(transcribe, "audio files (wav, flac, ogg, mp3, ...)")
    transcribe.add_argument("--model", "-m", default=WHISPER_MODEL, metavar="PATH_OR_ID",
                            help=f"Whisper checkpoint folder or Hub id (default: {WHISPER_MODEL})")
    transcribe.add_argument("--language", help="language of every file (default: detected per file)")
    transcribe.add_argument("--task", choices=("transcribe", "translate"), help="default: the model's")
    transcribe.add_argument("--num-beams", type=positive_int, metavar="K", help="beam search with K beams")
    transcribe.add_argument("--max-new-tokens", type=positive_int, metavar="N", help="token limit per 30 s window")
    transcribe.add_argument("--subtitles", choices=SUBTITLES, nargs="+", default=[],
                            help="also write one subtitle file per input: PREFIX-<input path>.srt / .vtt")
    transcribe.set_defaults(run=run, prepare=prepare, log_noise=BEAM_NOISE)
    return parser


def _add_common(parser: argparse.ArgumentParser, inputs: str) -> None:
    parser.add_argument("--input", "-i", required=True, metavar="GLOB", help=f"{inputs}; local or gs://, s3://, ...")
    parser.add_argument("--output", "-o", required=True, metavar="PREFIX",
                        help="output prefix: PREFIX-*.jsonl, PREFIX-failed-*.jsonl")
    parser.add_argument("--runner", choices=tuple(RUNNERS), default="direct",
                        help="direct: in this process with Beam's FnApiRunner (default); others need their cluster")
    parser.add_argument("--workers", type=positive_int, default=1, metavar="N",
                        help="direct runner: N worker processes, each with its own model (default: 1, in process)")
    add_hub_arguments(parser)
    add_weight_dtype_argument(parser)
    parser.add_argument("--max-batch-size", type=positive_int, metavar="N",
                        help="largest batch Beam forms (default: the largest batch bucket; 16 windows for audio)")
    parser.add_argument("beam_args", nargs=argparse.REMAINDER, metavar="-- BEAM_OPTIONS",
                        help="Apache Beam pipeline options, after --")


def prepare(args: argparse.Namespace) -> None:
    """Checks, before TensorFlow starts, that Beam is installed, a local input glob matches files, the local
    output folder exists, and the Beam options come after `--`.

    Raises:
        UsageError: For a missing Beam installation or options before `--`.
        FileNotFoundError: For a local glob that matches nothing or a missing output folder.
    """
    try:
        import apache_beam  # noqa: F401
    except ImportError:
        raise UsageError("xlagen pipeline needs Apache Beam: pip install 'xlagen[beam]'") from None
    if args.beam_args and args.beam_args[0] == "--":
        args.beam_args = args.beam_args[1:]
    elif args.beam_args:
        raise UsageError(f"unrecognized arguments: {' '.join(args.beam_args)} (Beam's options go after --)")
    if "://" not in args.input and not glob.glob(args.input):
        raise FileNotFoundError(f"--input {args.input} matches no file")
    folder = Path(args.output).parent
    if "://" not in args.output and not folder.is_dir():
        raise FileNotFoundError(f"--output {args.output}: the folder {folder} does not exist; create it first")
    if args.pipeline == "generate":
        args.model = args.model or default_model_path()
        if args.model is None:
            raise UsageError("xlagen pipeline generate needs --model PATH_OR_ID")
        decoding_options(args)


def pipeline_options(args: argparse.Namespace):
    """(runner, PipelineOptions) of the command line: FnApiRunner for direct, else the runner's name."""
    from apache_beam.options.pipeline_options import PipelineOptions

    flags = list(args.beam_args)
    if args.runner == "direct":
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner

        if args.workers > 1:
            flags += [f"--direct_num_workers={args.workers}", "--direct_running_mode=multi_processing"]
        return FnApiRunner(), PipelineOptions(flags)
    return RUNNERS[args.runner], PipelineOptions(flags)


def _hub(args: argparse.Namespace) -> dict[str, Any]:
    """The hub options the user set (`--revision`, `--cache-dir`, `--local-files-only`)."""
    return {k: v for k, v in hub_options(args).items() if v}


def _parse_line(item: tuple[str, str]):
    """(key, example) elements of one input line: a txt prompt, or a JSONL record."""
    source, line = item
    if not line.strip():
        return
    if not source.endswith((".jsonl", ".ndjson")):
        yield {"source": source}, line
        return
    record = json.loads(line)
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise ValueError(f'{source}: expected a JSON object with a "prompt" string, got {line[:80]!r}')
    options = record.get("options", {})
    if not isinstance(options, dict):
        raise ValueError(f'{source}: "options" must be an object, got {options!r}')
    extra = {k: v for k, v in record.items() if k not in ("prompt", "options")}
    yield {"source": source, **extra}, (record["prompt"], options) if options else record["prompt"]


def _failure_records(item: tuple[Any, Any]):
    """One `{"input", "error"}` record per input of a dead letter (a failed batch gives one per element)."""
    from apache_beam.metrics import Metrics

    element, info = item
    error = info[1] if isinstance(info, tuple) and len(info) > 1 else str(info)
    for one in element if isinstance(element, list) else [element]:
        Metrics.counter("xlagen", _FAILED).inc()
        yield json.dumps({"input": _jsonable(one), "error": error}, ensure_ascii=False)


def _jsonable(value: Any) -> Any:
    from apache_beam.ml.inference.base import PredictionResult

    from xlagen.beam import PreparedAudio, PreparedPrompt

    # A dead letter of the postprocessing step holds its PredictionResult (a tuple): its example is the input.
    if isinstance(value, (PreparedPrompt, PreparedAudio, PredictionResult)):
        return _jsonable(value.example)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value if isinstance(value, (str, int, float, bool, dict, type(None))) else repr(value)


def _generation_record(item) -> str:
    from xlagen.beam import result_record

    key, result = item
    return json.dumps({**key, **result_record(result)}, ensure_ascii=False)


def _report_done(record: str) -> str:
    """The output record of an input, passed on once the input is counted done."""
    _done.debug("done")
    return record


class _ProgressBar(logging.Handler):
    """Advances a tqdm bar by one per record."""

    def __init__(self, bar):
        super().__init__(logging.DEBUG)
        self.bar = bar

    def emit(self, record: logging.LogRecord) -> None:
        self.bar.update(1)


def _runs_in_process(args: argparse.Namespace, options) -> bool:
    """Whether the pipeline's steps run in this process (direct runner, without worker processes)."""
    from apache_beam.options.pipeline_options import DirectOptions

    return (args.runner == "direct" and args.workers == 1
            and options.view_as(DirectOptions).direct_running_mode != "multi_processing")


def _count_inputs(args: argparse.Namespace) -> int:
    """How many inputs the pipeline reads: the matched audio files, or the prompt files' non-empty lines."""
    from apache_beam.io.filesystems import FileSystems

    files = FileSystems.match([args.input])[0].metadata_list
    if args.pipeline == "transcribe":
        return len(files)
    count = 0
    for file in files:  # compressed files too, as Beam reads them
        with FileSystems.open(file.path) as stream:
            count += sum(1 for line in io.TextIOWrapper(stream, encoding="utf-8", errors="replace") if line.strip())
    return count


def _run_counting(pipeline, bar):
    """Runs the pipeline to its end, advancing `bar` (tqdm) by one per input done in this process."""
    handler = _ProgressBar(bar)
    level, propagate = _done.level, _done.propagate
    _done.addHandler(handler)
    _done.setLevel(logging.DEBUG)
    _done.propagate = False
    try:
        result = pipeline.run()
        result.wait_until_finish()
        return result
    finally:
        _done.removeHandler(handler)
        _done.setLevel(level)
        _done.propagate = propagate


def _write_subtitles(result, prefix: str, formats: list[str]) -> None:
    from apache_beam.io.filesystems import FileSystems

    from xlagen.speech.transcribe import Segment, Transcript, render

    record = result.inference
    transcript = Transcript(record["text"], tuple(Segment(s["start"], s["end"], s["text"], ())
                                                  for s in record["segments"]), record["language"], record["duration"])
    name = result.example.split("://", 1)[-1].strip("/").replace("/", "_")
    for file_format in formats:
        with FileSystems.create(f"{prefix}-{name}.{file_format}") as stream:
            stream.write(render(transcript, file_format).encode("utf-8"))


def run(args: argparse.Namespace) -> int:
    """Builds and runs the pipeline; returns 0, or 1 when some inputs are in the failed output."""
    import apache_beam as beam
    from apache_beam.io import fileio
    from apache_beam.metrics.metric import MetricsFilter
    from apache_beam.ml.inference.base import RunInference
    from tqdm import tqdm

    from xlagen.beam import GenerationModelHandler, TranscriptionModelHandler

    runner, beam_options = pipeline_options(args)
    batching = {"max_batch_size": args.max_batch_size, "weight_dtype": args.weight_dtype, "hub_options": _hub(args)}
    pipeline = beam.Pipeline(runner=runner, options=beam_options)
    if args.pipeline == "generate":
        seed = {} if args.seed is None else {"seed": args.seed}
        handler = GenerationModelHandler(args.model, **batching, **decoding_options(args), **seed)
        lines, bad_lines = (pipeline | beam.io.ReadFromTextWithFilename(args.input)
                            | "Parse" >> beam.FlatMap(_parse_line).with_exception_handling())
        results, failed = lines | RunInference(handler.with_dead_letters(keyed=True)).with_exception_handling()
        records = results | "Records" >> beam.Map(_generation_record)
        dead = [bad_lines]
    else:
        options = {k: v for k, v in (("num_beams", args.num_beams), ("max_new_tokens", args.max_new_tokens)) if v}
        handler = TranscriptionModelHandler(args.model, language=args.language, task=args.task, **batching, **options)
        paths = pipeline | fileio.MatchFiles(args.input) | "Paths" >> beam.Map(lambda metadata: metadata.path)
        results, failed = paths | RunInference(handler.with_dead_letters()).with_exception_handling()
        records = results | "Records" >> beam.Map(
            lambda r: json.dumps({"file": r.example, **r.inference}, ensure_ascii=False))
        if args.subtitles:
            _ = results | "Subtitles" >> beam.Map(_write_subtitles, args.output, args.subtitles)
        dead = []
    dead += [failed.failed_inferences, *failed.failed_preprocessing, *failed.failed_postprocessing]
    _ = (records | "Done" >> beam.Map(_report_done)
         | "Write" >> beam.io.WriteToText(args.output, file_name_suffix=".jsonl"))
    _ = (dead | "Failures" >> beam.Flatten() | "FailureRecords" >> beam.FlatMap(_failure_records)
         | "FailedDone" >> beam.Map(_report_done)
         | "WriteFailed" >> beam.io.WriteToText(f"{args.output}-{_FAILED}", file_name_suffix=".jsonl"))
    show = not args.quiet and sys.stderr.isatty() and _runs_in_process(args, beam_options)
    with tqdm(total=_count_inputs(args) if show else None, unit="input", file=sys.stderr, disable=not show) as bar:
        result = _run_counting(pipeline, bar)
    counters = result.metrics().query(MetricsFilter().with_name(_FAILED))["counters"]
    failures = sum(counter.result or 0 for counter in counters)
    if failures:
        print(f"xlagen: error: {failures} input(s) failed: see {args.output}-{_FAILED}-*.jsonl", file=sys.stderr)
        return 1
    return 0
