"""OPT (Zhang et al. 2022, "OPT: Open Pre-trained Transformer Language Models").

Must match transformers' `models/opt/modeling_opt.py` (OPTForCausalLM) on the same checkpoint.
What is OPT's own: learned positions offset by 2, derived from the attention mask so that left padding
does not move them; the post-norm layout of OPT-350m (`do_layer_norm_before=False`, no final norm);
token embeddings narrower than the model (`word_embed_proj_dim`) with `project_in` / `project_out`.
Known divergences: padding tokens get position 0 (+2) where transformers gives them -1 (+2); padding
positions are masked, so the logits of real tokens are the same. transformers scales the queries before
the query-key product, xlagen scales the scores (equal up to float rounding). Dropout and LayerDrop are
not applied, also not in training (`fit` trains OPT without them).
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
from xlagen.models.base import DecoderOnlyLM, positions_from_mask
from xlagen.models.training import CausalLMTraining

logger = logging.getLogger(__name__)

# OPT looks position p up at row p + 2 of its position table (a fairseq padding_idx leftover).
POSITION_OFFSET = 2

# HF config keys that do not change inference math (training-only, bookkeeping, or task heads).
_IGNORED_HF_KEYS = frozenset({
    "_name_or_path", "architectures", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "init_std", "dropout", "attention_dropout", "layerdrop", "activation_dropout", "model_type",
    "id2label", "label2id", "output_past", "return_dict", "output_hidden_states", "output_attentions",
    "torchscript", "problem_type", "tokenizer_class", "prefix", "chunk_size_feed_forward", "is_decoder",
    "is_encoder_decoder", "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder",
    "sep_token_id", "decoder_start_token_id", "finetuning_task", "task_specific_params", "max_length",
    "min_length", "do_sample", "early_stopping", "num_beams", "temperature", "top_k", "top_p",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
    "gradient_checkpointing", "scale_embedding",
})

# HF key -> our field.
_HF_NAMES = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
             "num_attention_heads": "num_heads", "ffn_dim": "intermediate_size",
             "max_position_embeddings": "max_positions", "word_embed_proj_dim": "embedding_size",
             "activation_function": "activation", "do_layer_norm_before": "norm_first",
             "_remove_final_layer_norm": "remove_final_norm", "enable_bias": "use_bias",
             "layer_norm_elementwise_affine": "norm_affine", "tie_word_embeddings": "tie_word_embeddings",
             "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "pad_token_id"}

# Our field -> the kind of value it takes (checked in `__post_init__`, and with HF names in `from_hf_config`).
KINDS = {"vocab_size": checks.size, "hidden_size": checks.size, "num_layers": checks.size, "num_heads": checks.size,
         "intermediate_size": checks.size, "max_positions": checks.size, "embedding_size": checks.optional_size,
         "layer_norm_eps": checks.epsilon, "activation": checks.string, "norm_first": checks.boolean,
         "remove_final_norm": checks.boolean, "use_bias": checks.boolean, "norm_affine": checks.boolean,
         "tie_word_embeddings": checks.boolean, "bos_token_id": checks.token_id, "eos_token_id": checks.token_ids,
         "pad_token_id": checks.token_id}


@dataclass(frozen=True)
class OPTConfig:
    """OPT architecture; defaults are OPT-125m.

    Attributes:
        vocab_size: V.
        hidden_size: Model width.
        num_layers: L (HF `num_hidden_layers`).
        num_heads: H (HF `num_attention_heads`).
        intermediate_size: Feed-forward width (HF `ffn_dim`).
        max_positions: Learned positions (HF `max_position_embeddings`; the table has 2 more rows).
        embedding_size: Token embedding width (HF `word_embed_proj_dim`, None -> hidden_size); when it
            differs from hidden_size, `project_in` / `project_out` map between the two.
        layer_norm_eps: Fixed at PyTorch's LayerNorm default (not an HF key).
        activation: HF `activation_function`.
        norm_first: Pre-norm blocks and a final norm (HF `do_layer_norm_before`); False is OPT-350m.
        remove_final_norm: Drop the final norm of pre-norm models (HF `_remove_final_layer_norm`).
        use_bias: Biases in the attention and feed-forward projections (HF `enable_bias`).
        norm_affine: LayerNorms with scale and bias (HF `layer_norm_elementwise_affine`).
        tie_word_embeddings: The LM head reuses the token embedding.
        bos_token_id, eos_token_id, pad_token_id: Special ids from config.json.
    """

    vocab_size: int = 50272
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    max_positions: int = 2048
    embedding_size: int | None = None
    layer_norm_eps: float = 1e-5
    activation: str = "relu"
    norm_first: bool = True
    remove_final_norm: bool = False
    use_bias: bool = True
    norm_affine: bool = True
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 2
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = 1

    model_type = "opt"

    def __post_init__(self):
        """Raises:
            ValueError: naming a field of the wrong type or out of range, hidden_size not divisible by
                num_heads, or an unknown activation.
        """
        checks.check_fields(self, KINDS)
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.embedding_size is None:
            object.__setattr__(self, "embedding_size", self.hidden_size)
        try:
            get_activation(self.activation)
        except ValueError as e:
            raise ValueError(f"activation_function: {e}") from None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def has_final_norm(self) -> bool:
        return self.norm_first and not self.remove_final_norm

    @property
    def projects_embeddings(self) -> bool:
        return self.embedding_size != self.hidden_size

    @classmethod
    def from_hf_config(cls, hf: dict) -> "OPTConfig":
        """Maps a transformers `config.json` dict.

        Raises:
            ValueError: naming the config.json key, for a value of the wrong type or out of range, or a
                setting that changes the math and is unsupported.
        """
        if hf.get("pruned_heads"):
            raise ValueError(f"config.json: pruned_heads={hf['pruned_heads']} is not supported by xlagen's OPT "
                             "(transformers' OPT has no head pruning either)")
        unknown = sorted(set(hf) - set(_HF_NAMES) - _IGNORED_HF_KEYS - {"pruned_heads"})
        if unknown:
            logger.warning("config.json keys ignored by xlagen's OPT: %s", unknown)
        return checks.from_hf(cls, hf, _HF_NAMES, KINDS)

    def to_hf_config(self) -> dict:
        """The transformers `config.json` dict for this configuration."""
        values = {theirs: getattr(self, ours) for theirs, ours in _HF_NAMES.items()}
        return {"model_type": "opt", "architectures": ["OPTForCausalLM"], **values}

    def replace(self, **changes) -> "OPTConfig":
        return dataclasses.replace(self, **changes)


def block_spec(config: OPTConfig) -> BlockSpec:
    """OPT's block: pre- or post-norm, optional biases and LayerNorm affine parameters."""
    return BlockSpec(config.hidden_size, config.num_heads, config.head_dim, config.intermediate_size,
                     config.activation, config.head_dim ** -0.5, config.layer_norm_eps,
                     norm_first=config.norm_first, use_bias=config.use_bias, norm_affine=config.norm_affine)


class OPTLM(CausalLMTraining, DecoderOnlyLM, keras.Model):
    """OPT with its language-modelling head, as a Keras 3 model.

    Args:
        config: The architecture.
    """

    def __init__(self, config: OPTConfig, **kwargs):
        kwargs.setdefault("name", "opt")
        super().__init__(**kwargs)
        self.config = config
        policy = self.dtype_policy
        self.token_embedding = TokenEmbedding(config.vocab_size, config.embedding_size, name="token_embedding",
                                              dtype=policy)
        self.position_embedding = PositionEmbedding(config.max_positions + POSITION_OFFSET, config.hidden_size,
                                                    name="position_embedding", dtype=policy)
        self.project_in = self.project_out = None
        if config.projects_embeddings:
            self.project_in = Dense(config.hidden_size, use_bias=False, name="project_in", dtype=policy)
            self.project_out = Dense(config.embedding_size, use_bias=False, name="project_out", dtype=policy)
        spec = block_spec(config)
        self.blocks = [TransformerBlock(spec, name=f"block_{i}", dtype=policy) for i in range(config.num_layers)]
        self.final_norm = None
        if config.has_final_norm:
            self.final_norm = layer_norm(config.layer_norm_eps, "final_norm", policy, config.norm_affine)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = Dense(config.vocab_size, use_bias=False, name="lm_head", dtype=policy)
        self.build_all()

    def build_all(self):
        """Creates every variable (so weights can be assigned before the first call)."""
        hidden, embedding = self.config.hidden_size, self.config.embedding_size
        self.token_embedding.build((None, None))
        self.position_embedding.build((None, None))
        for block in self.blocks:
            block.build((None, None, hidden))
        optional = [(self.project_in, embedding), (self.project_out, hidden), (self.final_norm, hidden),
                    (self.lm_head, embedding)]
        for layer, width in optional:
            if layer is not None:
                layer.build((None, None, width))
        self.built = True

    def _embed(self, token_ids, positions, training=False):
        x = self.token_embedding(token_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        return x + self.position_embedding(positions + POSITION_OFFSET)

    def _finish(self, hidden):
        if self.final_norm is not None:
            hidden = self.final_norm(hidden)
        return hidden if self.project_out is None else self.project_out(hidden)

    def _default_positions(self, attention_mask):
        # transformers' OPT derives positions from the mask in its forward too (left padding).
        return positions_from_mask(attention_mask)
