"""GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners").

Must match transformers' `models/gpt2/modeling_gpt2.py` (GPT2LMHeadModel) on the same checkpoint.
Known divergences: `reorder_and_upcast_attn` only changes float16 numerics in the reference; here all
attention scores are computed in float32 anyway, so both settings give the reference's float32 result.
transformers' default SDPA attention path ignores `scale_attn_weights=False` and
`scale_attn_by_inverse_layer_idx=True`; xlagen follows its "eager" attention, which honours both.
Dropout (embedding, residual, attention probabilities) applies only with `training=True`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import keras

from xlagen.layers.block import BlockSpec, TransformerBlock
from xlagen.layers.dense import Dense
from xlagen.layers.embeddings import PositionEmbedding, TokenEmbedding
from xlagen.layers.feedforward import get_activation
from xlagen.layers.norms import layer_norm
from xlagen.models import config_checks as checks
from xlagen.models.base import DecoderOnlyLM, column_positions
from xlagen.models.training import CausalLMTraining

logger = logging.getLogger(__name__)

# HF config keys that do not change inference math (training-only, bookkeeping, or task heads).
_IGNORED_HF_KEYS = frozenset({
    "_name_or_path", "architectures", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "initializer_range", "summary_type", "summary_use_proj",
    "summary_activation", "summary_proj_to_labels", "summary_first_dropout", "task_specific_params",
    "n_ctx", "gradient_checkpointing", "id2label", "label2id", "output_past", "model_type",
    "reorder_and_upcast_attn", "return_dict", "output_hidden_states", "output_attentions",
    "torchscript", "pruned_heads", "problem_type", "tokenizer_class", "prefix", "chunk_size_feed_forward",
    "is_decoder", "is_encoder_decoder", "cross_attention_hidden_size", "tie_encoder_decoder",
    "sep_token_id", "decoder_start_token_id", "finetuning_task", "max_length", "min_length",
    "do_sample", "early_stopping", "num_beams", "temperature", "top_k", "top_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
})


# HF key -> our field.
_HF_NAMES = {"vocab_size": "vocab_size", "n_embd": "hidden_size", "n_layer": "num_layers", "n_head": "num_heads",
             "n_inner": "intermediate_size", "n_positions": "max_positions", "layer_norm_epsilon": "layer_norm_eps",
             "activation_function": "activation", "scale_attn_weights": "scale_attn_weights",
             "scale_attn_by_inverse_layer_idx": "scale_attn_by_inverse_layer_idx",
             "tie_word_embeddings": "tie_word_embeddings", "bos_token_id": "bos_token_id",
             "eos_token_id": "eos_token_id", "pad_token_id": "pad_token_id", "embd_pdrop": "embedding_dropout",
             "resid_pdrop": "residual_dropout", "attn_pdrop": "attention_dropout"}

# Our field -> the kind of value it takes (checked in `__post_init__`, and with HF names in `from_hf_config`).
KINDS = {"vocab_size": checks.size, "hidden_size": checks.size, "num_layers": checks.size, "num_heads": checks.size,
         "intermediate_size": checks.optional_size, "max_positions": checks.size, "layer_norm_eps": checks.epsilon,
         "activation": checks.string, "scale_attn_weights": checks.boolean,
         "scale_attn_by_inverse_layer_idx": checks.boolean, "tie_word_embeddings": checks.boolean,
         "bos_token_id": checks.token_id, "eos_token_id": checks.token_ids, "pad_token_id": checks.token_id,
         "embedding_dropout": checks.rate, "residual_dropout": checks.rate, "attention_dropout": checks.rate}


@dataclass(frozen=True)
class GPT2Config:
    """GPT-2 architecture; defaults are GPT-2 small (124M).

    Attributes:
        vocab_size: V.
        hidden_size: Model width (HF `n_embd`).
        num_layers: L (HF `n_layer`).
        num_heads: H (HF `n_head`).
        intermediate_size: MLP width (HF `n_inner`, None -> 4 * hidden_size).
        max_positions: Learned positions (HF `n_positions`).
        layer_norm_eps: HF `layer_norm_epsilon`.
        activation: HF `activation_function`.
        scale_attn_weights: Divide scores by sqrt(head_dim).
        scale_attn_by_inverse_layer_idx: Also divide scores of layer i by i + 1.
        tie_word_embeddings: The LM head reuses the token embedding.
        bos_token_id, eos_token_id, pad_token_id: Special ids from config.json.
        embedding_dropout, residual_dropout, attention_dropout: Training-time dropout rates (HF
            `embd_pdrop`, `resid_pdrop`, `attn_pdrop`).
    """

    vocab_size: int = 50257
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int | None = None
    max_positions: int = 1024
    layer_norm_eps: float = 1e-5
    activation: str = "gelu_new"
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 50256
    eos_token_id: int | list[int] | None = 50256
    pad_token_id: int | None = None
    embedding_dropout: float = 0.1
    residual_dropout: float = 0.1
    attention_dropout: float = 0.1

    model_type = "gpt2"

    def __post_init__(self):
        """Raises:
            ValueError: naming a field of the wrong type or out of range, hidden_size not divisible by
                num_heads, or an unknown activation.
        """
        checks.check_fields(self, KINDS)
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        get_activation(self.activation)
        if self.intermediate_size is None:
            object.__setattr__(self, "intermediate_size", 4 * self.hidden_size)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf_config(cls, hf: dict) -> "GPT2Config":
        """Maps a transformers `config.json` dict.

        Raises:
            ValueError: naming the config.json key, for a value of the wrong type or out of range
                ("config.json: n_layer must be a positive integer, got 1e+10 (float)"), or a setting
                that changes the math and is unsupported.
        """
        if hf.get("add_cross_attention"):
            raise ValueError("config.json: add_cross_attention=True (GPT-2 as a decoder with cross-attention) "
                             "is not supported by xlagen")
        unknown = sorted(set(hf) - set(_HF_NAMES) - _IGNORED_HF_KEYS - {"add_cross_attention"})
        if unknown:
            logger.warning("config.json keys ignored by xlagen's GPT-2: %s", unknown)
        return checks.from_hf(cls, hf, _HF_NAMES, KINDS)

    def to_hf_config(self) -> dict:
        """The transformers `config.json` dict for this configuration."""
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": self.vocab_size,
                "n_embd": self.hidden_size, "n_layer": self.num_layers, "n_head": self.num_heads,
                "n_inner": self.intermediate_size, "n_positions": self.max_positions,
                "layer_norm_epsilon": self.layer_norm_eps, "activation_function": self.activation,
                "scale_attn_weights": self.scale_attn_weights,
                "scale_attn_by_inverse_layer_idx": self.scale_attn_by_inverse_layer_idx,
                "tie_word_embeddings": self.tie_word_embeddings, "bos_token_id": self.bos_token_id,
                "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id,
                "embd_pdrop": self.embedding_dropout, "resid_pdrop": self.residual_dropout,
                "attn_pdrop": self.attention_dropout}

    def replace(self, **changes) -> "GPT2Config":
        return dataclasses.replace(self, **changes)


def block_spec(config: GPT2Config, layer_index: int) -> BlockSpec:
    """The shared pre-norm block, with GPT-2's optional per-layer attention scaling."""
    scale = config.head_dim ** -0.5 if config.scale_attn_weights else 1.0
    if config.scale_attn_by_inverse_layer_idx:
        scale /= layer_index + 1
    return BlockSpec(config.hidden_size, config.num_heads, config.head_dim, config.intermediate_size,
                     config.activation, scale, config.layer_norm_eps, attention_dropout=config.attention_dropout,
                     residual_dropout=config.residual_dropout)


class GPT2LMHead(CausalLMTraining, DecoderOnlyLM, keras.Model):
    """GPT-2 with its language-modelling head, as a Keras 3 model.

    Args:
        config: The architecture.
    """

    def __init__(self, config: GPT2Config, **kwargs):
        kwargs.setdefault("name", "gpt2")
        super().__init__(**kwargs)
        self.config = config
        self.token_embedding = TokenEmbedding(config.vocab_size, config.hidden_size, name="token_embedding",
                                              dtype=self.dtype_policy)
        self.position_embedding = PositionEmbedding(config.max_positions, config.hidden_size,
                                                    name="position_embedding", dtype=self.dtype_policy)
        self.embedding_dropout = keras.layers.Dropout(config.embedding_dropout)
        self.blocks = [TransformerBlock(block_spec(config, i), name=f"block_{i}", dtype=self.dtype_policy)
                       for i in range(config.num_layers)]
        self.final_norm = layer_norm(config.layer_norm_eps, "final_norm", self.dtype_policy)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = Dense(config.vocab_size, use_bias=False, name="lm_head", dtype=self.dtype_policy)
        self.build_all()

    def build_all(self):
        """Creates every variable (so weights can be assigned before the first call)."""
        self.token_embedding.build((None, None))
        self.position_embedding.build((None, None))
        for block in self.blocks:
            block.build((None, None, self.config.hidden_size))
        self.final_norm.build((None, None, self.config.hidden_size))
        if self.lm_head is not None:
            self.lm_head.build((None, self.config.hidden_size))
        self.built = True

    def _embed(self, token_ids, positions, training=False):
        x = self.token_embedding(token_ids) + self.position_embedding(positions)
        return self.embedding_dropout(x, training=training)

    def _finish(self, hidden):
        return self.final_norm(hidden)

    def _default_positions(self, attention_mask):
        return column_positions(attention_mask)
