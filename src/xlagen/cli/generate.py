"""`xlagen generate`: continue prompts with a causal language model (or answer them with an
encoder-decoder model such as T5), as one XLA program per shape.

Prompts come from the command line or from `--input` (.txt: one prompt per non-empty line; .jsonl:
objects with a "prompt" key, other keys carried into the output; `-` is stdin). They are batched
`--batch-size` at a time and left-padded to a multiple of 8 tokens; the last batch is filled up with
copies of its last prompt, so batches repeat the same few shapes and the compiled program is reused.
Without `--output` each prompt is printed followed by its continuation(s) (an encoder-decoder model's
output is printed alone: it does not continue the prompt); with `--output` the
results are written as JSONL records `{"prompt": ..., "generated": [...], <carried keys>}`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from xlagen import native  # numpy only: TensorFlow is not loaded by this import

logger = logging.getLogger("xlagen.cli.generate")
WEIGHT_DTYPES = ("float32", *native.WEIGHT_DTYPES)
WEIGHT_DTYPE_HELP = ("bfloat16 / int8: the matrix products read their weights rounded to bfloat16 (about twice as "
                     "fast per token as float32 at batch 1) or quantized to int8 with a scale per output column "
                     "(2-5x, with a larger change to the logits), computing in float32, on a CPU with AVX-512 "
                     "(builds a C++ kernel once; docs/performance.md); default: float32")

_PAD_TO_MULTIPLE_OF = 8
_NO_MODEL = ("xlagen generate needs --model PATH_OR_ID (a Hugging Face checkpoint folder or Hub id): "
             "the built-in default model is missing from this installation")


class UsageError(ValueError):
    """A problem with the command line or the prompts (exit code 2)."""

    exit_code = 2


@dataclass(frozen=True)
class Prompt:
    """One input: the text, and the other keys of its JSONL record (carried into the output).

    Attributes:
        text: The prompt.
        extra: Other keys of the input record, in their order.
    """

    text: str
    extra: dict[str, Any] = field(default_factory=dict)


def default_model_path() -> str | None:
    """The built-in default model (package data, see src/xlagen/default_model/README.md), or None if
    this installation lacks it."""
    folder = Path(__file__).resolve().parents[1] / "default_model"
    return str(folder) if (folder / "model.safetensors").is_file() else None


def _positive_int(value: str) -> int:
    """argparse type: an integer >= 1."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def add_parser(subparsers, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Registers `generate` on the `xlagen` sub-parsers.

    Args:
        subparsers: The result of `ArgumentParser.add_subparsers()`.
        parents: Parsers holding the options common to all subcommands (--verbose, --quiet).

    Returns:
        The `generate` parser, with `run` set as its default.
    """
    parser = subparsers.add_parser("generate", parents=parents, help="continue prompts with a causal LM",
                                   description="Continue prompts with a causal language model, compiled "
                                   "with XLA (one program per batch shape, reused across batches).")
    parser.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts to continue (or use --input)")
    files = parser.add_argument_group("input and output")
    files.add_argument("--input", "-i", metavar="FILE",
                    help="prompts file: .txt (one per non-empty line) or .jsonl ({'prompt': ...}); - for stdin")
    files.add_argument("--input-format", choices=("txt", "jsonl"),
                    help="format of --input (default: from its suffix; txt for stdin)")
    files.add_argument("--output", "-o", metavar="FILE.jsonl", help="write JSONL records here (- for stdout)")
    model = parser.add_argument_group("model")
    model.add_argument("--model", "-m", metavar="PATH_OR_ID", help="Hugging Face checkpoint folder or Hub id")
    model.add_argument("--revision", help="Hub branch, tag or commit")
    model.add_argument("--cache-dir", metavar="DIR", help="Hugging Face cache folder")
    model.add_argument("--local-files-only", action="store_true", help="never download; use the cache only")
    decoding = parser.add_argument_group("decoding (unset options keep the checkpoint's generation_config)")
    decoding.add_argument("--max-new-tokens", type=_positive_int, default=50, metavar="N",
                          help="tokens to generate per prompt (default: 50)")
    decoding.add_argument("--min-new-tokens", type=int, metavar="N", help="suppress EOS before N new tokens")
    decoding.add_argument("--do-sample", action="store_true", default=None, help="sample instead of greedy/beams")
    decoding.add_argument("--temperature", type=float, help="sampling temperature")
    decoding.add_argument("--top-k", type=int, metavar="K", help="sample among the K likeliest tokens (0: off)")
    decoding.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling probability mass")
    decoding.add_argument("--num-beams", type=int, metavar="K", help="beam search with K beams")
    decoding.add_argument("--num-return-sequences", type=int, metavar="R", help="continuations per prompt")
    decoding.add_argument("--repetition-penalty", type=float, help="penalty of already present tokens (1: off)")
    decoding.add_argument("--no-repeat-ngram-size", type=int, metavar="N", help="forbid repeated N-grams")
    decoding.add_argument("--seed", type=int, help="seed for reproducible sampling")
    run_options = parser.add_argument_group("execution")
    run_options.add_argument("--batch-size", type=_positive_int, default=8, metavar="N",
                             help="prompts per batch (default: 8)")
    run_options.add_argument("--eager", action="store_true", help="run eagerly instead of compiling with XLA")
    run_options.add_argument("--warmup", type=_int_list, metavar="LENGTHS",
                             help="compile for these prompt lengths (comma-separated, e.g. 16,32,64) before "
                                  "generating; lengths are rounded up to the prompt buckets")
    run_options.add_argument("--weight-dtype", choices=WEIGHT_DTYPES, default="float32",
                             help=WEIGHT_DTYPE_HELP)
    run_options.add_argument("--compile-cache", metavar="DIR",
                             help="keep compiled XLA programs in DIR across runs (TensorFlow's persistent "
                                  "compilation cache; sets TF_XLA_FLAGS before TensorFlow starts)")
    parser.set_defaults(run=run)
    return parser


def _int_list(value: str) -> tuple[int, ...]:
    """argparse type: comma-separated positive integers."""
    try:
        numbers = tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None
    if not numbers or min(numbers) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {value!r}")
    return numbers


def use_compile_cache(directory: str) -> None:
    """Points TensorFlow's persistent XLA compilation cache at `directory` (before TensorFlow starts)."""
    if "tensorflow" in sys.modules:
        logger.warning("TensorFlow is already loaded: --compile-cache may not take effect")
    Path(directory).mkdir(parents=True, exist_ok=True)
    flag = f"--tf_xla_persistent_cache_directory={Path(directory).resolve()}"
    os.environ["TF_XLA_FLAGS"] = f"{os.environ.get('TF_XLA_FLAGS', '')} {flag}".strip()


def _decoding_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `GenerationConfig` fields the user set; the others keep the checkpoint's values."""
    names = ("max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p", "num_beams",
             "num_return_sequences", "repetition_penalty", "no_repeat_ngram_size")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


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


def _read_input(path: str, input_format: str | None) -> list[Prompt]:
    """Reads prompts from a .txt or .jsonl file, or from stdin for `-`."""
    if input_format is None:
        input_format = "jsonl" if path != "-" and Path(path).suffix.lower() in (".jsonl", ".ndjson") else "txt"
    if path == "-":
        source, text = "<stdin>", sys.stdin.read()
    else:
        source, text = path, Path(path).read_text(encoding="utf-8")
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
        UsageError: If there are no prompts, both sources are given, a prompt is empty, or a JSONL
            line is malformed.
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


class Generator:
    """Tokenizes, generates and decodes batches with one model and fixed decoding options.

    Args:
        tokenizer: An xlagen tokenizer with a pad token, padding on the left.
        model: A causal or encoder-decoder LM with `generate`.
        options: `generate` keyword options (GenerationConfig fields).
        use_xla: Generate through a `CompiledGenerator` (shape buckets, one XLA program per bucket);
            else run eagerly.
        seed: Base seed; batch i samples with seed `[seed, i]`. None for a fresh seed per batch.
    """

    def __init__(self, tokenizer, model, options: dict[str, Any], use_xla: bool, seed: int | None):
        import tensorflow as tf

        from xlagen.generation.compiled import CompiledGenerator

        self._tf = tf
        self.tokenizer = tokenizer
        self.model = model
        self.options = options
        self.seed = seed
        self.compiler = CompiledGenerator(model) if use_xla else None
        self.function = self.compiler.generate if use_xla else model.generate
        self.compiled = use_xla
        # An encoder-decoder model returns the decoder's tokens: its start token, then the new ones.
        self.continues_prompt = not getattr(model.config, "is_encoder_decoder", False)

    def tracing_count(self) -> int:
        """How many programs have been traced (and compiled) so far; 0 when running eagerly."""
        return self.compiler.compile_count if self.compiled else 0

    def warmup(self, batch_size: int, prompt_lengths: tuple[int, ...]) -> None:
        """Compiles the programs for these prompt lengths before the first batch."""
        if self.compiler is not None:
            self.compiler.warmup(batch_sizes=(batch_size,), prompt_lengths=prompt_lengths,
                                 max_new_tokens=(self.options.get("max_new_tokens", 50),),
                                 **{k: v for k, v in self.options.items() if k != "max_new_tokens"})

    def __call__(self, texts: list[str], batch_index: int) -> tuple[list[list[str]], Any]:
        """Generates for one batch.

        Args:
            texts: B prompts (a full batch, filler included).
            batch_index: Position of the batch, for the sampling seed.

        Returns:
            For each prompt its R decoded continuations, and the new token ids as an int32 numpy
            array `[B * R, N]` (rows grouped by prompt, pad after EOS).

        Raises:
            UsageError: If a prompt encodes to no tokens.
            ValueError: If the options or lengths do not suit the model.
        """
        tf = self._tf
        encoding = self.tokenizer(texts, padding=True, pad_to_multiple_of=_PAD_TO_MULTIPLE_OF, return_tensors="tf")
        lengths = tf.reduce_sum(encoding["attention_mask"], axis=1).numpy()
        if (lengths == 0).any():
            raise UsageError(f"prompt {texts[int(lengths.argmin())]!r} encodes to no tokens")
        seed = None if self.seed is None else tf.constant([self.seed, batch_index], tf.int32)
        sequences = self.function(**encoding, seed=seed, **self.options)
        new = sequences[:, encoding["input_ids"].shape[1] if self.continues_prompt else 1:].numpy()
        decoded = self.tokenizer.batch_decode(new, skip_special_tokens=True)
        per_prompt = len(decoded) // len(texts)
        return [decoded[i * per_prompt:(i + 1) * per_prompt] for i in range(len(texts))], new


def _count_new_tokens(new_ids, real_rows: int, eos_ids: tuple[int, ...]) -> int:
    """Tokens generated by the first `real_rows` rows of `[rows, N]` ids: up to and including the first EOS."""
    total = 0
    for row in new_ids[:real_rows].tolist():
        ends = [i for i, token in enumerate(row) if token in eos_ids]
        total += ends[0] + 1 if ends else len(row)
    return total


def _load(model_name: str, args: argparse.Namespace):
    """Loads the tokenizer (left padding, EOS as pad when there is no pad token) and the model."""
    from xlagen import AutoTokenizer
    from xlagen.modeling import TFAutoModelForGeneration

    hub = {"revision": args.revision, "cache_dir": args.cache_dir, "local_files_only": args.local_files_only}
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_name, padding_side="left", **hub)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"the tokenizer of {model_name} has neither a pad nor an EOS token to pad batches with")
        tokenizer.pad_token = tokenizer.eos_token  # As transformers users do for GPT-2.
    model = TFAutoModelForGeneration.from_pretrained(model_name, weight_dtype=args.weight_dtype, **hub)
    logger.info("loaded %s in %.2f s", model_name, time.perf_counter() - started)
    return tokenizer, model


def _batches(prompts: list[Prompt], batch_size: int) -> Iterator[tuple[list[Prompt], list[str]]]:
    """Yields (prompts, texts): texts are the batch's prompts filled up to the batch size with the last one."""
    size = min(batch_size, len(prompts))
    for start in range(0, len(prompts), size):
        chunk = prompts[start:start + size]
        yield chunk, [p.text for p in chunk] + [chunk[-1].text] * (size - len(chunk))


def _write(chunk: list[Prompt], results: list[list[str]], stream: TextIO, as_jsonl: bool,
           continues_prompt: bool = True) -> None:
    """Writes a batch's results: JSONL records, or each prompt followed by each of its continuations
    (each output alone when the outputs do not continue the prompts)."""
    for prompt, generated in zip(chunk, results):
        if as_jsonl:
            record = {"prompt": prompt.text, **prompt.extra, "generated": generated}
            stream.write(json.dumps(record, ensure_ascii=False) + "\n")
        else:
            for text in generated:
                stream.write((prompt.text if continues_prompt else "") + text + "\n")
    stream.flush()


def run(args: argparse.Namespace) -> int:
    """Runs `xlagen generate`.

    Args:
        args: The parsed arguments (see `add_parser`).

    Returns:
        0 on success.

    Raises:
        UsageError: For a missing model, missing or empty prompts, or invalid decoding options.
        OSError: If the model or the input cannot be read, or the output cannot be written.
        ValueError: If the prompts do not fit the model.
    """
    model_name = args.model or default_model_path()
    if model_name is None:
        raise UsageError(_NO_MODEL)
    prompts = read_prompts(args)
    if args.compile_cache:
        use_compile_cache(args.compile_cache)
    tokenizer, model = _load(model_name, args)
    options = _decoding_options(args)
    try:
        config = model.generation_config.update(**options)  # Validates before anything is traced.
    except ValueError as error:
        raise UsageError(str(error)) from None
    generator = Generator(tokenizer, model, options, use_xla=not args.eager, seed=args.seed)
    if args.warmup:
        started = time.perf_counter()
        generator.warmup(min(args.batch_size, len(prompts)), args.warmup)
        logger.info("warm-up: %d program(s) compiled in %.1f s", generator.tracing_count(),
                    time.perf_counter() - started)
    to_file = args.output not in (None, "-")
    stream = open(args.output, "w", encoding="utf-8") if to_file else sys.stdout  # noqa: SIM115
    try:
        _generate_all(generator, prompts, args, stream, config.eos_token_ids)
    finally:
        if to_file:
            stream.close()
    return 0


def _generate_all(generator: Generator, prompts: list[Prompt], args: argparse.Namespace, stream: TextIO,
                  eos_ids: tuple[int, ...]) -> None:
    """Generates batch after batch, writing each batch's results as soon as it is done."""
    from tqdm import tqdm

    size = min(args.batch_size, len(prompts))
    total = -(-len(prompts) // size)
    show_bar = args.output not in (None, "-") and not args.quiet and sys.stderr.isatty()
    for index, (chunk, texts) in enumerate(tqdm(_batches(prompts, size), total=total, unit="batch",
                                                 file=sys.stderr, disable=not show_bar)):
        traced = generator.tracing_count()
        started = time.perf_counter()
        results, new_ids = generator(texts, index)
        seconds = time.perf_counter() - started
        if logger.isEnabledFor(logging.INFO):
            tokens = _count_new_tokens(new_ids, len(chunk) * len(results[0]), eos_ids)
            note = ", traced and compiled" if generator.tracing_count() > traced else ""
            logger.info("batch %d/%d: %d prompt(s), %d new tokens in %.2f s (%.1f tokens/s%s)", index + 1, total,
                        len(chunk), tokens, seconds, tokens / seconds, note)
        _write(chunk, results, stream, as_jsonl=args.output is not None, continues_prompt=generator.continues_prompt)
    if generator.compiled:
        logger.info("XLA programs compiled: %d", generator.tracing_count())
        for number, event in enumerate(generator.compiler.trace_log, 1):
            logger.info("  program %d (%.1f s): %s", number, event.seconds, event.reason)
