"""`CompiledGenerator`: the fast path as the default path.

An XLA program is specialised to its input shapes and to the Python-level options it was traced
with. `CompiledGenerator.generate` pads the batch and the prompt up to buckets, rounds the number of
new tokens up to a bucket (and trims the result), passes every numeric option as a tensor, and keeps
one compiled program per (buckets, static options). It returns exactly what `model.generate`
returns for the same inputs. For an encoder-decoder model the prompt is the decoder's (the start
token), and the encoder input is padded on the right up to a bucket of the same sizes.

What still compiles a new program: a new batch / prompt / new-token bucket, and a change of
do_sample, num_beams, num_return_sequences, early_stopping, no_repeat_ngram_size, output_scores,
output_logprobs, the number of EOS ids, or top_k moving past its capacity (64, 128, 256, ...) or to / from 0.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

import tensorflow as tf

from xlagen import native
from xlagen.generation import checks
from xlagen.generation.api import format_output, make_plan, make_runtime, parse_request, run
from xlagen.generation.config import GenerationConfig
from xlagen.generation.loop import Decoded, Prompt
from xlagen.generation.sampling import top_k_capacity

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Buckets:
    """Sizes that inputs are padded up to. Each tuple is sorted ascending.

    Attributes:
        batch_sizes: A batch larger than the largest is split into chunks of the largest.
        prompt_lengths: Prompt lengths (tokens, padding included).
        new_tokens: Capacities for `max_new_tokens` (the result is trimmed to what was asked).
    """

    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    prompt_lengths: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    new_tokens: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)

    def __post_init__(self):
        for name in ("batch_sizes", "prompt_lengths", "new_tokens"):
            values = tuple(int(v) for v in getattr(self, name))
            if not values or min(values) < 1 or list(values) != sorted(set(values)):
                raise ValueError(f"Buckets.{name} must be positive, distinct and ascending, got {values}")
            object.__setattr__(self, name, values)


def _bucket(value: int, sizes: tuple[int, ...], what: str) -> int:
    index = bisect.bisect_left(sizes, value)
    if index == len(sizes):
        raise ValueError(f"{what} {value} exceeds the largest bucket {sizes[-1]}: add a larger size to "
                         f"Buckets ({what} buckets are {sizes})")
    return sizes[index]


class ProgramKey(NamedTuple):
    """Everything a compiled program is specialised to."""

    batch_bucket: int
    prompt_bucket: int
    encoder_bucket: int  # encoder input length bucket; 0 for decoder-only models
    new_tokens_bucket: int
    do_sample: bool
    num_beams: int
    num_return_sequences: int
    early_stopping: bool | str
    no_repeat_ngram_size: int
    num_eos: int
    top_k_capacity: int
    output_scores: bool
    output_logprobs: bool = False
    suppressed: tuple = ()  # (suppress_tokens, begin_suppress_tokens)
    model_options: tuple = ()  # what the model's own processors and prompt read (`model.program_options`)
    kernels: native.Kernels = native.Kernels.DEFAULT  # the policy the program is traced under


@dataclass(frozen=True)
class TraceEvent:
    """One traced and compiled program, and why it was needed."""

    key: ProgramKey
    reason: str
    seconds: float


def _reason(key: ProgramKey, previous: list[ProgramKey]) -> str:
    if not previous:
        return "first call"
    closest = min(previous, key=lambda old: sum(a != b for a, b in zip(old, key)))
    changes = [f"{field.replace('_', ' ')} {old} -> {new}"
               for field, old, new in zip(ProgramKey._fields, closest, key) if old != new]
    return ", ".join(changes)


class CompiledGenerator:
    """Bucketed, cached XLA generation for one model; safe to call from several threads.

    Args:
        model: A model with `generate` semantics (`GenerationMixin`).
        buckets: Padding sizes.
        warn_after: Log a warning when more than this many programs were compiled (a workload
            that keeps recompiling should widen its buckets or fix its options).
        kernels: Where xlagen's native kernels run in its programs (`xlagen.native.Kernels`; None: the
            policy in force when it is made, `xlagen.native.current()`); part of each program's key.

    Example:
        >>> generator = CompiledGenerator(model)
        >>> tokens = generator.generate(**tokenizer(prompts, padding=True, return_tensors="tf"),
        ...                             max_new_tokens=40, do_sample=True, temperature=0.7)
    """

    def __init__(self, model, buckets: Buckets | None = None, warn_after: int = 8,
                 kernels: native.Kernels | None = None):
        if kernels is not None and not isinstance(kernels, native.Kernels):
            raise TypeError(f"kernels must be a xlagen.native.Kernels policy, got {type(kernels).__name__}")
        self.model = model
        self.kernels = native.current() if kernels is None else kernels
        self.buckets = buckets or Buckets()
        self.warn_after = warn_after
        self.trace_log: list[TraceEvent] = []
        self._programs: dict[ProgramKey, tf.types.experimental.GenericFunction] = {}
        self._compiled: set[ProgramKey] = set()
        self._lock = threading.Lock()  # guards the dicts and the log
        self._first_call = threading.Lock()  # one thread traces and compiles a new program at a time

    @property
    def compile_count(self) -> int:
        """How many programs were traced and compiled."""
        return len(self.trace_log)

    def _program(self, key: ProgramKey, config: GenerationConfig, capacity: int):
        with self._lock:
            if key not in self._programs:
                plan = make_plan(self.model, config, capacity, always=True)
                # Only static fields of `config` are read inside the program.

                def program(prompt, runtime):
                    with native.tracing(key.kernels):
                        return run(self.model, prompt, plan, runtime, config)

                self._programs[key] = tf.function(program, jit_compile=True, autograph=False)
            return self._programs[key]

    def _key(self, config: GenerationConfig, batch: int, buckets: tuple[int, int, int]) -> ProgramKey:
        capacity = top_k_capacity(config.top_k, self.model.config.vocab_size) if config.do_sample and config.top_k else 0
        prompt, encoder, new = buckets
        return ProgramKey(batch, prompt, encoder, new, config.do_sample, config.num_beams, config.num_return_sequences,
                          config.early_stopping, config.no_repeat_ngram_size, len(config.eos_token_ids), capacity,
                          config.output_scores, config.output_logprobs,
                          (config.suppress_tokens, config.begin_suppress_tokens), self.model.program_options(config),
                          self.kernels)

    def _buckets_for(self, prompt_length: int, new_tokens: int) -> tuple[int, int]:
        prompt_bucket = _bucket(prompt_length, self.buckets.prompt_lengths, "prompt length")
        new_bucket = _bucket(new_tokens, self.buckets.new_tokens, "max_new_tokens")
        limit = self.model.config.max_positions
        if limit is not None and prompt_bucket + new_bucket > limit:  # near the model's limit: use the room that is left
            new_bucket = max(new_tokens, limit - prompt_bucket)
            prompt_bucket = min(prompt_bucket, limit - new_bucket)
        return prompt_bucket, new_bucket

    def generate(self, inputs=None, generation_config: GenerationConfig | None = None, seed=None, **kwargs):
        """Same arguments and result as `model.generate`, through cached bucketed XLA programs.

        Inputs are checked before any program is traced or run: besides `model.generate`'s checks,
        the values (token ids in the vocabulary, 0/1 masks, finite features) are always known here.

        Raises:
            TypeError: for inputs or options of the wrong type (e.g. float token ids).
            ValueError: for invalid options or inputs, a prompt / max_new_tokens beyond the largest bucket,
                or a call whose estimated memory exceeds the limit (`max_memory_gb`).
        """
        request = parse_request(self.model, inputs, generation_config, seed, kwargs)
        config = request.config
        batch, prompt_length = request.prompt.ids.shape
        prompt_bucket, new_bucket = self._buckets_for(prompt_length, request.max_new_tokens)
        buckets = (prompt_bucket, self._encoder_bucket(request.prompt.extra), new_bucket)
        largest = self.buckets.batch_sizes[-1]
        # The padded shapes the program is compiled for must fit too.
        batch_bucket = _bucket(min(batch, largest), self.buckets.batch_sizes, "batch size")
        checks.check_sizes(self.model, batch_bucket, prompt_bucket, new_bucket, config, request.prompt.extra)
        chunks = [self._generate_chunk(request, start, min(start + largest, batch), buckets)
                  for start in range(0, batch, largest)]
        joined = Decoded(*(None if parts[0] is None else tf.concat(parts, 0) for parts in zip(*chunks)))
        return format_output(joined, config)

    def _encoder_bucket(self, extra: dict) -> int:
        """The length bucket of the model's extra inputs (an encoder's `[B, L]` ids and mask); 0 without, or
        for inputs of a fixed shape (a speech encoder's float features)."""
        if not extra or all(t.dtype.is_floating for t in extra.values()):
            return 0
        lengths = {tuple(t.shape)[1:] for t in extra.values()}
        if len(lengths) != 1 or len(next(iter(lengths))) != 1:
            raise ValueError(f"CompiledGenerator pads a model's extra inputs as [batch, length] tensors of one "
                             f"length; got shapes {[tuple(t.shape) for t in extra.values()]}")
        (length,) = next(iter(lengths))
        return _bucket(length, self.buckets.prompt_lengths, "encoder input length")

    def _generate_chunk(self, request, start: int, stop: int, buckets: tuple[int, int, int]):
        config, (prompt_bucket, encoder_bucket, new_bucket) = request.config, buckets
        rows, prompt_length = stop - start, request.prompt.ids.shape[1]
        batch_bucket = _bucket(rows, self.buckets.batch_sizes, "batch size")
        # Extra rows repeat the first one; extra prompt columns are left padding (masked, and hidden
        # from the processors through `prompt_start`); extra encoder columns are right padding (masked).
        take = tf.concat([tf.range(start, stop), tf.fill([batch_bucket - rows], start)], 0)
        shift = prompt_bucket - prompt_length
        pad = config.pad_token_id if config.pad_token_id is not None else 0
        ids = tf.pad(tf.gather(request.prompt.ids, take), [[0, 0], [shift, 0]], constant_values=pad)
        mask = tf.pad(tf.gather(request.prompt.mask, take), [[0, 0], [shift, 0]])
        extra = {name: tf.gather(t, take) if not encoder_bucket else
                 tf.pad(tf.gather(t, take), [[0, 0], [0, encoder_bucket - t.shape[1]]])
                 for name, t in request.prompt.extra.items()}
        prompt = Prompt(ids, mask, extra)
        runtime = make_runtime(config, request.max_new_tokens, prompt_length, request.seed, prompt_start=shift)
        key = self._key(config, batch_bucket, buckets)
        program = self._program(key, config, new_bucket)
        if key in self._compiled:
            decoded = program(prompt, runtime)
        else:
            with self._first_call:
                traces = program.experimental_get_tracing_count()
                started = time.perf_counter()
                decoded = program(prompt, runtime)
                if program.experimental_get_tracing_count() > traces:
                    self._log_trace(key, time.perf_counter() - started)
                self._compiled.add(key)
        kept, new = rows * config.num_return_sequences, request.max_new_tokens
        # Step scores have a row per beam in beam search, per returned sequence otherwise.
        score_rows = rows * (config.num_beams if config.num_beams > 1 else config.num_return_sequences)
        return Decoded(decoded.sequences[:kept, shift:prompt_bucket + new],
                       None if decoded.sequence_scores is None else decoded.sequence_scores[:kept],
                       None if decoded.scores is None else decoded.scores[:score_rows, :new],
                       None if decoded.logprobs is None else decoded.logprobs[:kept, :new],
                       None if decoded.first_logprobs is None else decoded.first_logprobs[:kept])

    def _log_trace(self, key: ProgramKey, seconds: float) -> None:
        with self._lock:
            reason = _reason(key, [event.key for event in self.trace_log])
            self.trace_log.append(TraceEvent(key, reason, seconds))
            count = len(self.trace_log)
        logger.info("compiled program %d in %.1f s (%s): %s", count, seconds, key.kernels, reason)
        if count == self.warn_after + 1:
            logger.warning("%d XLA programs compiled so far (latest: %s); widen the buckets or keep options "
                           "such as num_beams fixed to avoid recompiling", count, reason)

    def warmup(self, batch_sizes=(1,), prompt_lengths=(8,), max_new_tokens=(16,), **options) -> None:
        """Compiles the programs for these shapes ahead of time, with the given static options.

        Args:
            batch_sizes, prompt_lengths, max_new_tokens: Shapes to compile for, each an int or a sequence
                of ints (each rounded up to its bucket, as real calls will be).
            **options: `generate` options (e.g. num_beams=2); numeric values do not matter.

        Raises:
            TypeError: for sizes that are not ints.
            ValueError: for sizes < 1 or beyond the largest bucket, or invalid options.
        """
        batch_sizes = checks.positive_ints("batch_sizes", batch_sizes)
        prompt_lengths = checks.positive_ints("prompt_lengths", prompt_lengths)
        max_new_tokens = checks.positive_ints("max_new_tokens", max_new_tokens)
        options = {"eos_token_id": self.model.generation_config.eos_token_id if self.model.generation_config
                   else None, **options}
        for batch in batch_sizes:
            for length in prompt_lengths:
                for new in max_new_tokens:
                    ids = tf.ones([batch, length], tf.int32)
                    self.generate(ids, attention_mask=tf.ones_like(ids), max_new_tokens=new, **options)


def compile_generate(model, buckets: Buckets | None = None) -> CompiledGenerator:
    """`CompiledGenerator(model, buckets)`."""
    return CompiledGenerator(model, buckets)


