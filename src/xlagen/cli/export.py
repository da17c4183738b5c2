"""`xlagen export MODEL OUT_DIR`: write a SavedModel that generates with XLA and serves without xlagen.

It prints each signature with its inputs; the inputs listed with `= default` are optional for a
client of TensorFlow Serving (SignatureDef defaults) and for `tf.saved_model.load(DIR).<name>(...)`,
but `loaded.signatures[name]` (a concrete function, without defaults) needs every input: the
printout says so. The project's
docs/serving.md describes the signatures and serving them with TensorFlow Serving.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from xlagen.cli.common import UsageError, add_hub_arguments, hub_options, int_list, positive_int

_STRATEGIES = ("greedy", "sample", "beam")


def _strategies(value: str) -> tuple[str, ...]:
    """argparse type: comma-separated strategy names."""
    names = tuple(part.strip() for part in value.split(",") if part.strip())
    unknown = [name for name in names if name not in _STRATEGIES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected comma-separated names among {', '.join(_STRATEGIES)}, "
                                         f"got {value!r}")
    return names


def add_parser(subparsers, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Registers `export` on the `xlagen` sub-parsers."""
    parser = subparsers.add_parser(
        "export", parents=parents, help="write a SavedModel that serves without xlagen",
        description="Export the XLA-compiled generate as a TensorFlow SavedModel: one signature per "
        "decoding strategy (token ids in, sequences and scores out), plus text-in/text-out signatures "
        "when the tokenizer is a byte-level BPE. Loading it needs only TensorFlow.")
    parser.add_argument("model", metavar="MODEL", help="Hugging Face checkpoint folder or Hub id")
    parser.add_argument("output", metavar="OUT_DIR", help="folder for the SavedModel (new or empty)")
    parser.add_argument("--strategies", type=_strategies, default=_STRATEGIES, metavar="NAMES",
                        help="comma-separated decoding strategies to export (default: greedy,sample,beam); "
                             "the first is also serving_default")
    parser.add_argument("--max-new-tokens", type=positive_int, metavar="N",
                        help="the bound of the max_new_tokens input, and its default (default: 64, or half the "
                             "positions of a model with fewer than 128)")
    parser.add_argument("--prompt-lengths", type=int_list, metavar="LENGTHS",
                        help="prompt length buckets, e.g. 16,32,64 (default: 8, 16, 32, ... up to what fits "
                             "the model's positions, at most 512); longer prompts are rejected")
    parser.add_argument("--batch-sizes", type=int_list, default=(1, 2, 4, 8, 16, 32, 64), metavar="SIZES",
                        help="batch buckets; a batch is padded up to the next one (default: 1,2,4,...,64)")
    parser.add_argument("--num-beams", type=positive_int, default=4, metavar="K",
                        help="beams of the beam signature (default: 4)")
    parser.add_argument("--num-return-sequences", type=positive_int, default=1, metavar="R",
                        help="sequences per prompt of the sample and beam signatures (default: 1)")
    text = parser.add_mutually_exclusive_group()
    text.add_argument("--text", dest="text", action="store_true", default=None,
                      help="require the text signatures (fail if the tokenizer cannot run in the graph)")
    text.add_argument("--no-text", dest="text", action="store_false", help="token-id signatures only")
    parser.add_argument("--no-scores", dest="output_scores", action="store_false",
                        help="no per-token scores output for greedy/sample (saves B x N x vocab floats of "
                             "memory per call); beam signatures keep sequences_scores")
    speech = parser.add_argument_group("speech models (Whisper): fixed at export")
    speech.add_argument("--language", help="language of the audio (default: detected per row)")
    speech.add_argument("--task", choices=("transcribe", "translate"), help="transcribe (default) or translate")
    speech.add_argument("--timestamps", action="store_true", help="predict timestamp tokens")
    model = parser.add_argument_group("model")
    add_hub_arguments(model)
    parser.set_defaults(run=run, prepare=prepare)
    return parser


def prepare(args: argparse.Namespace) -> None:
    """Checks, before TensorFlow is imported, that OUT_DIR is new or an empty folder.

    Raises:
        FileExistsError: If OUT_DIR is a file or a folder holding files.
    """
    output = Path(args.output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise FileExistsError(f"{output} is {'not empty' if output.is_dir() else 'a file'}: "
                              "choose a new folder for the SavedModel")


def run(args: argparse.Namespace) -> int:
    """Runs `xlagen export`; prints each signature with its inputs and outputs.

    Raises:
        UsageError: for an option combination that cannot be exported (the message says which and why).
        OSError: if the model cannot be read or OUT_DIR is not empty.
    """
    from xlagen import AutoTokenizer
    from xlagen.deploy.export import ExportConfig, export_saved_model
    from xlagen.hub import resolve_model_dir
    from xlagen.modeling import TFAutoModelForGeneration
    from xlagen.weights.checkpoint import read_json

    try:
        export = ExportConfig(strategies=args.strategies, max_new_tokens=args.max_new_tokens,
                              prompt_lengths=args.prompt_lengths, batch_sizes=args.batch_sizes,
                              num_beams=args.num_beams, num_return_sequences=args.num_return_sequences,
                              text=args.text, output_scores=args.output_scores)
    except ValueError as error:
        raise UsageError(str(error)) from None
    hub = hub_options(args)
    if read_json(resolve_model_dir(args.model, **hub), "config.json").get("model_type") == "whisper":
        return _run_speech(args, export, hub)
    if args.language or args.task or args.timestamps:
        raise UsageError("--language, --task and --timestamps are for speech models (Whisper)")
    model = TFAutoModelForGeneration.from_pretrained(args.model, **hub)
    tokenizer = None
    if args.text is not False:
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model, **hub)
        except OSError:
            if args.text:
                raise
    try:
        signatures = export_saved_model(model, args.output, tokenizer=tokenizer, export=export)
    except ValueError as error:
        raise UsageError(str(error)) from None
    _print(signatures, args.output)
    return 0


def _run_speech(args: argparse.Namespace, export, hub: dict) -> int:
    """`xlagen export` of a Whisper checkpoint: features and audio signatures (see xlagen.deploy.speech_export)."""
    from xlagen.deploy.speech_export import export_whisper
    from xlagen.modeling import TFAutoModelForSpeechSeq2Seq
    from xlagen.speech.processing import WhisperProcessor

    model = TFAutoModelForSpeechSeq2Seq.from_pretrained(args.model, **hub)
    processor = WhisperProcessor.from_pretrained(args.model, **hub)
    strategies = tuple(s for s in export.strategies if s != "sample")
    if not strategies:
        raise UsageError("Whisper export supports the greedy and beam strategies")
    try:
        signatures = export_whisper(model, args.output, processor,
                                    export=dataclasses.replace(export, strategies=strategies), language=args.language,
                                    task=args.task, return_timestamps=args.timestamps)
    except ValueError as error:
        raise UsageError(str(error)) from None
    _print(signatures, args.output)
    return 0


def _print(signatures, output: str) -> None:
    """Lists the signatures; says which inputs are optional, and for whom."""
    for signature in signatures:
        print(f"{signature.name}:")
        for name, spec in signature.inputs.items():
            print(f"  input  {name}: {spec}")
        for name, spec in signature.outputs.items():
            print(f"  output {name}: {spec}")
    if any(" = " in spec for signature in signatures for spec in signature.inputs.values()):
        print("inputs shown with '= value' are optional: TensorFlow Serving and, in Python, "
              "tf.saved_model.load(DIR).NAME(...) fill in the value; loaded.signatures[NAME](...) needs every input")
    print(f"wrote {output}")
