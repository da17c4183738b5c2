"""Whisper: transformers tensor names -> xlagen variable paths.

Whisper's projections are PyTorch Linear weights `[out, in]`, transposed to Keras' Dense `[in, out]`; the
self-attention q/k/v are fused into our one `qkv` kernel and the cross-attention k/v into one `key_value`
kernel (stacked on the output axis before the transpose). Key projections have no bias, so the fused biases
get zeros in the key's place. The stem's Conv1d weights `[out, in, width]` become Keras' `[width, in, out]`.
"""

from __future__ import annotations

from xlagen.weights.loader import Rule, Size, chain, concat_first, conv_kernel, insert_zeros, transpose

# WhisperForConditionalGeneration prefixes the encoder and decoder with "model."; a bare WhisperModel does not.
PREFIX = "model."

_fuse_kernels = chain(concat_first, transpose)


def _dense(target: str, source: str) -> list[Rule]:
    return [Rule(f"{target}/kernel", (f"{source}.weight",), transpose), Rule(f"{target}/bias", (f"{source}.bias",))]


def _norm(target: str, source: str) -> list[Rule]:
    return [Rule(f"{target}/gamma", (f"{source}.weight",)), Rule(f"{target}/beta", (f"{source}.bias",))]


def _self_attention(ours: str, theirs: str) -> list[Rule]:
    projections = tuple(f"{theirs}{name}_proj" for name in "qkv")
    return [Rule(ours + "qkv/kernel", tuple(f"{p}.weight" for p in projections), _fuse_kernels),
            Rule(ours + "qkv/bias", (f"{theirs}q_proj.bias", f"{theirs}v_proj.bias"), insert_zeros(1)),
            *_dense(ours + "output_projection", theirs + "out_proj")]


def _cross_attention(ours: str, theirs: str) -> list[Rule]:
    return [*_dense(ours + "query", theirs + "q_proj"),
            Rule(ours + "key_value/kernel", (f"{theirs}k_proj.weight", f"{theirs}v_proj.weight"), _fuse_kernels),
            Rule(ours + "key_value/bias", (f"{theirs}v_proj.bias",), insert_zeros(0)),
            *_dense(ours + "output_projection", theirs + "out_proj")]


def _block(ours: str, theirs: str, decoder: bool) -> list[Rule]:
    table = _self_attention(ours + "attention/", theirs + "self_attn.")
    table += _norm(ours + "attention_norm", theirs + "self_attn_layer_norm")
    if decoder:
        table += _cross_attention(ours + "cross_attention/", theirs + "encoder_attn.")
        table += _norm(ours + "cross_attention_norm", theirs + "encoder_attn_layer_norm")
    table += _dense(ours + "mlp/input_projection", theirs + "fc1") + _dense(ours + "mlp/output_projection", theirs + "fc2")
    return table + _norm(ours + "mlp_norm", theirs + "final_layer_norm")


def rules(config) -> list[Rule]:
    """The conversion table for a `WhisperConfig`."""
    table = [Rule("stem/conv1/kernel", ("encoder.conv1.weight",), conv_kernel),
             Rule("stem/conv1/bias", ("encoder.conv1.bias",)),
             Rule("stem/conv2/kernel", ("encoder.conv2.weight",), conv_kernel),
             Rule("stem/conv2/bias", ("encoder.conv2.bias",)),
             Rule("encoder_positions/embeddings", ("encoder.embed_positions.weight",)),
             *_norm("encoder_final_norm", "encoder.layer_norm"),
             Rule("token_embedding/kernel", ("decoder.embed_tokens.weight",), transpose),
             Rule("position_embedding/embeddings", ("decoder.embed_positions.weight",)),
             *_norm("decoder_final_norm", "decoder.layer_norm")]
    for i in range(config.encoder_layers):
        table += _block(f"encoder_block_{i}/", f"encoder.layers.{i}.", decoder=False)
    for i in range(config.decoder_layers):
        table += _block(f"decoder_block_{i}/", f"decoder.layers.{i}.", decoder=True)
    return table


def ignore(config) -> tuple[str, ...]:
    """HF tensors to skip: the output projection, a tied copy of the token embedding."""
    return (r"proj_out\.weight",)


def saved_name(name: str) -> str:
    """The name transformers' WhisperForConditionalGeneration gives a tensor of the table."""
    return PREFIX + name


def sizes(config) -> list[Size]:
    """The config values that the checkpoint's tensor shapes must agree with."""
    return [Size("d_model", config.hidden_size, "encoder.conv1.weight", 0),
            Size("num_mel_bins", config.num_mel_bins, "encoder.conv1.weight", 1),
            Size("max_source_positions", config.max_source_positions, "encoder.embed_positions.weight", 0),
            Size("vocab_size", config.vocab_size, "decoder.embed_tokens.weight", 0),
            Size("max_target_positions", config.max_positions, "decoder.embed_positions.weight", 0),
            Size("encoder_ffn_dim", config.encoder_ffn_dim, "encoder.layers.0.fc1.weight", 0),
            Size("decoder_ffn_dim", config.decoder_ffn_dim, "decoder.layers.0.fc1.weight", 0),
            Size("encoder_layers", config.encoder_layers, r"encoder\.layers\.(\d+)\.", None),
            Size("decoder_layers", config.decoder_layers, r"decoder\.layers\.(\d+)\.", None)]


def parameter_count(config) -> int:
    """The number of parameters of the model (before it is built)."""
    h = config.hidden_size
    stem = 3 * h * (config.num_mel_bins + h) + 2 * h
    encoder = config.encoder_layers * (4 * h * h + 2 * h * config.encoder_ffn_dim + 9 * h)
    decoder = config.decoder_layers * (8 * h * h + 2 * h * config.decoder_ffn_dim + 15 * h)
    positions = (config.max_source_positions + config.max_positions) * h
    return stem + encoder + decoder + positions + config.vocab_size * h + 4 * h
