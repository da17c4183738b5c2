"""T5 (Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
Transformer"), v1.0 and v1.1 / FLAN-T5.

Must match transformers' `models/t5/modeling_t5.py` (T5ForConditionalGeneration) on the same checkpoint.
What is T5's own: RMS norms without bias, attention without score scaling and without biases, a learned
relative position bias (bucketed distances, bidirectional in the encoder, causal in the decoder)
computed by the first block of each stack and shared by all blocks; the decoder output scaled by
d_model ** -0.5 before the LM head (v1.0, whose head is the embedding; not v1.1 / FLAN-T5); the gated-GELU
feed-forward of v1.1.
Two transformers conventions meet in config.json. transformers 4.x scales iff `tie_word_embeddings`
(v1.1 writes false and stores `lm_head.weight`). transformers >= 5 writes `tie_word_embeddings: true`
always plus `scale_decoder_outputs`, and uses a stored `lm_head.weight` that differs from `shared.weight`
as a separate head; xlagen reads both (`T5Config.from_hf_config`, `xlagen.weights.t5.resolve_config`).
T5 has no learned positions, so `max_positions` is None (no limit, as in transformers) unless set explicitly.
Known divergences: padding positions of the encoder input are embedded as id 0 in `generate` (their
outputs are masked, so real positions are unchanged). In `generate`, `decoder_input_ids` must start with
decoder_start_token_id (transformers prepends it when no row does; that depends on values, which a
compiled program cannot branch on); rows that finished are filled with the pad id, where transformers'
beam search fills them with EOS when the pad id is 0 (its `pad_token_id or eos_token_id`). Unlike
transformers 4.57's `generate`, stacks of different depths (`num_decoder_layers != num_layers`) decode.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import keras
import numpy as np
from keras import ops

from xlagen.layers.attention import RelativeBias, causal_mask, padding_mask
from xlagen.layers.block import BlockSpec, CrossInputs, TransformerBlock, run_blocks
from xlagen.layers.dense import Dense
from xlagen.layers.embeddings import TokenEmbedding
from xlagen.layers.feedforward import get_activation
from xlagen.layers.norms import rms_norm
from xlagen.models import config_checks as checks
from xlagen.models.base import EncoderContext, EncoderDecoderLM, Seq2SeqLMOutput, encoder_context
from xlagen.models.training import Seq2SeqLMTraining

logger = logging.getLogger(__name__)

# HF config keys that do not change inference math (training-only, bookkeeping, or task heads).
# `n_positions` (512 in the original checkpoints) is informational: transformers does not enforce it.
_IGNORED_HF_KEYS = frozenset({
    "_name_or_path", "architectures", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "initializer_factor", "classifier_dropout", "model_type", "is_encoder_decoder", "n_positions", "output_past",
    "task_specific_params", "gradient_checkpointing", "id2label", "label2id", "return_dict",
    "output_hidden_states", "output_attentions", "torchscript", "problem_type", "tokenizer_class", "prefix",
    "chunk_size_feed_forward", "is_decoder", "add_cross_attention", "cross_attention_hidden_size",
    "sep_token_id", "finetuning_task", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
    "temperature", "top_k", "top_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences",
})
# Keys that would change the math if set, and that xlagen does not implement.
_REFUSED_HF_KEYS = ("pruned_heads", "tie_encoder_decoder")

# HF key -> our field (the feed-forward keys are mapped by `_feed_forward_from_hf`).
_HF_NAMES = {"vocab_size": "vocab_size", "d_model": "hidden_size", "num_layers": "num_layers",
             "num_decoder_layers": "num_decoder_layers", "num_heads": "num_heads", "d_kv": "head_dim",
             "d_ff": "intermediate_size", "relative_attention_num_buckets": "relative_attention_buckets",
             "relative_attention_max_distance": "relative_attention_max_distance",
             "layer_norm_epsilon": "layer_norm_eps", "dropout_rate": "dropout",
             "tie_word_embeddings": "tie_word_embeddings", "scale_decoder_outputs": "scale_decoder_outputs",
             "bos_token_id": "bos_token_id",
             "eos_token_id": "eos_token_id", "pad_token_id": "pad_token_id",
             "decoder_start_token_id": "decoder_start_token_id"}

# Our field -> the kind of value it takes (checked in `__post_init__`, and with HF names in `from_hf_config`).
KINDS = {**{name: checks.size for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim",
                                           "intermediate_size", "relative_attention_buckets",
                                           "relative_attention_max_distance")},
         "num_decoder_layers": checks.optional_size, "max_positions": checks.optional_size,
         "layer_norm_eps": checks.epsilon, "activation": checks.string, "gated": checks.boolean,
         "tie_word_embeddings": checks.boolean, "dropout": checks.rate, "bos_token_id": checks.token_id,
         "eos_token_id": checks.token_ids, "pad_token_id": checks.token_id, "decoder_start_token_id": checks.token_id}
# `distance_buckets` builds a table of 2 * relative_attention_max_distance + 1 entries.
MAX_RELATIVE_DISTANCE = 1 << 20


def _feed_forward_from_hf(hf: dict) -> dict:
    """`activation` and `gated` as transformers' T5Config derives them (explicit keys win, as there)."""
    for key, kind in (("feed_forward_proj", checks.string), ("dense_act_fn", checks.string),
                      ("is_gated_act", checks.boolean)):
        if key in hf:
            try:
                kind(key, hf[key])
            except ValueError as e:
                raise ValueError(f"config.json: {e}") from None
    proj = hf.get("feed_forward_proj", "relu")
    parts = proj.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise ValueError(f"config.json: feed_forward_proj={proj!r} is not 'ACT' or 'gated-ACT'")
    activation = "gelu_new" if proj == "gated-gelu" else parts[-1]  # transformers' backward-compatible alias
    key = "dense_act_fn" if "dense_act_fn" in hf else "feed_forward_proj"
    activation = hf.get("dense_act_fn", activation)
    try:
        get_activation(activation)
    except ValueError as e:
        raise ValueError(f"config.json: {key}={hf.get(key)!r}: {e}") from None
    return {"activation": activation, "gated": bool(hf.get("is_gated_act", parts[0] == "gated"))}


@dataclass(frozen=True)
class T5Config:
    """T5 architecture; defaults are t5-small.

    Attributes:
        vocab_size: V.
        hidden_size: Model width (HF `d_model`).
        num_layers: Encoder blocks (HF `num_layers`).
        num_decoder_layers: Decoder blocks (None -> num_layers).
        num_heads: H.
        head_dim: D (HF `d_kv`; H * D need not equal hidden_size).
        intermediate_size: Feed-forward width (HF `d_ff`).
        relative_attention_buckets: Buckets of relative positions (HF `relative_attention_num_buckets`).
        relative_attention_max_distance: Distances beyond it share the last bucket.
        layer_norm_eps: HF `layer_norm_epsilon`.
        activation: The feed-forward activation (HF `dense_act_fn`, from `feed_forward_proj`).
        gated: Gated feed-forward, `wo(act(wi_0 x) * wi_1 x)` (HF `is_gated_act`, "gated-*").
        tie_word_embeddings: The LM head reuses the embedding (else a separate `lm_head` matrix).
        scale_decoder_outputs: The decoder output is multiplied by hidden_size ** -0.5 before the LM head
            (T5 v1.0); None (the default) means the same as `tie_word_embeddings`, transformers 4.x's rule.
        dropout: Dropout rate in training (HF `dropout_rate`).
        max_positions: An optional limit of the encoder input and of the decoder sequence lengths;
            None (transformers' behaviour, and what `from_hf_config` gives) is no limit.
        bos_token_id, eos_token_id, pad_token_id, decoder_start_token_id: Special ids.
    """

    vocab_size: int = 32128
    hidden_size: int = 512
    num_layers: int = 6
    num_decoder_layers: int | None = None
    num_heads: int = 8
    head_dim: int = 64
    intermediate_size: int = 2048
    relative_attention_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_eps: float = 1e-6
    activation: str = "relu"
    gated: bool = False
    tie_word_embeddings: bool = True
    scale_decoder_outputs: bool | None = None
    dropout: float = 0.1
    max_positions: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = 0
    decoder_start_token_id: int | None = 0

    model_type = "t5"
    is_encoder_decoder = True

    def __post_init__(self):
        """Raises:
            ValueError: naming a field of the wrong type or out of range, or an unknown activation.
        """
        checks.check_fields(self, KINDS)
        if self.num_decoder_layers is None:
            object.__setattr__(self, "num_decoder_layers", self.num_layers)
        if self.scale_decoder_outputs is None:
            object.__setattr__(self, "scale_decoder_outputs", self.tie_word_embeddings)
        if self.relative_attention_buckets < 4:
            raise ValueError(f"relative_attention_buckets must be at least 4 (half of them for each direction, "
                             f"half of those exact), got {self.relative_attention_buckets}")
        # The logarithmic buckets span exact..max_distance, exact = relative_attention_buckets // 2 in the decoder.
        if not self.relative_attention_buckets // 2 < self.relative_attention_max_distance <= MAX_RELATIVE_DISTANCE:
            raise ValueError(f"relative_attention_max_distance must be more than relative_attention_buckets // 2 "
                             f"({self.relative_attention_buckets // 2}) and at most {MAX_RELATIVE_DISTANCE}, got "
                             f"{self.relative_attention_max_distance}")
        get_activation(self.activation)

    @classmethod
    def from_hf_config(cls, hf: dict) -> "T5Config":
        """Maps a transformers `config.json` dict.

        `scale_decoder_outputs` (written by transformers >= 5) decides the rescaling when present, else
        `tie_word_embeddings` does (transformers 4.x). Whether a head stored in the checkpoint replaces the
        tied one is decided with the tensors (`xlagen.weights.t5.resolve_config`).

        Raises:
            ValueError: naming the config.json key, for a value of the wrong type or out of range (a
                `tie_word_embeddings` or `scale_decoder_outputs` that is not true or false), or a setting
                that changes the math and is unsupported.
        """
        for key in ("tie_word_embeddings", "scale_decoder_outputs"):
            if key in hf and not isinstance(hf[key], bool):
                raise ValueError(f"config.json: {key}={hf[key]!r} must be true or false")
        for key in _REFUSED_HF_KEYS:
            if hf.get(key):
                raise ValueError(f"config.json: {key}={hf[key]!r} is not supported by xlagen's T5")
        feed_forward = _feed_forward_from_hf(hf)
        known = set(_HF_NAMES) | {"feed_forward_proj", "dense_act_fn", "is_gated_act", *_REFUSED_HF_KEYS}
        unknown = sorted(set(hf) - known - _IGNORED_HF_KEYS)
        if unknown:
            logger.warning("config.json keys ignored by xlagen's T5: %s", unknown)
        return checks.from_hf(cls, hf, _HF_NAMES, KINDS, **feed_forward)

    def to_hf_config(self) -> dict:
        """The transformers `config.json` dict that `save_pretrained` writes for this configuration.

        transformers 4.x can only express a tied head with scaling or a separate head without, so the other
        two combinations are saved with a separate head (`xlagen.weights.t5.saved_tensors` writes it):
        `tie_word_embeddings` and `scale_decoder_outputs` are then both false, and 4.x and >= 5 compute the
        same logits.
        """
        values = {theirs: getattr(self, ours) for theirs, ours in _HF_NAMES.items()}
        tied = self.tie_word_embeddings and self.scale_decoder_outputs
        values.update(tie_word_embeddings=tied, scale_decoder_outputs=tied)
        proj = ("gated-" if self.gated else "") + self.activation
        return {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], **values,
                "feed_forward_proj": proj, "dense_act_fn": self.activation, "is_gated_act": self.gated,
                "is_encoder_decoder": True}

    def replace(self, **changes) -> "T5Config":
        return dataclasses.replace(self, **changes)


def distance_buckets(num_buckets: int, max_distance: int) -> np.ndarray:
    """The bucket of each distance 0..2 * max_distance (larger ones share the last), as transformers'
    `_relative_position_bucket` computes it: exact below num_buckets // 2, then logarithmic up to
    max_distance. Evaluated in float32 like the reference, so the bucket edges agree exactly.

    Returns:
        int32 `[2 * max_distance + 1]`.
    """
    exact = num_buckets // 2
    distance = np.arange(2 * max_distance + 1)
    ratio = np.maximum(distance, 1).astype(np.float32) / np.float32(exact)
    scaled = np.log(ratio) / np.float32(math.log(max_distance / exact)) * np.float32(num_buckets - exact)
    large = np.minimum(exact + scaled.astype(np.int64), num_buckets - 1)
    return np.where(distance < exact, distance, large).astype(np.int32)


class RelativePositionBias(keras.layers.Embedding):
    """T5's learned per-head score bias, one row per bucket of the key-query distance.

    Args:
        num_buckets: Rows of the table (HF `relative_attention_num_buckets`).
        max_distance: HF `relative_attention_max_distance`.
        num_heads: H.
        bidirectional: Encoder (keys on both sides: half the buckets each) or decoder (keys before).
    """

    def __init__(self, num_buckets: int, max_distance: int, num_heads: int, bidirectional: bool, **kwargs):
        super().__init__(num_buckets, num_heads, **kwargs)
        self.bidirectional = bidirectional
        self.side_buckets = num_buckets // 2 if bidirectional else num_buckets
        self.distance_buckets = distance_buckets(self.side_buckets, max_distance)

    def bias(self, query_positions, key_positions):
        """The bias of explicit positions (never derived from a cache's contents).

        Args:
            query_positions: int32 `[T]`.
            key_positions: int32 `[S]`.

        Returns:
            `[1, H, T, S]`.
        """
        buckets = self._buckets(key_positions[None, :] - query_positions[:, None])  # [T, S]
        return ops.transpose(self(buckets), (2, 0, 1))[None]  # [T, S, H] -> [1, H, T, S]

    def relative_bias(self, length) -> RelativeBias:
        """The bias of positions 0..length-1 over themselves (an encoder's), as the `RelativeBias` of its
        2 * length - 1 distances: the same values as `bias(positions, positions)`, which it expands to."""
        distances = ops.arange(length - 1, dtype="int32") - (length - 1)  # -(length - 1) .. -1
        distances = ops.concatenate([distances, ops.arange(length, dtype="int32")], axis=0)
        table = ops.transpose(self(self._buckets(distances)), (1, 0))[None]  # [1, H, 2 * length - 1]
        return RelativeBias(table)

    def _buckets(self, relative):
        """The bucket of each key position minus query position in `relative`."""
        if self.bidirectional:
            offset, distance = ops.where(relative > 0, self.side_buckets, 0), ops.abs(relative)
        else:
            offset, distance = 0, ops.maximum(-relative, 0)
        table = ops.convert_to_tensor(self.distance_buckets)
        return offset + ops.take(table, ops.minimum(distance, len(self.distance_buckets) - 1))


def block_spec(config: T5Config, cross_attention: bool) -> BlockSpec:
    """T5's pre-norm block: RMS norms, unscaled bias-free attention, dropout after every sub-layer."""
    return BlockSpec(config.hidden_size, config.num_heads, config.head_dim, config.intermediate_size,
                     config.activation, 1.0, config.layer_norm_eps, use_bias=False,
                     attention_dropout=config.dropout, residual_dropout=config.dropout, rms_norm=True,
                     gated=config.gated, feed_forward_dropout=config.dropout, cross_attention=cross_attention)


class T5LM(Seq2SeqLMTraining, EncoderDecoderLM, keras.Model):
    """T5 with its language-modelling head, as a Keras 3 model.

    Args:
        config: The architecture.
    """

    def __init__(self, config: T5Config, **kwargs):
        kwargs.setdefault("name", "t5")
        super().__init__(**kwargs)
        self.config = config
        policy = self.dtype_policy
        self.token_embedding = TokenEmbedding(config.vocab_size, config.hidden_size, name="token_embedding",
                                              dtype=policy)
        buckets, distance = config.relative_attention_buckets, config.relative_attention_max_distance
        self.encoder_position_bias = RelativePositionBias(buckets, distance, config.num_heads, bidirectional=True,
                                                          name="encoder_position_bias", dtype=policy)
        self.decoder_position_bias = RelativePositionBias(buckets, distance, config.num_heads, bidirectional=False,
                                                          name="decoder_position_bias", dtype=policy)
        self.encoder_blocks = [TransformerBlock(block_spec(config, False), name=f"encoder_block_{i}", dtype=policy)
                               for i in range(config.num_layers)]
        self.decoder_blocks = [TransformerBlock(block_spec(config, True), name=f"decoder_block_{i}", dtype=policy)
                               for i in range(config.num_decoder_layers)]
        self.encoder_final_norm = rms_norm(config.layer_norm_eps, "encoder_final_norm", policy)
        self.decoder_final_norm = rms_norm(config.layer_norm_eps, "decoder_final_norm", policy)
        self.dropout = keras.layers.Dropout(config.dropout)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = Dense(config.vocab_size, use_bias=False, name="lm_head", dtype=policy)
        self.build_all()

    def build_all(self):
        """Creates every variable (so weights can be assigned before the first call)."""
        for layer in (self.token_embedding, self.encoder_position_bias, self.decoder_position_bias):
            layer.build((None, None))
        for layer in (*self.encoder_blocks, *self.decoder_blocks, self.encoder_final_norm, self.decoder_final_norm,
                      self.lm_head):
            if layer is not None:
                layer.build((None, None, self.config.hidden_size))
        self.built = True

    def _check_length(self, length, what: str) -> None:
        limit = self.config.max_positions
        if limit is not None and length is not None and length > limit:
            raise ValueError(f"{what} has {length} tokens, more than this T5's max_positions={limit}")

    def encode(self, input_ids, attention_mask, training=False):
        """The encoder.

        Args:
            input_ids: int `[B, L]`.
            attention_mask: `[B, L]` 1/0 (padding anywhere).
            training: Applies dropout.

        Returns:
            The encoder output `[B, L, hidden]`.
        """
        bias = self.encoder_position_bias.relative_bias(ops.shape(input_ids)[1])
        mask = padding_mask(attention_mask)
        x = self.dropout(self.token_embedding(input_ids), training=training)
        x, _ = run_blocks(self.encoder_blocks, x, mask, training=training, position_bias=bias)
        return self.dropout(self.encoder_final_norm(x), training=training)

    def _context(self, encoder_output, attention_mask, fold: bool = False) -> EncoderContext:
        return encoder_context(self.decoder_blocks, encoder_output, attention_mask, fold)

    def _decode(self, token_ids, attention_mask, context: EncoderContext, cache=None, cache_index=None,
                last_only=False, training=False, slots=None):
        """The decoder and LM head on `token_ids` `[B, T]` at positions cache_index.. (0.. without a cache),
        attending over `attention_mask` `[B, S]` (the whole cache, or the T tokens)."""
        start = 0 if cache_index is None else cache_index
        num_tokens = token_ids.shape[1]
        queries = ops.cast(start, "int32") + ops.arange(num_tokens, dtype="int32")
        bias = self.decoder_position_bias.bias(queries, ops.arange(ops.shape(attention_mask)[1], dtype="int32"))
        mask, cross_mask = causal_mask(attention_mask, start, num_tokens, slots), context.key_mask()
        x = self.dropout(self.token_embedding(token_ids), training=training)
        cross = [CrossInputs(memory, cross_mask) for memory in context.layer_memories()]
        x, new_cache = run_blocks(self.decoder_blocks, x, mask, cache, cache_index, training, bias, cross)
        x = self.dropout(self.decoder_final_norm(x[:, -1:] if last_only else x), training=training)
        if self.config.scale_decoder_outputs:  # Mesh TensorFlow's rescaling before the projection (v1.0)
            x = x * self.config.hidden_size ** -0.5
        logits = self.token_embedding.attend(x) if self.lm_head is None else self.lm_head(x)
        return ops.cast(logits, "float32"), new_cache

    def call(self, input_ids, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None, labels=None,
             training=False):
        """Full forward pass (training, scoring, parity).

        Args:
            input_ids: int `[B, L]` encoder input, or Keras' dict of these arguments.
            attention_mask: Optional `[B, L]` 1/0.
            decoder_input_ids: int `[B, T]`; None derives them from `labels` (`shift_right`).
            decoder_attention_mask: Optional `[B, T]` 1/0.
            labels: Optional int `[B, T]` (only used to derive `decoder_input_ids`; see `compute_loss`).
            training: Applies dropout.

        Returns:
            `Seq2SeqLMOutput` with float32 logits `[B, T, V]`.

        Raises:
            ValueError: without decoder_input_ids and labels, or for lengths beyond `max_positions`.
        """
        if isinstance(input_ids, dict):
            given = input_ids
            input_ids = given["input_ids"]
            attention_mask = given.get("attention_mask", attention_mask)
            decoder_input_ids = given.get("decoder_input_ids", decoder_input_ids)
            decoder_attention_mask = given.get("decoder_attention_mask", decoder_attention_mask)
            labels = given.get("labels", labels)
        if decoder_input_ids is None:
            if labels is None:
                raise ValueError("T5 needs decoder_input_ids, or labels to derive them from")
            decoder_input_ids = self.shift_right(labels)
        input_ids, decoder_input_ids = ops.convert_to_tensor(input_ids), ops.convert_to_tensor(decoder_input_ids)
        self._check_length(input_ids.shape[1], "input_ids")
        self._check_length(decoder_input_ids.shape[1], "decoder_input_ids")
        if attention_mask is None:
            attention_mask = ops.ones_like(input_ids)
        if decoder_attention_mask is None:
            decoder_attention_mask = ops.ones_like(decoder_input_ids)
        context = self._context(self.encode(input_ids, attention_mask, training), attention_mask)
        logits, _ = self._decode(decoder_input_ids, decoder_attention_mask, context, training=training)
        return Seq2SeqLMOutput(logits)

    # The decoding contract (see `xlagen.models.base.EncoderDecoderLM`).

    def _encoder_inputs(self, input_ids, attention_mask) -> dict:
        """The encoder's ids and mask (see `EncoderDecoderLM`).

        Raises:
            ValueError: for an encoder input beyond `max_positions`.
        """
        self._check_length(input_ids.shape[1], "input_ids")
        # Padding positions hold id 0 (their outputs are masked) so that any pad id is a valid index.
        return {"encoder_ids": ops.where(ops.cast(attention_mask, "bool"), input_ids, 0),
                "encoder_mask": attention_mask}

    def encode_context(self, encoder_ids, encoder_mask) -> EncoderContext:
        """Runs the encoder once and projects its output to every decoder block's cross-attention keys/values
        (or keeps it for the folded cross-attention, see `encoder_context`)."""
        return self._context(self.encode(encoder_ids, encoder_mask), encoder_mask, fold=True)

    def decoder_cache_shape(self) -> tuple[int, int, int]:
        """(layers, heads, head_dim) of the decoder's self-attention cache."""
        return self.config.num_decoder_layers, self.config.num_heads, self.config.head_dim

    def _decode_cached(self, token_ids, cache, cache_index, attention_mask, last_only, context, slots):
        return self._decode(token_ids, attention_mask, context, cache, cache_index, last_only, slots=slots)
