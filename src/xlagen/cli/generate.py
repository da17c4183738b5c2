"""`xlagen generate`: continue prompts with a causal language model (or answer them with an
encoder-decoder model such as T5), as one XLA program per shape.

Prompts come from the command line or from `--input` (.txt: one prompt per non-empty line; .jsonl:
objects with a "prompt" key, other keys carried into the output; `-` is stdin). They are batched
`--batch-size` at a time and left-padded to a multiple of 8 tokens; the last batch is filled up with
copies of its last prompt, so batches repeat the same few shapes and the compiled program is reused.
Without `--output` each prompt is printed followed by its continuation (an encoder-decoder model's
output is printed alone: it does not continue the prompt), with a line `---` between prompts and, for
several returned sequences, `[i/R] ` before each; with `--output` the results are written as JSONL
records `{"prompt": ..., "generated": [...], <carried keys>}`. An output file is written beside its
target under a temporary name and moved into place once every batch is done, so a failed or
interrupted run leaves an existing file untouched.

With `--chat`, each prompt is one user message (after `--system`, if given) rendered with the
tokenizer's chat template (as the checkpoint's instruction-tuned model expects it) and encoded without
adding special tokens (the template holds them); the reply is printed alone.

Decoding options left unset keep the checkpoint's generation config (the built-in model samples).
`--greedy` (or `--temperature 0`, as in other tools) turns sampling off, and so does `--num-beams K`
with K > 1 unless `--do-sample` is given (which the library then refuses: beam sampling is not
supported).

Everything that can be checked without TensorFlow (the model's presence, the prompts and their
file's encoding, the output's folder) is checked by `prepare`, before TensorFlow is imported.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from xlagen.cli.common import (BENIGN_CACHE_LOG, SEED_MAX, UsageError, add_hub_arguments, add_weight_dtype_argument,
                               default_model_path, hub_options, int_list, non_negative_float, non_negative_int,
                               positive_int, random_seed, drop_stderr_lines)
from xlagen.cli.files import Prompt, check_output, open_output, read_prompts

__all__ = ["Prompt", "UsageError", "add_decoding_arguments", "add_parser", "decoding_options", "default_model_path",
           "prepare", "run"]

logger = logging.getLogger("xlagen.cli.generate")

_PAD_TO_MULTIPLE_OF = 8
_SEPARATOR = "---"
_NO_MODEL = ("xlagen generate needs --model PATH_OR_ID (a Hugging Face checkpoint folder or Hub id): "
             "the built-in default model is missing from this installation")


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
    files.add_argument("--chat", action="store_true",
                       help="each prompt is a user message, rendered with the tokenizer's chat template "
                            "(instruction-tuned checkpoints); prints the replies")
    files.add_argument("--system", metavar="TEXT", help="with --chat: a system message before each prompt")
    model = parser.add_argument_group("model")
    model.add_argument("--model", "-m", metavar="PATH_OR_ID",
                       help="Hugging Face checkpoint folder or Hub id (default: the built-in model, a small GPT-2 "
                            "trained on the King James Bible, which samples)")
    add_hub_arguments(model)
    add_decoding_arguments(parser)
    run_options = parser.add_argument_group("execution")
    run_options.add_argument("--batch-size", type=positive_int, default=8, metavar="N",
                             help="prompts per batch (default: 8)")
    run_options.add_argument("--eager", action="store_true", help="run eagerly instead of compiling with XLA")
    run_options.add_argument("--warmup", type=int_list, metavar="LENGTHS",
                             help="compile for these prompt lengths (comma-separated, e.g. 16,32,64) before "
                                  "generating; lengths are rounded up to the prompt buckets")
    add_weight_dtype_argument(run_options)
    run_options.add_argument("--compile-cache", metavar="DIR",
                             help="keep compiled XLA programs in DIR across runs (TensorFlow's persistent "
                                  "compilation cache; sets TF_XLA_FLAGS before TensorFlow starts)")
    parser.set_defaults(run=run, prepare=prepare)
    return parser


def add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the decoding options (read back by `decoding_options`) as a group of `parser`."""
    decoding = parser.add_argument_group("decoding (unset options keep the checkpoint's generation_config)")
    decoding.add_argument("--max-new-tokens", type=positive_int, default=50, metavar="N",
                          help="tokens to generate per prompt (default: 50)")
    decoding.add_argument("--min-new-tokens", type=non_negative_int, metavar="N", help="suppress EOS before N new tokens")
    decoding.add_argument("--greedy", action="store_true",
                          help="greedy decoding (beam search with --num-beams): turns sampling off")
    decoding.add_argument("--do-sample", action=argparse.BooleanOptionalAction, default=None,
                          help="sample instead of greedy/beams (--no-do-sample: don't); default: the checkpoint's "
                               "choice, off with --num-beams K > 1")
    decoding.add_argument("--temperature", type=non_negative_float, metavar="T",
                          help="sampling temperature (0: greedy decoding)")
    decoding.add_argument("--top-k", type=non_negative_int, metavar="K", help="sample among the K likeliest tokens (0: off)")
    decoding.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling probability mass")
    decoding.add_argument("--num-beams", type=positive_int, metavar="K", help="beam search with K beams")
    decoding.add_argument("--num-return-sequences", type=positive_int, metavar="R", help="continuations per prompt")
    decoding.add_argument("--repetition-penalty", type=float, help="penalty of already present tokens (1: off)")
    decoding.add_argument("--no-repeat-ngram-size", type=non_negative_int, metavar="N", help="forbid repeated N-grams")
    decoding.add_argument("--seed", type=random_seed, help=f"seed for reproducible sampling (0 to {SEED_MAX})")


def use_compile_cache(directory: str, verbose: bool = False) -> None:
    """Points TensorFlow's persistent XLA compilation cache at `directory` (before TensorFlow starts); unless
    `verbose`, the errors TensorFlow logs for every program it loads from there, and then runs, are dropped."""
    if "tensorflow" in sys.modules:
        logger.warning("TensorFlow is already loaded: --compile-cache may not take effect")
    elif not verbose:
        drop_stderr_lines(BENIGN_CACHE_LOG)
    Path(directory).mkdir(parents=True, exist_ok=True)
    flag = f"--tf_xla_persistent_cache_directory={Path(directory).resolve()}"
    os.environ["TF_XLA_FLAGS"] = f"{os.environ.get('TF_XLA_FLAGS', '')} {flag}".strip()


def decoding_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `GenerationConfig` fields the user set; the others keep the checkpoint's values.

    `--greedy` and `--temperature 0` mean do_sample=False (and one beam for `--greedy` unless
    `--num-beams` is given); `--num-beams K > 1` means do_sample=False unless `--do-sample` is given.

    Raises:
        UsageError: For `--greedy` or `--temperature 0` with `--do-sample`.
    """
    names = ("max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p", "num_beams",
             "num_return_sequences", "repetition_penalty", "no_repeat_ngram_size")
    options = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    greedy_reason = "--greedy" if args.greedy else "--temperature 0" if args.temperature == 0 else None
    if greedy_reason is not None:
        if args.do_sample:
            raise UsageError("--greedy and --do-sample contradict each other: give one of them" if args.greedy
                             else "--temperature 0 means greedy decoding: drop --do-sample or give a temperature > 0")
        options["do_sample"] = False
        options.pop("temperature", None)
        if args.greedy:
            options.setdefault("num_beams", 1)
    if options.get("num_beams", 1) > 1 and args.do_sample is None:
        options["do_sample"] = False  # Beam search, not beam sampling (which the library does not support).
    return options


class Generator:
    """Tokenizes, generates and decodes batches with one model and fixed decoding options.

    Args:
        tokenizer: An xlagen tokenizer with a pad token, padding on the left.
        model: A causal or encoder-decoder LM with `generate`.
        options: `generate` keyword options (GenerationConfig fields).
        use_xla: Generate through a `CompiledGenerator` (shape buckets, one XLA program per bucket);
            else run eagerly.
        seed: Base seed; batch i samples with seed `[seed, i]`. None for a fresh seed per batch.
        chat: Render each prompt as a user message with the tokenizer's chat template (after a system
            message, if `system` is given), encoded without adding special tokens; the output is the reply.
        system: The system message of `chat`.
    """

    def __init__(self, tokenizer, model, options: dict[str, Any], use_xla: bool, seed: int | None,
                 chat: bool = False, system: str | None = None):
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
        self.chat, self.system = chat, system

    def render(self, text: str) -> str:
        """The prompt as the model gets it: `text` itself, or with `chat` the rendered conversation."""
        if not self.chat:
            return text
        messages = ([{"role": "system", "content": self.system}] if self.system is not None else [])
        messages.append({"role": "user", "content": text})
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

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
        encoding = self.tokenizer([self.render(text) for text in texts], padding=True,
                                  pad_to_multiple_of=_PAD_TO_MULTIPLE_OF, return_tensors="tf",
                                  add_special_tokens=not self.chat)
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

    hub = hub_options(args)
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
           continues_prompt: bool = True, first: bool = True) -> None:
    """Writes a batch's results: JSONL records, or each prompt followed by its continuation (the output
    alone when the outputs do not continue the prompts), a `---` line between prompts (before this
    batch's first one unless it is the `first` of the run) and `[i/R] ` before each of R > 1 sequences."""
    lines = []
    for number, (prompt, generated) in enumerate(zip(chunk, results)):
        if as_jsonl:
            lines.append(json.dumps({"prompt": prompt.text, **prompt.extra, "generated": generated},
                                    ensure_ascii=False))
            continue
        if number or not first:
            lines.append(_SEPARATOR)
        for index, text in enumerate(generated, 1):
            label = f"[{index}/{len(generated)}] " if len(generated) > 1 else ""
            lines.append(label + (prompt.text if continues_prompt else "") + text)
    # One write per batch: a Ctrl-C comes between two batches' output, never inside a record.
    stream.write("".join(line + "\n" for line in lines))
    stream.flush()


def prepare(args: argparse.Namespace) -> None:
    """The checks and settings of `xlagen generate` that come before TensorFlow is imported: the model
    is known, the prompts are read (into `args.prompt_records`), the output can be written, and the
    compile cache is set up.

    Raises:
        UsageError: For a missing model or prompts (see `read_prompts`) or contradictory decoding options.
        OSError: If the input cannot be read or the output cannot be written.
    """
    args.model_name = args.model or default_model_path()
    if args.model_name is None:
        raise UsageError(_NO_MODEL)
    decoding_options(args)
    if args.system is not None and not args.chat:
        raise UsageError("--system is a message of a chat: add --chat")
    args.prompt_records = read_prompts(args)
    check_output(args.output)
    if args.compile_cache:
        use_compile_cache(args.compile_cache, args.verbose)


def run(args: argparse.Namespace) -> int:
    """Runs `xlagen generate` (after `prepare`, which `main` calls before TensorFlow is imported).

    Args:
        args: The parsed arguments (see `add_parser`).

    Returns:
        0 on success.

    Raises:
        UsageError: For a missing model, missing or empty prompts, or invalid decoding options.
        OSError: If the model or the input cannot be read, or the output cannot be written.
        ValueError: If the prompts do not fit the model.
    """
    if getattr(args, "prompt_records", None) is None:  # Called without `main`.
        prepare(args)
    prompts = args.prompt_records
    tokenizer, model = _load(args.model_name, args)
    options = decoding_options(args)
    try:
        config = model.generation_config.update(**options)  # Validates before anything is traced.
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.chat:
        if getattr(model.config, "is_encoder_decoder", False):
            raise UsageError(f"--chat needs a causal language model; {args.model_name} is an encoder-decoder model")
        if tokenizer.chat_template is None:
            raise UsageError(f"--chat: the tokenizer of {args.model_name} has no chat template "
                             "(tokenizer_config.json 'chat_template' or chat_template.jinja)")
    generator = Generator(tokenizer, model, options, use_xla=not args.eager, seed=args.seed, chat=args.chat,
                          system=args.system)
    if args.warmup:
        started = time.perf_counter()
        generator.warmup(min(args.batch_size, len(prompts)), args.warmup)
        logger.info("warm-up: %d program(s) compiled in %.1f s", generator.tracing_count(),
                    time.perf_counter() - started)
    if args.output in (None, "-"):
        _generate_all(generator, prompts, args, sys.stdout, config.eos_token_ids)
    else:
        with open_output(args.output) as stream:
            _generate_all(generator, prompts, args, stream, config.eos_token_ids)
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
        _write(chunk, results, stream, as_jsonl=args.output is not None,
               continues_prompt=generator.continues_prompt and not generator.chat, first=index == 0)
    if generator.compiled:
        logger.info("XLA programs compiled: %d", generator.tracing_count())
        for number, event in enumerate(generator.compiler.trace_log, 1):
            logger.info("  program %d (%.1f s): %s", number, event.seconds, event.reason)
