"""`generate()`: transformers 4.x semantics on top of the model-agnostic decoding loops.

Everything that can be checked is checked here from static shapes and Python options, before any
tracing; the loops themselves only see tensors and a static `Plan`.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import tensorflow as tf

from xlagen import native
from xlagen.generation import checks
from xlagen.generation.beam_search import BeamOptions, beam_search
from xlagen.generation.config import GenerationConfig
from xlagen.generation.loop import Decoded, Plan, Prompt, decode, repeat_rows
from xlagen.generation.sampling import Runtime, build_processors, select_greedy, select_sample

logger = logging.getLogger(__name__)

_MODEL_INPUTS = frozenset({"input_ids", "input_features", "attention_mask", "decoder_input_ids",
                           "decoder_attention_mask"})


class GenerateOutput(NamedTuple):
    """What `generate(..., return_dict_in_generate=True)` returns.

    Attributes:
        sequences: int32 `[B * R, T_max]`, prompt + new tokens, pad after EOS.
        scores: With `output_scores`, a tuple of N processed score tensors `[B * R, V]` (beam search:
            `[B * K, V]` log-probabilities), one per step; otherwise None.
        sequences_scores: Beam search with `output_scores`: float32 `[B * R]` final beam scores.
        logprobs: xlagen's own, with `output_logprobs`: float32 `[B * R, N]`, the log-probability of each new
            token under the processed scores it was chosen from (after the sampling warpers when sampling; in
            beam search, their log-softmax along the returned beam); 0 after EOS.
        first_logprobs: xlagen's own, with `output_logprobs`: float32 `[B * R, V]`, the log-softmax of the
            logits after the prompt's first token (an encoder-decoder model's decoder start token; a row whose
            first column is left padding gets nothing meaningful), before any processor: Whisper's no-speech
            probability is its <|nospeech|> entry.
    """

    sequences: tf.Tensor
    scores: tuple | None = None
    sequences_scores: tf.Tensor | None = None
    logprobs: tf.Tensor | None = None
    first_logprobs: tf.Tensor | None = None


def _default_attention_mask(input_ids: tf.Tensor, config: GenerationConfig) -> tf.Tensor:
    """transformers' rule: mask the pad id when it occurs in the prompt and differs from EOS."""
    pad = config.pad_token_id
    if pad is None or pad in config.eos_token_ids:
        return tf.ones_like(input_ids)
    has_pad = tf.reduce_any(tf.equal(input_ids, pad))
    return tf.where(has_pad, tf.cast(tf.not_equal(input_ids, pad), tf.int32), tf.ones_like(input_ids))


def _split_kwargs(kwargs: dict) -> tuple[dict, dict]:
    model_inputs = {k: v for k, v in kwargs.items() if k in _MODEL_INPUTS}
    options = {k: v for k, v in kwargs.items() if k in GenerationConfig.field_names()}
    unknown = sorted(set(kwargs) - set(model_inputs) - set(options))
    if unknown:
        raise ValueError(f"generate() got arguments it does not use: {unknown}. Model inputs are "
                         f"{sorted(_MODEL_INPUTS)}; options are GenerationConfig fields.")
    return model_inputs, options


def resolve_config(model, generation_config: GenerationConfig | None, options: dict) -> GenerationConfig:
    """The model's defaults, then `generation_config`, then keyword options."""
    config = generation_config or getattr(model, "generation_config", None) or GenerationConfig()
    config = config.update(**options) if options else config
    if config.pad_token_id is None and config.eos_token_ids:
        config = config.update(pad_token_id=config.eos_token_ids[0])
    return config


def _decoder_inputs(model, model_inputs: dict, input_ids: tf.Tensor, config: GenerationConfig):
    """`decoder_input_ids` / `decoder_attention_mask` as int32 tensors, checked against the batch."""
    ids, mask = model_inputs.get("decoder_input_ids"), model_inputs.get("decoder_attention_mask")
    if ids is None:
        if mask is not None:
            raise ValueError("decoder_attention_mask needs decoder_input_ids")
        return None, None
    ids = checks.as_int_tensor("decoder_input_ids", ids)
    if None not in (ids.shape[0], input_ids.shape[0]) and ids.shape[0] != input_ids.shape[0]:
        raise ValueError(f"decoder_input_ids has batch size {ids.shape[0]} but input_ids has {input_ids.shape[0]}: "
                         "give one decoder prompt per input row")
    if mask is not None:
        mask = checks.as_mask_tensor("decoder_attention_mask", mask)
        if not mask.shape.is_compatible_with(ids.shape):
            raise ValueError(f"decoder_attention_mask shape {mask.shape} does not match decoder_input_ids "
                             f"{ids.shape}")
    if ids.shape[1] == 0:
        raise ValueError("decoder_input_ids is empty: leave it out to start from decoder_start_token_id")
    checks.check_tokens("decoder_input_ids", ids, "decoder_attention_mask", tf.ones_like(ids) if mask is None else mask,
                        model.config.vocab_size)
    first = tf.get_static_value(ids[:, 0])
    start = config.decoder_start_token_id
    if first is not None and start is not None and (first != start).all():
        # transformers then prepends the start token; that depends on the values, which a compiled
        # program cannot do, so xlagen asks for it instead (eagerly; under tf.function it cannot see them).
        raise ValueError(f"decoder_input_ids must start with decoder_start_token_id ({start}): prepend it "
                         "(transformers does that itself when no row starts with it)")
    return ids, mask


class Request(NamedTuple):
    """One validated `generate` call: the inputs split for the decoding loops, and the resolved options."""

    prompt: Prompt
    config: GenerationConfig
    max_new_tokens: int
    seed: object


def parse_request(model, inputs, generation_config, seed, kwargs) -> Request:
    """Validates a `generate` call (before any tracing, see `checks`), resolves its options and splits the
    inputs into the decoder prompt and the model's other inputs (`model.generation_inputs`)."""
    model_inputs, options = _split_kwargs(kwargs)
    main = getattr(model.config, "main_input_name", "input_ids")
    if inputs is None:
        inputs = model_inputs.pop(main, None)
    elif main in model_inputs:
        raise ValueError(f"pass the model's input either positionally or as {main}=, not both")
    if inputs is None:
        raise ValueError(f"generate() needs {main}")
    config = resolve_config(model, generation_config, options)
    if main != "input_ids":
        return _parse_input_request(model, main, inputs, model_inputs, config, seed)
    input_ids = checks.as_int_tensor("input_ids", inputs)
    checks.check_batch("input_ids", input_ids)
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token (e.g. the BOS token) in input_ids")
    mask = model_inputs.get("attention_mask")
    mask = _default_attention_mask(input_ids, config) if mask is None else checks.as_mask_tensor("attention_mask", mask)
    if mask.shape.rank != 2 or not mask.shape.is_compatible_with(input_ids.shape):
        raise ValueError(f"attention_mask shape {mask.shape} does not match input_ids {input_ids.shape}: give one "
                         "mask value per token")
    checks.check_tokens("input_ids", input_ids, "attention_mask", mask, model.config.vocab_size)
    checks.check_seed(seed)
    decoder_ids, decoder_mask = _decoder_inputs(model, model_inputs, input_ids, config)
    prompt = Prompt(*model.generation_inputs(input_ids, mask, config.decoder_start_token_id, decoder_ids,
                                             decoder_mask))
    return _request(model, prompt, config, seed)


def _request(model, prompt: Prompt, config: GenerationConfig, seed) -> Request:
    """The request, once its lengths fit the model and its estimated memory the limit."""
    new_tokens = config.new_tokens(prompt.ids.shape[1], model.config.max_positions)
    checks.check_sizes(model, prompt.ids.shape[0] or 1, prompt.ids.shape[1], new_tokens, config, prompt.extra)
    return Request(prompt, config, new_tokens, seed)


def _parse_input_request(model, name: str, inputs, model_inputs: dict, config: GenerationConfig, seed) -> Request:
    """The request of a model whose input is not token ids (e.g. a speech model's float features): the input
    checked by the model (`generation_input`), and the decoder prompt given, else the model's own
    (`forced_decoder_prompt`, else the start token)."""
    unused = sorted(set(model_inputs) - {"decoder_input_ids", "decoder_attention_mask"})
    if unused:
        raise ValueError(f"{type(model).__name__}.generate takes {name} (and optionally decoder_input_ids), "
                         f"not {unused}")
    inputs = model.generation_input(inputs)
    checks.check_seed(seed)
    ids, mask = _decoder_inputs(model, model_inputs, inputs, config)
    if ids is None:
        ids = model.forced_decoder_prompt(inputs, config)
    prompt = Prompt(*model.generation_inputs(inputs, None, config.decoder_start_token_id, ids, mask))
    return _request(model, prompt, config, seed)


def make_plan(model, config: GenerationConfig, capacity: int, always: bool = False) -> Plan:
    """The static part of a run; `always` keeps runtime-only options in the program (see build_processors)."""
    vocab_size = model.config.vocab_size
    return Plan(capacity, build_processors(config, vocab_size, always, model.generation_processors(config)),
                select_sample if config.do_sample else select_greedy, config.output_scores, config.output_logprobs)


def make_runtime(config: GenerationConfig, max_new_tokens: int, prompt_length: int, seed,
                 prompt_start=0) -> Runtime:
    """The tensor part of a run (transformers' min_length counts the padded prompt)."""
    min_new = max(config.min_length - prompt_length, config.min_new_tokens or 0, 0)
    return Runtime(
        max_new_tokens=tf.constant(max_new_tokens, tf.int32), min_new_tokens=tf.constant(min_new, tf.int32),
        eos_ids=tf.constant(config.eos_token_ids, tf.int32, shape=[len(config.eos_token_ids)]),
        pad_id=tf.constant(config.pad_token_id if config.pad_token_id is not None else 0, tf.int32),
        seed=seed_tensor(seed, config.do_sample), temperature=tf.constant(config.temperature, tf.float32),
        top_k=tf.constant(config.top_k, tf.int32), top_p=tf.constant(config.top_p, tf.float32),
        repetition_penalty=tf.constant(config.repetition_penalty, tf.float32),
        length_penalty=tf.constant(float(config.length_penalty), tf.float32),
        prompt_start=tf.cast(prompt_start, tf.int32))


def run(model, prompt: Prompt, plan: Plan, runtime: Runtime, config: GenerationConfig) -> Decoded:
    """Dispatches to greedy/sampling or beam search.

    Returns:
        `Decoded`: sequences `[B * R, P + N]`, and the scores and log-probabilities the plan keeps.
    """
    if config.num_beams > 1:
        options = BeamOptions(config.num_beams, config.early_stopping, config.num_return_sequences,
                              len(config.eos_token_ids))
        return beam_search(model, prompt, plan, options, runtime)
    if config.num_return_sequences > 1:
        prompt = repeat_rows(prompt, config.num_return_sequences)
    return decode(model, prompt, plan, runtime)


def format_output(decoded: Decoded, config: GenerationConfig):
    """The token tensor, or a `GenerateOutput` with `return_dict_in_generate`."""
    if not config.return_dict_in_generate:
        return decoded.sequences
    scores = None if decoded.scores is None else tuple(tf.unstack(decoded.scores, axis=1))
    return GenerateOutput(decoded.sequences, scores, decoded.sequence_scores if config.output_scores else None,
                          decoded.logprobs, decoded.first_logprobs)


class GenerationMixin:
    """Adds transformers-style `generate()` to a model offering `prefill` / `decode_step`.

    A model changes what generation does for it through these hooks, never by generation knowing the model:
    `generation_input` (a main input that is not token ids), `forced_decoder_prompt` (a decoder prompt of
    its own), `generation_processors` (logits processors of its own) and `program_options` (what of the
    options those read, for `CompiledGenerator`'s program key).
    """

    generation_config: GenerationConfig | None = None

    def generation_input(self, inputs) -> tf.Tensor:
        """The model's main input, checked, when it is not token ids (`config.main_input_name`).

        Raises:
            ValueError: this model generates from token ids only.
        """
        raise ValueError(f"{type(self).__name__} generates from input_ids")

    def forced_decoder_prompt(self, inputs, config: GenerationConfig):
        """The decoder prompt `[B, P]` when the caller gives none, or None for the start token alone."""
        return None

    def generation_processors(self, config: GenerationConfig) -> tuple:
        """Logits processors of this model (`(logits, Context) -> logits`), run after the generic token
        suppression and before the sampling warpers."""
        return ()

    def program_options(self, config: GenerationConfig) -> tuple:
        """The options that `generation_processors` and `forced_decoder_prompt` read statically (a change of
        them needs another compiled program)."""
        return ()

    # The loops are explicit tf.while_loops; converting this Python with AutoGraph under
    # `tf.function(model.generate)` would only slow tracing down (about 2x).
    @tf.autograph.experimental.do_not_convert
    def generate(self, inputs=None, generation_config: GenerationConfig | None = None, seed=None,
                 kernels: native.Kernels | None = None, **kwargs):
        """Generates tokens; eagerly, or as one XLA program under `tf.function(jit_compile=True)`.

        Args:
            inputs: int `[B, P]` prompt ids (or pass `input_ids=`), left-padded for batches; for an
                encoder-decoder model, the encoder's input; for a speech model (Whisper), float log-mel
                `input_features` `[B, mel bins, frames]`, with `language`, `task` and `return_timestamps`
                among the options.
            generation_config: Overrides the model's defaults (`generation_config.json`).
            seed: Optional `[2]` ints (or one int), each in the int32 range, for reproducible sampling.
            kernels: Where xlagen's native kernels run in the program traced (`xlagen.native.Kernels`; None:
                the policy in force, `xlagen.native.current()`). It matters under XLA only
                (`tf.function(jit_compile=True)`); an eager call runs TensorFlow's ops.
            **kwargs: `attention_mask` `[B, P]`; for encoder-decoder models `decoder_input_ids` `[B, P']`
                (a decoder prompt starting with decoder_start_token_id) and `decoder_attention_mask`;
                and any `GenerationConfig` field (max_new_tokens, num_beams, do_sample, ...).

        Returns:
            int32 `[B * num_return_sequences, P + N]` tokens (pad after EOS), or a `GenerateOutput`
            with `return_dict_in_generate=True`. Encoder-decoder models return the decoder's sequences:
            the decoder prompt (the start token by default) and the new tokens.

        Raises:
            TypeError: for inputs or options of the wrong type (float token ids, `num_beams=2.5`).
            ValueError: for invalid options, inputs or lengths, or a call whose estimated memory exceeds
                the limit (`max_memory_gb`), before anything is traced. Values (token ids within the
                vocabulary, 0/1 masks, finite features) are checked when known: eagerly, not for tensor
                arguments of a `tf.function` (`CompiledGenerator` always checks them).
        """
        request = parse_request(self, inputs, generation_config, seed, kwargs)
        config, prompt_length = request.config, request.prompt.ids.shape[1]
        plan = make_plan(self, config, request.max_new_tokens)
        runtime = make_runtime(config, request.max_new_tokens, prompt_length, seed)
        with native.tracing(kernels):
            return format_output(run(self, request.prompt, plan, runtime, config), config)


def seed_tensor(seed, needed: bool) -> tf.Tensor:
    """A `[2]` int32 seed; a fresh random one per call when `seed` is None and sampling needs one."""
    if seed is None and not needed:
        return tf.zeros([2], tf.int32)
    if seed is None:
        return tf.random.uniform([2], maxval=2**31 - 1, dtype=tf.int32)
    checks.check_seed(seed)
    seed = tf.reshape(tf.cast(tf.convert_to_tensor(seed), tf.int32), [-1])
    return tf.concat([tf.zeros([max(0, 2 - seed.shape[0])], tf.int32), seed], 0)[-2:]
