"""SavedModel export of the compiled generate: a model that serves with TensorFlow alone.

`export_saved_model` writes one serving signature per decoding strategy ("greedy", "sample",
"beam"), each taking token ids and an attention mask `[B, P]` with a dynamic batch size and a
dynamic prompt length, and returning the sequences and their scores. Where the tokenizer allows it
(byte-level BPE: GPT-2, OPT), a "<strategy>_text" signature takes strings and returns strings, with
the tokenizer inside the graph (`xlagen.text.graph_tokenizer`). The generation inside is the same
`generation.api.run` that `model.generate` uses, built like `CompiledGenerator`'s programs
(`always=True` processors, numeric options as tensors), so for the same inputs and options the
SavedModel returns exactly `model.generate`'s tokens.

Shapes inside: the prompt length is padded on the left up to a declared bucket (one XLA program per
bucket, chosen with a `switch_case` outside XLA; an encoder-decoder model's encoder input is padded
on the right instead), and the batch up to a batch bucket by repeating row 0 (XLA compiles once
per batch bucket, on first use). The new-token capacity N is fixed at export; `max_new_tokens` is
a runtime input `<= N`. Numeric options are signature inputs with defaults (SignatureDef
`defaults`), so a client may leave them out. Bad inputs (a prompt beyond the largest bucket,
`max_new_tokens` beyond N, a non-positive temperature, mismatched shapes) fail with TensorFlow's
InvalidArgumentError before anything is generated; wrong dtypes are rejected by the signature.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import tensorflow as tf

from xlagen import native
from xlagen.generation.api import make_plan, make_runtime, resolve_config, run
from xlagen.generation.config import GenerationConfig
from xlagen.generation.loop import Prompt, is_eos
from xlagen.generation.sampling import Runtime, top_k_capacity
from xlagen.text import graph_tokenizer

logger = logging.getLogger(__name__)

STRATEGIES = ("greedy", "sample", "beam")
_INT_MAX = 2**31 - 1
_DEFAULT_NEW_TOKENS = 64


@dataclass(frozen=True)
class ExportConfig:
    """What to export and the static shapes it serves.

    Attributes:
        strategies: Subset of STRATEGIES, one signature (two with text) each; the first is also
            "serving_default".
        max_new_tokens: N, the bound of the runtime `max_new_tokens` (its default). None (the
            default): 64, or half the positions of a causal model with fewer than 128 (the other
            half is left to the prompt).
        prompt_lengths: Prompt length buckets (ascending); None picks 8, 16, 32, ... up to what
            fits the model's positions (at most 512). Longer prompts are rejected at serving time.
        batch_sizes: Batch buckets (ascending); a batch is padded up to the next one, so XLA
            compiles one program per bucket. A batch beyond the largest runs at its own size.
        num_beams: K for "beam" (static: part of the program).
        num_return_sequences: R for "sample" and "beam".
        text: Text signatures: None = when the tokenizer allows, True = required (raise if not),
            False = never.
        output_scores: Give greedy and sample signatures a `scores` output (the chosen tokens'
            log-probabilities). The program then keeps every step's scores, B x N x V floats (for
            GPT-2's vocabulary, 823 MB at B = 64 and N = 64); turn it off for large batches. Beam
            signatures always return `sequences_scores`, which cost nothing.
    """

    strategies: tuple[str, ...] = STRATEGIES
    max_new_tokens: int | None = None
    prompt_lengths: tuple[int, ...] | None = None
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    num_beams: int = 4
    num_return_sequences: int = 1
    text: bool | None = None
    output_scores: bool = True

    def __post_init__(self):
        strategies = tuple(self.strategies)
        unknown = [s for s in strategies if s not in STRATEGIES]
        if not strategies or unknown or len(set(strategies)) != len(strategies):
            raise ValueError(f"strategies must be distinct names among {STRATEGIES}, got {strategies}")
        object.__setattr__(self, "strategies", strategies)
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        for name in ("prompt_lengths", "batch_sizes"):
            values = getattr(self, name)
            if values is None:
                continue
            values = tuple(int(v) for v in values)
            if not values or min(values) < 1 or list(values) != sorted(set(values)):
                raise ValueError(f"{name} must be positive, distinct and ascending, got {values}")
            object.__setattr__(self, name, values)


def _resolve_new_tokens(model, export: ExportConfig) -> ExportConfig:
    """`export` with `max_new_tokens` set: the default fits the model's positions (see ExportConfig)."""
    if export.max_new_tokens is not None:
        return export
    limit = model.config.max_positions
    causal = not getattr(model.config, "is_encoder_decoder", False)
    new_tokens = min(_DEFAULT_NEW_TOKENS, limit // 2) if causal and limit is not None else _DEFAULT_NEW_TOKENS
    return dataclasses.replace(export, max_new_tokens=max(1, new_tokens))


def _strategy_config(base: GenerationConfig, strategy: str, export: ExportConfig) -> GenerationConfig:
    """The generation config of one signature; raises ValueError saying which combination fails and why."""
    beams, returned = export.num_beams, export.num_return_sequences
    changes = {"greedy": {"do_sample": False, "num_beams": 1, "num_return_sequences": 1},
               "sample": {"do_sample": True, "num_beams": 1, "num_return_sequences": returned},
               "beam": {"do_sample": False, "num_beams": beams, "num_return_sequences": returned}}[strategy]
    if strategy == "beam" and beams < 2:
        raise ValueError(f"cannot export 'beam' with num_beams={beams}: beam search needs num_beams >= 2 "
                         "(use the 'greedy' strategy for one beam)")
    try:
        return base.update(max_new_tokens=export.max_new_tokens, return_dict_in_generate=False,
                           output_scores=export.output_scores and strategy != "beam", **changes)
    except ValueError as error:
        raise ValueError(f"cannot export the {strategy!r} signature with these options: {error}") from None


def _refuse_packed(model, what: str) -> None:
    """Packed (bfloat16 or int8) weights run through xlagen's native kernel, which a serving process lacks."""
    if getattr(model, "packed_weights", False):
        raise ValueError(f"{what} cannot hold a model with packed {model.weight_dtype} weights: its program calls "
                         "xlagen's native kernel, which a process without xlagen does not have; load the "
                         "model without weight_dtype to export it")


def _default_buckets(limit: int | None, new_tokens: int, encoder_decoder: bool) -> tuple[int, ...]:
    room = 512 if limit is None else min(512, limit if encoder_decoder else limit - new_tokens)
    sizes, size = [], 8
    while size <= room:
        sizes.append(size)
        size *= 2
    if not sizes or sizes[-1] < room:
        sizes.append(room)
    return tuple(s for s in sizes if s >= 1)


def _check_buckets(model, export: ExportConfig) -> tuple[int, ...]:
    """The prompt buckets, checked against the model's positions."""
    limit = model.config.max_positions
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    if limit is not None and not encoder_decoder and export.max_new_tokens >= limit:
        raise ValueError(f"max_new_tokens {export.max_new_tokens} leaves no room for a prompt in the model's "
                         f"{limit} positions: export with a smaller --max-new-tokens")
    buckets = export.prompt_lengths or _default_buckets(limit, export.max_new_tokens, encoder_decoder)
    if limit is not None:
        room = limit if encoder_decoder else limit - export.max_new_tokens
        if buckets[-1] > room:
            raise ValueError(f"prompt length bucket {buckets[-1]} + {export.max_new_tokens} new tokens exceeds the "
                             f"model's {limit} positions: use prompt lengths <= {room} or lower max_new_tokens")
    return buckets


# Runtime options: name -> (dtype, shape). Which a signature offers depends on its strategy.
_OPTION_SPECS = {"max_new_tokens": (tf.int32, []), "repetition_penalty": (tf.float32, []),
                 "temperature": (tf.float32, []), "top_k": (tf.int32, []), "top_p": (tf.float32, []),
                 "seed": (tf.int32, [None]), "length_penalty": (tf.float32, [])}


def _option_defaults(config: GenerationConfig, strategy: str, top_k_width: int) -> dict:
    """The options a strategy's signature takes, with their defaults (the model's generation config)."""
    options = {"max_new_tokens": config.max_new_tokens, "repetition_penalty": config.repetition_penalty}
    if strategy == "sample":
        options.update(temperature=config.temperature, top_p=config.top_p)
        if top_k_width:
            options["top_k"] = config.top_k
        options["seed"] = []  # empty: a fresh random seed per call
    if strategy == "beam":
        options["length_penalty"] = float(config.length_penalty)
    return {name: tf.constant(value, _OPTION_SPECS[name][0]) for name, value in options.items()}


def _declare(function, name: str, inputs: dict, defaults: dict):
    """`function(*args)` as a tf.function named `name` with keyword parameters: `inputs` (specs, required)
    then `defaults` (optional; saved as the signature's defaults)."""
    parameter = inspect.Parameter
    params = [parameter(key, parameter.POSITIONAL_OR_KEYWORD) for key in inputs]
    params += [parameter(key, parameter.POSITIONAL_OR_KEYWORD, default=value) for key, value in defaults.items()]
    function.__signature__ = inspect.Signature(params)
    function.__name__ = name
    specs = list(inputs.values()) + [tf.TensorSpec(_OPTION_SPECS[key][1], _OPTION_SPECS[key][0], name=key)
                                     for key in defaults]
    return tf.function(function, input_signature=specs, autograph=False)


class _Strategy:
    """The serving functions of one decoding strategy: bucket dispatch around the XLA programs."""

    def __init__(self, model, strategy: str, config: GenerationConfig, export: ExportConfig,
                 buckets: tuple[int, ...], prepare):
        self.model, self.strategy, self.config, self.export, self.buckets = model, strategy, config, export, buckets
        vocab = model.config.vocab_size
        self.top_k_width = top_k_capacity(config.top_k, vocab) if strategy == "sample" and config.top_k else 0
        self.plan = make_plan(model, config, export.max_new_tokens, always=True)
        self.defaults = _option_defaults(config, strategy, self.top_k_width)
        self.prepare = prepare
        # The XLA program; it is traced once per prompt bucket (its input shapes), and XLA compiles it
        # once per (bucket, batch size) on first use.
        self.program = tf.function(self._core, jit_compile=True, autograph=False)

    def _core(self, prompt: Prompt, runtime) -> dict:
        """The XLA program: the sequences, and per-beam scores (beam) or per-token scores (output_scores)."""
        decoded = run(self.model, prompt, self.plan, runtime, self.config)
        sequences, sequence_scores, step_scores = decoded.sequences, decoded.sequence_scores, decoded.scores
        if sequence_scores is not None:
            return {"sequences": sequences, "sequences_scores": sequence_scores}
        if step_scores is None:
            return {"sequences": sequences}
        new = sequences[:, prompt.ids.shape[1]:]  # [B * R, N]
        log_probs = tf.nn.log_softmax(step_scores, axis=-1)  # [B * R, N, V]
        chosen = tf.gather(log_probs, tf.minimum(new, log_probs.shape[-1] - 1), axis=2, batch_dims=2)
        ended = tf.cumsum(tf.cast(is_eos(new, runtime.eos_ids), tf.int32), axis=1, exclusive=True) > 0
        return {"sequences": sequences, "scores": tf.where(ended, tf.zeros_like(chosen), chosen)}

    def _runtime(self, options: dict, prompt_length, prompt_start) -> Runtime:
        """The loops' runtime tensors: the signature's options over the strategy's defaults."""
        config = self.config
        runtime = make_runtime(config, self.export.max_new_tokens, 0, 0, prompt_start=prompt_start)
        min_new = tf.maximum(tf.maximum(config.min_length - prompt_length, config.min_new_tokens or 0), 0)
        changes = {name: options[name] for name in ("max_new_tokens", "repetition_penalty", "temperature", "top_k",
                                                    "top_p", "length_penalty") if name in options}
        if "seed" in options:
            changes["seed"] = _seed(options["seed"])
        return runtime._replace(min_new_tokens=tf.cast(min_new, tf.int32), **changes)

    def _checks(self, inputs: dict, options: dict) -> list:
        """Assertions on the request (they fail the call with InvalidArgumentError before generating)."""
        bound = self.export.max_new_tokens
        first = next(iter(inputs.values()))
        checks = [tf.debugging.assert_positive(tf.shape(first)[0], message="the batch is empty"),
                  tf.debugging.assert_less_equal(options["max_new_tokens"], bound, message=(
                      f"max_new_tokens must be <= {bound}, the bound this model was exported with")),
                  tf.debugging.assert_positive(options["max_new_tokens"], message="max_new_tokens must be >= 1"),
                  tf.debugging.assert_positive(options["repetition_penalty"], message="repetition_penalty must be > 0")]
        if "input_ids" in inputs and "attention_mask" in inputs:
            checks.append(tf.debugging.assert_equal(tf.shape(inputs["input_ids"]), tf.shape(inputs["attention_mask"]),
                                                    message="attention_mask must have the shape of input_ids"))
        if "temperature" in options:
            checks += [tf.debugging.assert_positive(options["temperature"], message="temperature must be > 0"),
                       tf.debugging.assert_positive(options["top_p"], message="top_p must be in (0, 1]"),
                       tf.debugging.assert_less_equal(options["top_p"], 1.0, message="top_p must be in (0, 1]"),
                       tf.debugging.assert_less_equal(tf.size(options["seed"]), 2,
                                                      message="seed must have 0, 1 or 2 elements")]
        if "top_k" in options:
            checks += [tf.debugging.assert_positive(options["top_k"], message="top_k must be >= 1"),
                       tf.debugging.assert_less_equal(options["top_k"], self.top_k_width, message=(
                           f"top_k must be <= {self.top_k_width}, the capacity this model was exported with"))]
        return checks

    def generate(self, inputs: dict, options: dict):
        """Signature inputs in, `(outputs, first new column)` out (outside XLA); the outputs are
        `sequences` `[B * R, P + m]` and the scores (see `output_names`).

        The one dynamic length (the decoder prompt's, else an encoder input's axis 1) is padded up to
        its bucket, on the left for a prompt and on the right for an encoder input.
        """
        config = self.config
        rows = tf.shape(next(iter(inputs.values())))[0]
        with tf.control_dependencies(self._checks(inputs, options)):
            take = _batch_rows(rows, self.export.batch_sizes)
        prompt = self.prepare(self.model, {name: tf.gather(t, take) for name, t in inputs.items()}, config)
        kept, end = rows * config.num_return_sequences, options["max_new_tokens"]
        left = prompt.ids.shape[1] is None
        dynamic = [t for t in prompt.extra.values() if t.shape.rank >= 2 and t.shape[1] is None]
        if left and dynamic:
            raise ValueError("export needs at most one dynamic length: the prompt's or the encoder input's")
        decoder_length = tf.shape(prompt.ids)[1] if left else prompt.ids.shape[1]

        def call(bucket):
            length = tf.shape(prompt.ids if left else dynamic[0])[1] if bucket else None
            shift = bucket - length if left else 0
            padded = _pad_to(prompt, bucket, length, left, config.pad_token_id or 0) if bucket else prompt
            outputs = self.program(padded, self._runtime(options, decoder_length, shift))
            trimmed = {"sequences": outputs["sequences"][:kept, shift:shift + decoder_length + end]}
            if "scores" in outputs:
                trimmed["scores"] = outputs["scores"][:kept, :end]
            if "sequences_scores" in outputs:
                trimmed["sequences_scores"] = outputs["sequences_scores"][:kept]
            return trimmed

        if not (left or dynamic):  # every shape is static (e.g. fixed-size audio features): one program
            return call(None), tf.constant(decoder_length)
        length = tf.shape(prompt.ids if left else dynamic[0])[1]
        largest = self.buckets[-1]
        with tf.control_dependencies([
                tf.debugging.assert_positive(length, message="the prompt must have at least one token"),
                tf.debugging.assert_less_equal(length, largest, message=(
                    f"the input is longer than the largest length this model was exported for ({largest})"))]):
            choice = tf.reduce_sum(tf.cast(tf.constant(self.buckets) < length, tf.int32))
        branches = [lambda bucket=bucket: call(bucket) for bucket in self.buckets]
        return tf.switch_case(choice, branches), decoder_length if left else tf.constant(decoder_length)

    def output_names(self) -> dict:
        """The outputs of the token-id signature, described."""
        names = {"sequences": "int32 [B * R, prompt length + max_new_tokens]"}
        if self.strategy == "beam":
            names["sequences_scores"] = "float32 [B * R]"
        elif self.config.output_scores:
            names["scores"] = "float32 [B * R, max_new_tokens]"
        return names


def _pad_to(prompt: Prompt, bucket: int, length, left: bool, pad_id: int) -> Prompt:
    """The prompt padded to its bucket: the ids on the left (masked), else the encoder inputs on the right."""
    if left:
        shift = bucket - length
        return Prompt(_fix(tf.pad(prompt.ids, [[0, 0], [shift, 0]], constant_values=pad_id), bucket),
                      _fix(tf.pad(prompt.mask, [[0, 0], [shift, 0]]), bucket), prompt.extra)
    extra = {name: _fix(tf.pad(t, [[0, 0], [0, bucket - length]]), bucket) if t.shape[1] is None else t
             for name, t in prompt.extra.items()}
    return prompt._replace(extra=extra)


def default_prepare(model, inputs: dict, config: GenerationConfig) -> Prompt:
    """The token-id signatures' inputs (`input_ids`, `attention_mask`) as the decoding loops' `Prompt`."""
    return Prompt(*model.generation_inputs(tf.cast(inputs["input_ids"], tf.int32),
                                           tf.cast(inputs["attention_mask"], tf.int32),
                                           config.decoder_start_token_id))


def _fix(tensor: tf.Tensor, length: int) -> tf.Tensor:
    """Gives `tensor` `[B, ?]` the static length of its bucket (the XLA program's input shape)."""
    return tf.ensure_shape(tensor, [None, length])


def _batch_rows(rows, sizes: tuple[int, ...]) -> tf.Tensor:
    """Row indices filling the batch up to its bucket by repeating row 0 (no padding beyond the largest)."""
    buckets = tf.constant(sizes, tf.int32)
    bucket = tf.reduce_min(tf.where(buckets >= rows, buckets, _INT_MAX))
    bucket = tf.where(bucket == _INT_MAX, rows, bucket)
    return tf.concat([tf.range(rows), tf.zeros([bucket - rows], tf.int32)], 0)


def _seed(seed: tf.Tensor) -> tf.Tensor:
    """xlagen's seed rule on a `[0..2]` vector: `[s]` -> `[0, s]`, `[a, b]` as is, `[]` -> fresh random."""
    given = tf.concat([tf.zeros([2], tf.int32), tf.cast(seed, tf.int32)], 0)[-2:]
    fresh = tf.random.uniform([2], maxval=_INT_MAX, dtype=tf.int32)
    return tf.where(tf.size(seed) > 0, given, fresh)


@dataclass(frozen=True)
class ExportedSignature:
    """One serving signature: its name, inputs (with defaults for the optional ones) and outputs."""

    name: str
    inputs: dict
    outputs: dict


class _ServingModule(tf.Module):
    """What `tf.saved_model.save` writes: the weights and one tf.function per signature."""


def export_saved_model(model, export_dir: str | Path, *, tokenizer=None, export: ExportConfig | None = None,
                       generation_config: GenerationConfig | None = None, input_specs: dict | None = None,
                       prepare=None, input_variants: dict | None = None, output_text=None,
                       **options) -> list[ExportedSignature]:
    """Writes a SavedModel whose signatures generate with XLA and need only TensorFlow to load.

    Args:
        model: An xlagen model (`TFAutoModelForGeneration.from_pretrained(...)`).
        export_dir: Folder to write (must not exist or be empty).
        tokenizer: The model's xlagen tokenizer, for the text signatures (None: ids only).
        export: Strategies, bounds and buckets.
        generation_config: Defaults of the numeric options and the static ones (EOS ids, top-k capacity,
            no_repeat_ngram_size, early_stopping, ...); default: the model's.
        input_specs: The ids signatures' model inputs as `{name: tf.TensorSpec}`, passed by name to
            `prepare`; default `input_ids` and `attention_mask`, int32 `[None, None]`. The batch axis
            is dynamic; at most one length may be (it is bucketed): the prompt's or an encoder input's axis 1.
        prepare: `(model, inputs dict, GenerationConfig) -> Prompt` building the decoding loops' prompt
            from the signature's inputs (batch-padded); default `default_prepare`. A speech model
            passes its own, with `input_specs` such as `{"input_features": TensorSpec([None, 80, 3000])}`.
        input_variants: Several ids signatures per strategy: `{name suffix: input_specs}` (e.g. Whisper's
            `{"": features, "_audio": waveform}`), instead of `input_specs`.
        output_text: An in-graph decoder (`decode_batch(ids) -> strings`, `resources()`) giving the ids
            signatures a `text` output of the new tokens.
        **options: `GenerationConfig` fields overriding `generation_config`.

    Returns:
        The signatures written, in order.

    Raises:
        ValueError: for an option/strategy combination that cannot be exported (saying which and why),
            text signatures asked for with a tokenizer that cannot run in the graph, or buckets that
            do not fit the model's positions.
        FileExistsError: if `export_dir` holds files.
    """
    _refuse_packed(model, "a SavedModel")
    export = _resolve_new_tokens(model, export or ExportConfig())
    export_dir = Path(export_dir)
    if export_dir.exists() and any(export_dir.iterdir()):
        raise FileExistsError(f"{export_dir} is not empty: choose a new folder for the SavedModel")
    base = resolve_config(model, generation_config, options)
    configs = {name: _strategy_config(base, name, export) for name in export.strategies}
    buckets = _check_buckets(model, export)
    strategies = [_Strategy(model, name, config, export, buckets, prepare or default_prepare)
                  for name, config in configs.items()]
    text = _text_tokenizer(model, tokenizer, export.text)
    input_specs = input_specs or {name: tf.TensorSpec([None, None], tf.int32, name=name)
                                  for name in ("input_ids", "attention_mask")}
    variants = input_variants or {"": input_specs}
    module = _ServingModule()
    module.weights = [variable.value for variable in model.weights]
    module.tokenizer_tables = [*(text.resources() if text is not None else ()),
                               *(output_text.resources() if output_text is not None else ())]
    signatures, described = {}, []
    for strategy in strategies:
        for suffix, specs in variants.items():
            for name, function, outputs in _serving_functions(strategy, specs, text if not suffix else None,
                                                              suffix, output_text):
                setattr(module, name, function)
                signatures[name] = function
                described.append(ExportedSignature(name, _describe_inputs(function, strategy.defaults), outputs))
    signatures["serving_default"] = signatures[export.strategies[0]]
    with native.tracing(native.Kernels.OFF):  # a serving process does not have xlagen's native kernels
        tf.saved_model.save(module, str(export_dir), signatures=signatures)
    _write_description(export_dir, export, buckets, described, strategies)
    logger.info("exported %s to %s", ", ".join(signatures), export_dir)
    return described


def _describe_inputs(function, defaults: dict) -> dict:
    """`{name: "dtype shape"}` with ` = default` for the optional inputs."""
    described = {}
    for spec in function.input_signature:
        text = f"{spec.dtype.name} {spec.shape.as_list()}".replace("None", "-1")
        if spec.name in defaults:
            value = defaults[spec.name].numpy().tolist()
            text += f" = {value:.7g}" if isinstance(value, float) else f" = {value}"
        described[spec.name] = text
    return described


def _serving_functions(strategy: _Strategy, input_specs: dict, text, suffix: str = "", output_text=None):
    """`(name, tf.function, output descriptions)` of a strategy's ids signature (named strategy + suffix,
    with a `text` output when `output_text` is given) and its text signature."""
    names = list(input_specs)

    def serve_ids(*args):
        inputs, options = dict(zip(names, args[:len(names)])), dict(zip(strategy.defaults, args[len(names):]))
        outputs, start = strategy.generate(inputs, options)
        if output_text is not None:
            outputs = {**outputs, "text": output_text.decode_batch(outputs["sequences"][:, start:])}
        return outputs

    outputs = strategy.output_names()
    if output_text is not None:
        outputs = {**outputs, "text": "string [B * R]"}
    name = strategy.strategy + suffix
    yield name, _declare(serve_ids, name, input_specs, strategy.defaults), outputs
    if text is None:
        return

    def serve_text(texts, *args):
        ids, mask = text.encode_batch(texts)
        outputs, start = strategy.generate({"input_ids": ids, "attention_mask": mask},
                                           dict(zip(strategy.defaults, args)))
        return {"text": text.decode_batch(outputs["sequences"][:, start:]), **outputs}

    name = f"{strategy.strategy}_text"
    specs = {"text": tf.TensorSpec([None], tf.string, name="text")}
    yield name, _declare(serve_text, name, specs, strategy.defaults), {"text": "string [B * R]", **outputs}


def _text_tokenizer(model, tokenizer, wanted: bool | None):
    """The in-graph tokenizer, or None (no tokenizer, declined, or not asked for)."""
    if wanted is False:
        return None
    if tokenizer is None:
        if wanted:
            raise ValueError("text signatures need the model's tokenizer: pass tokenizer=")
        return None
    try:
        return graph_tokenizer.GraphTokenizer.from_tokenizer(tokenizer, model.config.vocab_size)
    except graph_tokenizer.UnsupportedTokenizer as error:
        if wanted:
            raise ValueError(f"cannot export text signatures: {error}") from None
        logger.warning("exporting token-id signatures only: %s", error)
        return None


def _write_description(export_dir: Path, export: ExportConfig, buckets, signatures, strategies) -> None:
    """assets.extra/xlagen_export.json: what was exported (TensorFlow Serving ignores assets.extra)."""
    description = {
        "signatures": [dataclasses.asdict(s) for s in signatures],
        "max_new_tokens_bound": export.max_new_tokens, "prompt_length_buckets": list(buckets),
        "batch_size_buckets": list(export.batch_sizes),
        "generation_configs": {s.strategy: {k: v for k, v in s.config.to_dict().items() if v is not None}
                               for s in strategies},
    }
    folder = export_dir / "assets.extra"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "xlagen_export.json").write_text(json.dumps(description, indent=2, default=str) + "\n")
