"""Whisper (Radford et al. 2022, "Robust Speech Recognition via Large-Scale Weak Supervision").

Must match transformers' `models/whisper/modeling_whisper.py` (WhisperForConditionalGeneration) on the
same checkpoint. What is Whisper's own: the encoder's convolutional stem (two 3-wide convolutions with
GELU, the second with stride 2, over the log-mel frames), its fixed sinusoidal positions (stored in the
checkpoint), learned decoder positions, pre-norm blocks whose key projections have no bias, and the
output projection tied to the token embedding.
Known divergences: decoder positions come from the attention mask (the n-th real token is at n - 1), so a
left-padded decoder prompt keeps its positions; transformers counts columns, which is the same without
padding (the case of every prompt transformers' `generate` builds). The encoder needs exactly
`2 * max_source_positions` frames (3000, 30 s), as in transformers.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import keras
from keras import ops

from xlagen.layers.attention import causal_mask
from xlagen.layers.block import BlockSpec, CrossInputs, TransformerBlock, run_blocks
from xlagen.layers.embeddings import PositionEmbedding, TokenEmbedding
from xlagen.layers.feedforward import get_activation
from xlagen.layers.norms import layer_norm
from xlagen.models import config_checks as checks
from xlagen.models.base import (EncoderContext, EncoderDecoderLM, Seq2SeqLMOutput, encoder_context, positions_at,
                                positions_from_mask)
from xlagen.models.training import Seq2SeqLMTraining

logger = logging.getLogger(__name__)

# HF config keys that do not change inference math here (training-only, bookkeeping, generation defaults
# that generation_config.json carries, or features xlagen does not use such as SpecAugment masking).
_IGNORED_HF_KEYS = frozenset({
    "_name_or_path", "architectures", "transformers_version", "torch_dtype", "dtype", "use_cache", "model_type",
    "is_encoder_decoder", "init_std", "encoder_layerdrop", "decoder_layerdrop", "use_weighted_layer_sum",
    "classifier_proj_size", "apply_spec_augment", "mask_time_prob", "mask_time_length", "mask_time_min_masks",
    "mask_feature_prob", "mask_feature_length", "mask_feature_min_masks", "median_filter_width",
    "num_hidden_layers", "scale_embedding", "forced_decoder_ids", "suppress_tokens", "begin_suppress_tokens",
    "max_length", "output_past", "gradient_checkpointing", "id2label", "label2id", "return_dict",
    "output_hidden_states", "output_attentions", "torchscript", "problem_type", "tokenizer_class",
    "chunk_size_feed_forward", "is_decoder", "add_cross_attention", "begin_suppress_tokens",
    "tie_encoder_decoder", "task_specific_params", "prefix", "sep_token_id", "finetuning_task",
})

# HF key -> our field.
_HF_NAMES = {"vocab_size": "vocab_size", "num_mel_bins": "num_mel_bins", "d_model": "hidden_size",
             "encoder_layers": "encoder_layers", "encoder_attention_heads": "encoder_heads",
             "encoder_ffn_dim": "encoder_ffn_dim", "decoder_layers": "decoder_layers",
             "decoder_attention_heads": "decoder_heads", "decoder_ffn_dim": "decoder_ffn_dim",
             "max_source_positions": "max_source_positions", "max_target_positions": "max_positions",
             "activation_function": "activation", "dropout": "dropout", "attention_dropout": "attention_dropout",
             "activation_dropout": "activation_dropout", "tie_word_embeddings": "tie_word_embeddings",
             "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "pad_token_id",
             "decoder_start_token_id": "decoder_start_token_id"}

# Our field -> the kind of value it takes (checked in `__post_init__`, and with HF names in `from_hf_config`).
KINDS = {**{name: checks.size for name in ("vocab_size", "num_mel_bins", "hidden_size", "encoder_layers",
                                           "encoder_heads", "encoder_ffn_dim", "decoder_layers", "decoder_heads",
                                           "decoder_ffn_dim", "max_source_positions", "max_positions")},
         "activation": checks.string, "dropout": checks.rate, "attention_dropout": checks.rate,
         "activation_dropout": checks.rate, "tie_word_embeddings": checks.boolean, "bos_token_id": checks.token_id,
         "eos_token_id": checks.token_ids, "pad_token_id": checks.token_id, "decoder_start_token_id": checks.token_id}

LAYER_NORM_EPS = 1e-5  # PyTorch's nn.LayerNorm default, which transformers' Whisper uses everywhere


@dataclass(frozen=True)
class WhisperConfig:
    """Whisper architecture; defaults are whisper-tiny (multilingual).

    Attributes:
        vocab_size: V.
        num_mel_bins: Log-mel channels of the input (80; 128 for large-v3).
        hidden_size: Model width (HF `d_model`).
        encoder_layers, decoder_layers: Blocks per stack.
        encoder_heads, decoder_heads: Attention heads per stack (head dim = hidden_size / heads).
        encoder_ffn_dim, decoder_ffn_dim: Feed-forward widths.
        max_source_positions: Encoder positions (frames after the stride-2 stem); the input has twice that.
        max_positions: Decoder positions (HF `max_target_positions`): prompt + new tokens must fit.
        activation: Feed-forward and stem activation (HF `activation_function`).
        dropout, attention_dropout, activation_dropout: Training-time dropout rates.
        tie_word_embeddings: The output projection is the token embedding (all released checkpoints).
        bos_token_id, eos_token_id, pad_token_id, decoder_start_token_id: Special ids.
    """

    vocab_size: int = 51865
    num_mel_bins: int = 80
    hidden_size: int = 384
    encoder_layers: int = 4
    encoder_heads: int = 6
    encoder_ffn_dim: int = 1536
    decoder_layers: int = 4
    decoder_heads: int = 6
    decoder_ffn_dim: int = 1536
    max_source_positions: int = 1500
    max_positions: int = 448
    activation: str = "gelu"
    dropout: float = 0.0
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 50257
    eos_token_id: int | list[int] | None = 50257
    pad_token_id: int | None = 50257
    decoder_start_token_id: int | None = 50258

    model_type = "whisper"
    is_encoder_decoder = True
    main_input_name = "input_features"

    def __post_init__(self):
        """Raises:
            ValueError: naming a field of the wrong type or out of range, hidden_size not divisible by
                a number of heads, or an unknown activation.
        """
        checks.check_fields(self, KINDS)
        for name in ("encoder_heads", "decoder_heads"):
            if self.hidden_size % getattr(self, name):
                raise ValueError(f"hidden_size {self.hidden_size} is not divisible by {name} {getattr(self, name)}")
        get_activation(self.activation)

    @property
    def input_frames(self) -> int:
        """Log-mel frames the encoder takes (3000 for every released checkpoint: 30 s at 100 frames/s)."""
        return 2 * self.max_source_positions

    @classmethod
    def from_hf_config(cls, hf: dict) -> "WhisperConfig":
        """Maps a transformers `config.json` dict.

        Raises:
            ValueError: naming the config.json key, for a value of the wrong type or out of range, or a
                setting that changes the math and is unsupported.
        """
        if hf.get("tie_word_embeddings", True) is False:
            raise ValueError("config.json: tie_word_embeddings=false is not supported by xlagen's Whisper "
                             "(every released Whisper ties its output projection to the token embedding)")
        unknown = sorted(set(hf) - set(_HF_NAMES) - _IGNORED_HF_KEYS)
        if unknown:
            logger.warning("config.json keys ignored by xlagen's Whisper: %s", unknown)
        return checks.from_hf(cls, hf, _HF_NAMES, KINDS)

    def to_hf_config(self) -> dict:
        """The transformers `config.json` dict for this configuration."""
        values = {theirs: getattr(self, ours) for theirs, ours in _HF_NAMES.items()}
        return {"model_type": "whisper", "architectures": ["WhisperForConditionalGeneration"], **values,
                "num_hidden_layers": self.encoder_layers, "is_encoder_decoder": True}

    def replace(self, **changes) -> "WhisperConfig":
        return dataclasses.replace(self, **changes)


def block_spec(config: WhisperConfig, decoder: bool) -> BlockSpec:
    """Whisper's pre-norm block (LayerNorm, scaled attention with biases, GELU feed-forward)."""
    heads = config.decoder_heads if decoder else config.encoder_heads
    head_dim = config.hidden_size // heads
    return BlockSpec(config.hidden_size, heads, head_dim, config.decoder_ffn_dim if decoder else config.encoder_ffn_dim,
                     config.activation, head_dim ** -0.5, LAYER_NORM_EPS, attention_dropout=config.attention_dropout,
                     residual_dropout=config.dropout, feed_forward_dropout=config.activation_dropout,
                     cross_attention=decoder)


class ConvStem(keras.layers.Layer):
    """Whisper's input stem: log-mel `[B, n_mels, frames]` -> `[B, frames / 2, hidden]`.

    Two convolutions of width 3 padded by one frame on each side (the second with stride 2), each
    followed by the activation; written with explicit padding because Keras' "same" padding puts the
    odd pad of a strided convolution on the right only.
    """

    def __init__(self, hidden_size: int, activation: str, **kwargs):
        super().__init__(**kwargs)
        self.hidden_size = hidden_size
        self.activation = get_activation(activation)
        self.conv1 = keras.layers.Conv1D(hidden_size, 3, name="conv1", dtype=self.dtype_policy)
        self.conv2 = keras.layers.Conv1D(hidden_size, 3, strides=2, name="conv2", dtype=self.dtype_policy)

    def build(self, input_shape):
        self.conv1.build((None, None, input_shape[1]))
        self.conv2.build((None, None, self.hidden_size))
        self.built = True

    def call(self, features):
        x = ops.transpose(ops.cast(features, self.compute_dtype), (0, 2, 1))  # [B, frames, n_mels]
        pad = [[0, 0], [1, 1], [0, 0]]
        x = self.activation(self.conv1(ops.pad(x, pad)))
        return self.activation(self.conv2(ops.pad(x, pad)))


class WhisperLM(Seq2SeqLMTraining, EncoderDecoderLM, keras.Model):
    """Whisper's encoder-decoder with its language-modelling head, as a Keras 3 model.

    Args:
        config: The architecture.
    """

    def __init__(self, config: WhisperConfig, **kwargs):
        kwargs.setdefault("name", "whisper")
        super().__init__(**kwargs)
        self.config = config
        policy = self.dtype_policy
        self.stem = ConvStem(config.hidden_size, config.activation, name="stem", dtype=policy)
        # Fixed sinusoids, but stored in (and loaded from) the checkpoint as transformers does.
        self.encoder_positions = PositionEmbedding(config.max_source_positions, config.hidden_size, trainable=False,
                                                   name="encoder_positions", dtype=policy)
        self.encoder_blocks = [TransformerBlock(block_spec(config, False), name=f"encoder_block_{i}", dtype=policy)
                               for i in range(config.encoder_layers)]
        self.encoder_final_norm = layer_norm(LAYER_NORM_EPS, "encoder_final_norm", policy)
        self.token_embedding = TokenEmbedding(config.vocab_size, config.hidden_size, name="token_embedding",
                                              dtype=policy)
        self.position_embedding = PositionEmbedding(config.max_positions, config.hidden_size,
                                                    name="position_embedding", dtype=policy)
        self.decoder_blocks = [TransformerBlock(block_spec(config, True), name=f"decoder_block_{i}", dtype=policy)
                               for i in range(config.decoder_layers)]
        self.decoder_final_norm = layer_norm(LAYER_NORM_EPS, "decoder_final_norm", policy)
        self.dropout = keras.layers.Dropout(config.dropout)
        self.build_all()

    def build_all(self):
        """Creates every variable (so weights can be assigned before the first call)."""
        self.stem.build((None, self.config.num_mel_bins, None))
        for layer in (self.encoder_positions, self.token_embedding, self.position_embedding):
            layer.build((None, None))
        for layer in (*self.encoder_blocks, *self.decoder_blocks, self.encoder_final_norm, self.decoder_final_norm):
            layer.build((None, None, self.config.hidden_size))
        self.built = True

    def _check_features(self, input_features) -> None:
        shape = tuple(input_features.shape)
        expected = (self.config.num_mel_bins, self.config.input_frames)
        if len(shape) != 3 or shape[1:] != expected:
            raise ValueError(f"Whisper expects input_features of shape [batch, {expected[0]}, {expected[1]}] "
                             f"(log-mel bins x frames of 30 s, from WhisperFeatureExtractor), got {list(shape)}")

    def encode(self, input_features, training=False):
        """The encoder.

        Args:
            input_features: float `[B, n_mels, 2 * max_source_positions]` log-mel features.
            training: Applies dropout.

        Returns:
            The encoder output `[B, L, hidden]`, L = max_source_positions.
        """
        self._check_features(input_features)
        x = self.stem(input_features)
        x = self.dropout(x + ops.cast(self.encoder_positions.embeddings, x.dtype)[None], training=training)
        x, _ = run_blocks(self.encoder_blocks, x, None, training=training)  # no mask: every frame is real
        return self.encoder_final_norm(x)

    def _context(self, encoder_output, fold: bool = False) -> EncoderContext:
        return encoder_context(self.decoder_blocks, encoder_output, None, fold)  # every frame is real

    def _decode(self, token_ids, positions, mask, context: EncoderContext, cache=None, cache_index=None,
                last_only=False, training=False):
        """The decoder and the tied output projection on `token_ids` `[B, T]` at `positions` `[B, T]`."""
        x = self.token_embedding(token_ids) + self.position_embedding(positions)
        x = self.dropout(x, training=training)
        cross = [CrossInputs(memory, context.key_mask()) for memory in context.layer_memories()]
        x, new_cache = run_blocks(self.decoder_blocks, x, mask, cache, cache_index, training, cross=cross)
        x = self.decoder_final_norm(x[:, -1:] if last_only else x)
        return ops.cast(self.token_embedding.attend(x), "float32"), new_cache

    def _check_length(self, length) -> None:
        if length is not None and length > self.config.max_positions:
            raise ValueError(f"decoder input has {length} tokens, more than Whisper's "
                             f"max_target_positions={self.config.max_positions}")

    def call(self, input_features, decoder_input_ids=None, decoder_attention_mask=None, labels=None,
             training=False):
        """Full forward pass (training, scoring, parity).

        Args:
            input_features: float `[B, n_mels, frames]`, or Keras' dict of these arguments.
            decoder_input_ids: int `[B, T]`; None derives them from `labels` (`shift_right`).
            decoder_attention_mask: Optional `[B, T]` 1/0.
            labels: Optional int `[B, T]` (only used to derive `decoder_input_ids`).
            training: Applies dropout.

        Returns:
            `Seq2SeqLMOutput` with float32 logits `[B, T, V]`.
        """
        if isinstance(input_features, dict):
            given = input_features
            input_features = given["input_features"]
            decoder_input_ids = given.get("decoder_input_ids", decoder_input_ids)
            decoder_attention_mask = given.get("decoder_attention_mask", decoder_attention_mask)
            labels = given.get("labels", labels)
        if decoder_input_ids is None:
            if labels is None:
                raise ValueError("Whisper needs decoder_input_ids, or labels to derive them from")
            decoder_input_ids = self.shift_right(labels)
        decoder_input_ids = ops.convert_to_tensor(decoder_input_ids)
        self._check_length(decoder_input_ids.shape[1])
        if decoder_attention_mask is None:
            decoder_attention_mask = ops.ones_like(decoder_input_ids)
        context = self._context(self.encode(ops.convert_to_tensor(input_features), training))
        positions = positions_from_mask(decoder_attention_mask)
        mask = causal_mask(decoder_attention_mask, 0, decoder_input_ids.shape[1])
        logits, _ = self._decode(decoder_input_ids, positions, mask, context, training=training)
        return Seq2SeqLMOutput(logits)

    # The decoding contract (see `xlagen.models.base.EncoderDecoderLM`).

    def _encoder_inputs(self, input_features, attention_mask) -> dict:
        """The encoder's features (see `EncoderDecoderLM`); Whisper's encoder takes no mask.

        Raises:
            ValueError: for features of the wrong shape.
        """
        self._check_features(input_features)
        return {"input_features": input_features}

    def encode_context(self, input_features) -> EncoderContext:
        """Runs the encoder once and projects its output to every decoder block's cross-attention keys/values
        (or keeps it for the folded cross-attention, see `encoder_context`)."""
        return self._context(self.encode(input_features), fold=True)

    def decoder_cache_shape(self) -> tuple[int, int, int]:
        """(layers, heads, head_dim) of the decoder's self-attention cache."""
        heads = self.config.decoder_heads
        return self.config.decoder_layers, heads, self.config.hidden_size // heads

    def _decode_cached(self, token_ids, cache, cache_index, attention_mask, last_only, context, slots):
        num_tokens = token_ids.shape[1]
        positions = positions_at(attention_mask, cache_index, num_tokens)
        mask = causal_mask(attention_mask, cache_index, num_tokens, slots)
        return self._decode(token_ids, positions, mask, context, cache, cache_index, last_only)
