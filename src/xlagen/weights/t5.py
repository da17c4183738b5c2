"""T5: transformers tensor names -> xlagen variable paths.

T5's projections are bias-free PyTorch Linear weights `[out, in]`, transposed to Keras' Dense
`[in, out]`. The self-attention q/k/v are fused into our one `qkv` kernel and the cross-attention k/v
into one `key_value` kernel (stacked on the output axis before the transpose). The relative position
bias lives in the first block of each stack (`relative_attention_bias`) and is shared by all blocks.
The LM head is `shared.weight` when tied, else `lm_head.weight`; transformers >= 5 writes
`tie_word_embeddings: true` for every T5 and keeps a stored `lm_head.weight` that differs from
`shared.weight` as a separate head (`resolve_config`).
"""

from __future__ import annotations

import numpy as np

from xlagen.weights.loader import Rule, Size, chain, concat_first, transpose

# T5ForConditionalGeneration has no prefix on its trunk.
PREFIX = ""

_fuse_kernels = chain(concat_first, transpose)

# Tied copies of `shared.weight`, and a bias that old checkpoints store and no T5 uses (transformers
# ignores it too).
IGNORE = (r"(encoder|decoder)\.embed_tokens\.weight",
          r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight")


def _kernel(target: str, source: str) -> Rule:
    return Rule(f"{target}/kernel", (f"{source}.weight",), transpose)


def _self_attention(ours: str, theirs: str) -> list[Rule]:
    return [Rule(ours + "qkv/kernel", tuple(f"{theirs}{name}.weight" for name in "qkv"), _fuse_kernels),
            _kernel(ours + "output_projection", theirs + "o")]


def _cross_attention(ours: str, theirs: str) -> list[Rule]:
    return [_kernel(ours + "query", theirs + "q"),
            Rule(ours + "key_value/kernel", (f"{theirs}k.weight", f"{theirs}v.weight"), _fuse_kernels),
            _kernel(ours + "output_projection", theirs + "o")]


def _feed_forward(ours: str, theirs: str, config) -> list[Rule]:
    if config.gated:  # wi_0 goes through the activation, wi_1 is the linear branch
        table = [_kernel(ours + "gate_projection", theirs + "wi_0"),
                 _kernel(ours + "input_projection", theirs + "wi_1")]
    else:
        table = [_kernel(ours + "input_projection", theirs + "wi")]
    return table + [_kernel(ours + "output_projection", theirs + "wo")]


def _norm(target: str, source: str) -> Rule:
    return Rule(f"{target}/scale", (f"{source}.weight",))


def rules(config) -> list[Rule]:
    """The conversion table for a `T5Config`."""
    bias = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    table = [Rule("token_embedding/kernel", ("shared.weight",), transpose),
             Rule("encoder_position_bias/embeddings", (f"encoder.{bias}",)),
             Rule("decoder_position_bias/embeddings", (f"decoder.{bias}",)),
             _norm("encoder_final_norm", "encoder.final_layer_norm"),
             _norm("decoder_final_norm", "decoder.final_layer_norm")]
    for i in range(config.num_layers):
        ours, theirs = f"encoder_block_{i}/", f"encoder.block.{i}.layer."
        table += _self_attention(ours + "attention/", theirs + "0.SelfAttention.")
        table += _feed_forward(ours + "mlp/", theirs + "1.DenseReluDense.", config)
        table += [_norm(ours + "attention_norm", theirs + "0.layer_norm"),
                  _norm(ours + "mlp_norm", theirs + "1.layer_norm")]
    for i in range(config.num_decoder_layers):
        ours, theirs = f"decoder_block_{i}/", f"decoder.block.{i}.layer."
        table += _self_attention(ours + "attention/", theirs + "0.SelfAttention.")
        table += _cross_attention(ours + "cross_attention/", theirs + "1.EncDecAttention.")
        table += _feed_forward(ours + "mlp/", theirs + "2.DenseReluDense.", config)
        table += [_norm(ours + "attention_norm", theirs + "0.layer_norm"),
                  _norm(ours + "cross_attention_norm", theirs + "1.layer_norm"),
                  _norm(ours + "mlp_norm", theirs + "2.layer_norm")]
    if not config.tie_word_embeddings:
        table.append(_kernel("lm_head", "lm_head"))
    return table


def ignore(config) -> tuple[str, ...]:
    """HF tensors to skip: tied copies of the embedding (the LM head too when tied), an unused bias."""
    return IGNORE + ((r"lm_head\.weight",) if config.tie_word_embeddings else ())


def saved_name(name: str) -> str:
    """The name transformers' T5ForConditionalGeneration gives a tensor of the table (unchanged)."""
    return name


def resolve_config(config, tensors):
    """The configuration that the checkpoint's tensors make: a head stored apart from the embedding
    (`lm_head.weight` not equal to `shared.weight`) is used as a separate head even when the config says
    tied, as transformers >= 5 does (it writes `tie_word_embeddings: true` for every T5, e.g. when it
    re-saves a v1.1 / FLAN-T5 checkpoint). The decoder-output scaling is kept as the config says.

    Args:
        config: A `T5Config` from `T5Config.from_hf_config`.
        tensors: HF tensor name -> array, as read from the checkpoint.

    Returns:
        `config`, or a copy with `tie_word_embeddings=False`.
    """
    head, embedding = tensors.get("lm_head.weight"), tensors.get("shared.weight")
    if not config.tie_word_embeddings or head is None or embedding is None or np.array_equal(head, embedding):
        return config
    return config.replace(tie_word_embeddings=False)


def saved_tensors(config, tensors):
    """The tensors `save_pretrained` writes for the config.json of `T5Config.to_hf_config`: a tied head
    without scaling is written as a separate copy of the embedding, and a separate head with scaling has
    the scale folded into it, so that transformers 4.x (which scales iff the head is tied) and >= 5 load
    the folder with the same logits.

    Args:
        config: The model's `T5Config`.
        tensors: HF tensor name -> array, from `rules(config)`.

    Returns:
        HF tensor name -> array (a new dict).
    """
    tensors = dict(tensors)
    if config.tie_word_embeddings and not config.scale_decoder_outputs:
        tensors["lm_head.weight"] = tensors["shared.weight"].copy()
    elif not config.tie_word_embeddings and config.scale_decoder_outputs:
        head = tensors["lm_head.weight"]
        tensors["lm_head.weight"] = (head * np.asarray(config.hidden_size ** -0.5, head.dtype)).astype(head.dtype)
    return tensors


def sizes(config) -> list[Size]:
    """The config values that the checkpoint's tensor shapes must agree with."""
    bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    return [Size("vocab_size", config.vocab_size, "shared.weight", 0),
            Size("d_model", config.hidden_size, "shared.weight", 1),
            Size("num_heads * d_kv", config.num_heads * config.head_dim,
                 "encoder.block.0.layer.0.SelfAttention.q.weight"),
            Size("relative_attention_num_buckets", config.relative_attention_buckets, bias, 0),
            Size("num_heads", config.num_heads, bias, 1),
            Size("d_ff", config.intermediate_size, "encoder.block.0.layer.1.DenseReluDense.wo.weight", 1),
            Size("num_layers", config.num_layers, r"encoder\.block\.(\d+)\.", None),
            Size("num_decoder_layers", config.num_decoder_layers, r"decoder\.block\.(\d+)\.", None)]


def parameter_count(config) -> int:
    """The number of parameters of the model (before it is built)."""
    h, inner = config.hidden_size, config.num_heads * config.head_dim
    feed_forward = (3 if config.gated else 2) * h * config.intermediate_size
    encoder = config.num_layers * (4 * h * inner + feed_forward + 2 * h)
    decoder = config.num_decoder_layers * (8 * h * inner + feed_forward + 3 * h)
    head = 0 if config.tie_word_embeddings else config.vocab_size * h
    return config.vocab_size * h + 2 * config.relative_attention_buckets * config.num_heads + encoder + decoder + head
