"""The Llama family: Llama (Touvron et al. 2023), Mistral (Jiang et al. 2023), Qwen2 and Qwen3, one
implementation with config flags.

Must match transformers' `models/{llama,mistral,qwen2,qwen3}/modeling_*.py` (`*ForCausalLM`, eager
attention) on the same checkpoint. What the family shares: rotary position embeddings applied to the
queries and keys before they are cached (`layers.rotary`: the default, linear, dynamic, llama3 and yarn
types of transformers' `modeling_rope_utils`), grouped-query attention (the cache holds the key/value
heads only), a SwiGLU feed-forward (`down(silu(gate(x)) * up(x))`), RMS norms before each sub-layer and
at the end, no learned positions. What differs, by model_type:

- llama: `attention_bias` (query/key/value and output projections), `mlp_bias`;
- mistral: `sliding_window` (each query sees at most that many positions, its own included);
- qwen2: biases on the query/key/value projections (not on the output);
- qwen3: `attention_bias`, and an RMS norm of each query and key head before the rotation;
- qwen2, qwen3: with `use_sliding_window`, the window on the layers `layer_types` names sliding (by
  default those from `max_window_layers` on).

Refused by name: sliding `layer_types` without `use_sliding_window`, rope types other than those above (e.g. longrope), a `partial_rotary_factor` below 1 with a scaled rope type (transformers'
implementations of these families rotate whole heads; with the default type they ignore the factor, and
so does xlagen), and unknown keys inside `rope_parameters` / `rope_scaling`.

Known differences: transformers' dynamic rope keeps the largest frequency table it has grown across calls
(until a call is shorter than max_position_embeddings); xlagen computes it from each call's own positions,
as a fresh transformers model does. The static cache is not a rolling buffer: with a sliding window it
still holds every position (the mask limits what each query sees). Dropout is not applied.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import keras

from xlagen.layers.block import BlockSpec, TransformerBlock
from xlagen.layers.dense import Dense
from xlagen.layers.embeddings import TokenEmbedding
from xlagen.layers.feedforward import get_activation
from xlagen.layers.norms import rms_norm
from xlagen.layers.rotary import ROPE_TYPES, RopeSpec, rotary_tables
from xlagen.models import config_checks as checks
from xlagen.models.base import DecoderOnlyLM, column_positions
from xlagen.models.training import CausalLMTraining

logger = logging.getLogger(__name__)

# model_type -> transformers' class name (config.json "architectures").
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}

# transformers' defaults of the keys a config.json may leave out, where a family differs from Llama's.
_FAMILY_DEFAULTS = {
    "llama": {"vocab_size": 32000, "intermediate_size": 11008, "max_position_embeddings": 2048,
              "bos_token_id": 1, "eos_token_id": 2},
    "mistral": {"vocab_size": 32000, "intermediate_size": 14336, "num_key_value_heads": 8,
                "max_position_embeddings": 131072, "bos_token_id": 1, "eos_token_id": 2, "sliding_window": 4096},
    "qwen2": {"vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768},
    "qwen3": {"vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768, "head_dim": 128},
}

# HF config keys that do not change inference math (training-only, bookkeeping, task heads). Llama's
# `pretraining_tp` only split the products in transformers 4.x (the same sums); 5.x does not read it.
_IGNORED_HF_KEYS = frozenset({
    "_name_or_path", "architectures", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "initializer_range", "attention_dropout", "model_type", "id2label", "label2id", "output_past", "return_dict",
    "output_hidden_states", "output_attentions", "torchscript", "problem_type", "tokenizer_class", "prefix",
    "chunk_size_feed_forward", "is_decoder", "is_encoder_decoder", "add_cross_attention", "pretraining_tp",
    "cross_attention_hidden_size", "tie_encoder_decoder", "sep_token_id", "decoder_start_token_id",
    "finetuning_task", "task_specific_params", "max_length", "min_length", "do_sample", "early_stopping",
    "num_beams", "temperature", "top_k", "top_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "gradient_checkpointing",
})

# HF key -> our field, shared by the family.
_HF_NAMES = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
             "num_attention_heads": "num_heads", "num_key_value_heads": "num_key_value_heads",
             "head_dim": "head_dim", "intermediate_size": "intermediate_size", "rms_norm_eps": "layer_norm_eps",
             "hidden_act": "activation", "tie_word_embeddings": "tie_word_embeddings",
             "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "pad_token_id"}
# Each family's own keys.
_FAMILY_NAMES = {"llama": {"attention_bias": "attention_bias", "mlp_bias": "mlp_bias"},
                 "mistral": {"sliding_window": "sliding_window"},
                 "qwen2": {}, "qwen3": {"attention_bias": "attention_bias"}}
# Keys read for the rope, and Qwen's sliding-window keys (read to refuse, or unused when it is off).
_ROPE_KEYS = {"rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor",
              "original_max_position_embeddings", "max_position_embeddings"}
_QWEN_WINDOW_KEYS = {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}

# The parameters of a rope dict (besides its type) -> RopeSpec field.
_ROPE_NAMES = {"rope_theta": "theta", "factor": "factor", "original_max_position_embeddings": "original_max_positions",
               "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
               "attention_factor": "attention_factor", "beta_fast": "beta_fast", "beta_slow": "beta_slow",
               "mscale": "mscale", "mscale_all_dim": "mscale_all_dim", "truncate": "truncate"}

# Our field -> the kind of value it takes (checked in `__post_init__`, and with HF names in `from_hf_config`).
KINDS = {"vocab_size": checks.size, "hidden_size": checks.size, "num_layers": checks.size, "num_heads": checks.size,
         "num_key_value_heads": checks.optional_size, "head_dim": checks.optional_size,
         "intermediate_size": checks.size, "max_positions": checks.optional_size, "layer_norm_eps": checks.epsilon,
         "activation": checks.string, "attention_bias": checks.boolean, "attention_output_bias": checks.boolean,
         "mlp_bias": checks.boolean, "head_norm": checks.boolean, "sliding_window": checks.optional_size,
         "tie_word_embeddings": checks.boolean, "bos_token_id": checks.token_id, "eos_token_id": checks.token_ids,
         "pad_token_id": checks.token_id}
_ROPE_KINDS = {"theta": checks.positive, "factor": checks.optional_positive, "max_positions": checks.size,
               "original_max_positions": checks.optional_size, "low_freq_factor": checks.optional_positive,
               "high_freq_factor": checks.optional_positive, "attention_factor": checks.optional_positive,
               "beta_fast": checks.optional_positive, "beta_slow": checks.optional_positive,
               "mscale": checks.optional_positive, "mscale_all_dim": checks.optional_positive,
               "truncate": checks.boolean}


@dataclass(frozen=True)
class LlamaConfig:
    """A Llama-family architecture (llama, mistral, qwen2, qwen3); defaults are Llama-2-7B's.

    Attributes:
        vocab_size: V.
        hidden_size: Model width.
        num_layers: L (HF `num_hidden_layers`).
        num_heads: H, the query heads (HF `num_attention_heads`).
        num_key_value_heads: Hkv, the key/value heads (grouped-query attention; None -> H).
        head_dim: D (None -> hidden_size / H).
        intermediate_size: Feed-forward width.
        max_positions: The longest sequence xlagen generates (HF `max_position_embeddings`); None with a
            dynamic rope, which extends the context.
        layer_norm_eps: The RMS norms' epsilon (HF `rms_norm_eps`).
        activation: The gate's activation (HF `hidden_act`).
        attention_bias: Biases on the query/key/value projections.
        attention_output_bias: A bias on the attention's output projection.
        mlp_bias: Biases on the feed-forward projections.
        head_norm: An RMS norm of each query and key head (Qwen3).
        sliding_window: Each query attends to at most this many positions, its own included (Mistral).
        sliding_layers: Which layers the window applies to (Qwen2/Qwen3's `layer_types`); None: all.
        rope: The rotary embedding (HF `rope_parameters` / `rope_scaling`, `rope_theta`).
        tie_word_embeddings: The LM head reuses the token embedding.
        bos_token_id, eos_token_id, pad_token_id: Special ids from config.json.
        model_type: Which family ("llama", "mistral", "qwen2", "qwen3"): the names of save_pretrained.
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    num_layers: int = 32
    num_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int = 11008
    max_positions: int | None = 2048
    layer_norm_eps: float = 1e-6
    activation: str = "silu"
    attention_bias: bool = False
    attention_output_bias: bool = False
    mlp_bias: bool = False
    head_norm: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] | None = None
    rope: RopeSpec = RopeSpec()
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None
    model_type: str = "llama"

    def __post_init__(self):
        """Raises:
            ValueError: naming a field of the wrong type or out of range, heads that do not divide, an odd
                head_dim, an unknown activation or model_type.
        """
        checks.check_fields(self, KINDS)
        if self.model_type not in FAMILIES:
            raise ValueError(f"model_type {self.model_type!r} is not of the Llama family ({', '.join(FAMILIES)})")
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_heads)
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_key_value_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_key_value_heads "
                             f"{self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even (rotary embeddings rotate pairs)")
        checks.check_fields(self.rope, _ROPE_KINDS)
        layers = self.sliding_layers
        if layers is not None and (len(layers) != self.num_layers or not all(isinstance(b, bool) for b in layers)):
            raise ValueError(f"sliding_layers must be one true/false per layer ({self.num_layers}), got {layers!r}")
        try:
            get_activation(self.activation)
        except ValueError as e:
            raise ValueError(f"activation: {e}") from None

    @classmethod
    def from_hf_config(cls, hf: dict) -> "LlamaConfig":
        """Maps a transformers `config.json` dict of model_type llama, mistral, qwen2 or qwen3.

        Raises:
            ValueError: naming the config.json key, for a value of the wrong type or out of range, or a
                setting that changes the math and is not implemented.
        """
        family = hf.get("model_type", "llama")
        if family not in FAMILIES:
            raise ValueError(f"config.json: model_type {family!r} is not of the Llama family ({', '.join(FAMILIES)})")
        hf = {**_FAMILY_DEFAULTS[family], **hf}
        names = {**_HF_NAMES, **_FAMILY_NAMES[family]}
        extra = {"model_type": family}
        if family.startswith("qwen"):
            extra.update(_qwen_window(hf))
        if family == "qwen2":  # biases on the query/key/value projections, always
            extra["attention_bias"] = True
        if "attention_bias" in names:  # llama, qwen3: on the output projection too
            extra["attention_output_bias"] = hf.get("attention_bias", False)
        extra["head_norm"] = family == "qwen3"
        known = set(names) | _IGNORED_HF_KEYS | _ROPE_KEYS | (_QWEN_WINDOW_KEYS if family.startswith("qwen") else set())
        unknown = sorted(set(hf) - known)
        if unknown:
            logger.warning("config.json keys ignored by xlagen's %s: %s", family, unknown)
        rope = _rope_from_hf(hf)
        extra.update(rope=rope, max_positions=None if rope.rope_type == "dynamic" else rope.max_positions)
        return checks.from_hf(cls, hf, names, KINDS, **extra)

    def to_hf_config(self) -> dict:
        """The transformers `config.json` dict for this configuration (read by transformers 4.x and 5.x)."""
        values = {theirs: getattr(self, ours) for theirs, ours in {**_HF_NAMES, **_FAMILY_NAMES[self.model_type]}.items()}
        rope = self.rope
        scaling = None
        if rope.rope_type != "default":
            scaling = {"rope_type": rope.rope_type, **{theirs: getattr(rope, ours) for theirs, ours in _ROPE_NAMES.items()
                                                       if theirs != "rope_theta" and getattr(rope, ours) is not None}}
        qwen = {}
        if self.model_type.startswith("qwen"):
            layers = self.sliding_layers or (True,) * self.num_layers
            qwen = {"use_sliding_window": self.sliding_window is not None, "sliding_window": self.sliding_window,
                    "layer_types": ["sliding_attention" if sliding else "full_attention" for sliding in layers]}
        return {"model_type": self.model_type, "architectures": [FAMILIES[self.model_type]], **values, **qwen,
                "max_position_embeddings": rope.max_positions, "rope_theta": rope.theta, "rope_scaling": scaling}

    def replace(self, **changes) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)


def _qwen_window(hf: dict) -> dict:
    """Qwen2/Qwen3's sliding window, as their transformers configs resolve it: only with use_sliding_window,
    on the layers `layer_types` names "sliding_attention" (by default those from max_window_layers on).

    Returns:
        The config fields `sliding_window` and `sliding_layers`.

    Raises:
        ValueError: naming the key, for values of the wrong type, or sliding layers without a window.
    """
    use, window = hf.get("use_sliding_window", False), hf.get("sliding_window")
    layers, first = hf.get("num_hidden_layers", 32), hf.get("max_window_layers", 28)
    for key, value, kind in (("use_sliding_window", use, checks.boolean), ("sliding_window", window, checks.optional_size),
                             ("num_hidden_layers", layers, checks.size), ("max_window_layers", first, checks.size)):
        try:
            kind(key, value)
        except ValueError as e:
            raise ValueError(f"config.json: {e}") from None
    window = window if use else None
    layer_types = hf.get("layer_types")
    if layer_types is None:
        layer_types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                       for i in range(layers)]
    kinds = ("full_attention", "sliding_attention")
    if not isinstance(layer_types, list) or len(layer_types) != layers or any(t not in kinds for t in layer_types):
        raise ValueError(f"config.json: layer_types must list {layers} of {kinds}, got {checks._short(layer_types)}")
    sliding = tuple(kind == "sliding_attention" for kind in layer_types)
    if any(sliding) and window is None:
        raise ValueError("config.json: layer_types names sliding_attention layers but there is no window "
                         "(use_sliding_window false or sliding_window null); xlagen does not guess one")
    return {"sliding_window": window if any(sliding) else None, "sliding_layers": sliding if any(sliding) else None}


def _rope_from_hf(hf: dict) -> RopeSpec:
    """The RopeSpec of config.json: `rope_scaling` (transformers 4.x) or `rope_parameters` (5.x), whose own
    `rope_theta` wins over the top-level one, as transformers standardizes them.

    Raises:
        ValueError: naming the key of an unknown or unimplemented rope type or parameter.
    """
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(key) or {}
    if not isinstance(params, dict):
        raise ValueError(f"config.json: {key} must be an object, got {checks._short(params)}")
    params = dict(params)
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError(f"config.json: {key} per layer type is not supported by xlagen's Llama family")
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    params.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config.json: {key}.rope_type {rope_type!r} is not implemented by xlagen "
                         f"(implemented: {', '.join(ROPE_TYPES)})")
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0 and rope_type != "default":
        raise ValueError(f"config.json: partial_rotary_factor={partial} with rope_type {rope_type!r} is not "
                         "supported (transformers' Llama, Mistral and Qwen rotate whole heads)")
    unknown = sorted(set(params) - set(_ROPE_NAMES))
    if unknown:
        raise ValueError(f"config.json: {key} keys {unknown} are not implemented by xlagen's rope")
    values = {"theta": params.pop("rope_theta", hf.get("rope_theta", 10000.0)),
              "max_positions": hf.get("max_position_embeddings")}
    if rope_type in ("llama3", "yarn"):
        values["original_max_positions"] = hf.get("original_max_position_embeddings",
                                                  params.get("original_max_position_embeddings",
                                                             hf.get("max_position_embeddings")))
    params.pop("original_max_position_embeddings", None)
    values.update({_ROPE_NAMES[name]: value for name, value in params.items()})
    for field, value in values.items():
        try:
            _ROPE_KINDS[field](field, value)
        except ValueError as e:
            spelled = {ours: theirs for theirs, ours in _ROPE_NAMES.items()}
            raise ValueError(f"config.json: {key}.{spelled.get(field, 'max_position_embeddings')}: {e}") from None
    try:
        return RopeSpec(rope_type=rope_type, **values)
    except ValueError as e:
        raise ValueError(f"config.json: {key}: {e}") from None


def block_spec(config: LlamaConfig) -> BlockSpec:
    """The family's block: pre-norm RMS norms, grouped-query attention, a SwiGLU feed-forward."""
    return BlockSpec(config.hidden_size, config.num_heads, config.head_dim, config.intermediate_size,
                     config.activation, config.head_dim ** -0.5, config.layer_norm_eps, use_bias=config.mlp_bias,
                     rms_norm=True, gated=True, num_key_value_heads=config.num_key_value_heads,
                     attention_bias=config.attention_bias, attention_output_bias=config.attention_output_bias,
                     head_norm=config.head_norm)


class LlamaLM(CausalLMTraining, DecoderOnlyLM, keras.Model):
    """A Llama-family model with its language-modelling head, as a Keras 3 model.

    Args:
        config: The architecture.
    """

    def __init__(self, config: LlamaConfig, **kwargs):
        kwargs.setdefault("name", config.model_type)
        super().__init__(**kwargs)
        self.config = config
        policy = self.dtype_policy
        self.token_embedding = TokenEmbedding(config.vocab_size, config.hidden_size, name="token_embedding",
                                              dtype=policy)
        spec = block_spec(config)
        self.blocks = [TransformerBlock(spec, name=f"block_{i}", dtype=policy) for i in range(config.num_layers)]
        self.final_norm = rms_norm(config.layer_norm_eps, "final_norm", policy)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = Dense(config.vocab_size, use_bias=False, name="lm_head", dtype=policy)
        self.build_all()

    def build_all(self):
        """Creates every variable (so weights can be assigned before the first call)."""
        hidden = self.config.hidden_size
        self.token_embedding.build((None, None))
        for layer in (*self.blocks, self.final_norm, self.lm_head):
            if layer is not None:
                layer.build((None, None, hidden))
        self.built = True

    @property
    def cache_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def attention_window(self) -> int | tuple[int | None, ...] | None:
        window, layers = self.config.sliding_window, self.config.sliding_layers
        if window is None or layers is None or all(layers):
            return window
        return tuple(window if sliding else None for sliding in layers)

    def _rotary(self, positions):
        return rotary_tables(self.config.rope, self.config.head_dim, positions)

    def _embed(self, token_ids, positions, training=False):
        return self.token_embedding(token_ids)

    def _finish(self, hidden):
        return self.final_norm(hidden)

    def _default_positions(self, attention_mask):
        return column_positions(attention_mask)
