"""OPT: transformers tensor names -> xlagen variable paths.

OPT's projections are PyTorch Linear weights `[out, in]`, transposed to Keras' Dense `[in, out]`; the
separate q/k/v projections are fused into our one `qkv` kernel (stacked on the output axis, in q, k, v
order, before the transpose).
"""

from __future__ import annotations

from xlagen.weights.loader import Rule, Size, chain, concat_first, concat_last, transpose

# OPTForCausalLM prefixes the trunk with "model."; a bare OPTModel checkpoint does not.
PREFIX = "model."

_fuse_kernels = chain(concat_first, transpose)


def _norm(target: str, source: str, config) -> list[Rule]:
    if not config.norm_affine:
        return []
    return [Rule(f"{target}/gamma", (f"{source}.weight",)), Rule(f"{target}/beta", (f"{source}.bias",))]


def _dense(target: str, source: str, config) -> list[Rule]:
    table = [Rule(f"{target}/kernel", (f"{source}.weight",), transpose)]
    return table + ([Rule(f"{target}/bias", (f"{source}.bias",))] if config.use_bias else [])


def rules(config) -> list[Rule]:
    """The conversion table for an `OPTConfig`."""
    table = [Rule("token_embedding/kernel", ("decoder.embed_tokens.weight",), transpose),
             Rule("position_embedding/embeddings", ("decoder.embed_positions.weight",))]
    if config.projects_embeddings:
        table += [Rule("project_in/kernel", ("decoder.project_in.weight",), transpose),
                  Rule("project_out/kernel", ("decoder.project_out.weight",), transpose)]
    if config.has_final_norm:
        table += _norm("final_norm", "decoder.final_layer_norm", config)
    for i in range(config.num_layers):
        ours, theirs = f"block_{i}/", f"decoder.layers.{i}."
        qkv = tuple(f"{theirs}self_attn.{name}_proj" for name in ("q", "k", "v"))
        table.append(Rule(ours + "attention/qkv/kernel", tuple(f"{p}.weight" for p in qkv), _fuse_kernels))
        if config.use_bias:
            table.append(Rule(ours + "attention/qkv/bias", tuple(f"{p}.bias" for p in qkv), concat_last))
        table += _dense(ours + "attention/output_projection", theirs + "self_attn.out_proj", config)
        table += _dense(ours + "mlp/input_projection", theirs + "fc1", config)
        table += _dense(ours + "mlp/output_projection", theirs + "fc2", config)
        table += _norm(ours + "attention_norm", theirs + "self_attn_layer_norm", config)
        table += _norm(ours + "mlp_norm", theirs + "final_layer_norm", config)
    if not config.tie_word_embeddings:
        table.append(Rule("lm_head/kernel", ("lm_head.weight",), transpose))
    return table


def ignore(config) -> tuple[str, ...]:
    """HF tensors to skip: the LM head when tied, and a final norm the configuration does not use."""
    skipped = (r"lm_head\.weight",) if config.tie_word_embeddings else ()
    # transformers builds no final norm then and drops such tensors on load too.
    return skipped + (() if config.has_final_norm else (r"decoder\.final_layer_norm\.(weight|bias)",))


def saved_name(name: str) -> str:
    """The name transformers' OPTForCausalLM gives a tensor of the table (the trunk is prefixed)."""
    return name if name.startswith("lm_head.") else PREFIX + name


def sizes(config) -> list[Size]:
    """The config values that the checkpoint's tensor shapes must agree with."""
    return [Size("vocab_size", config.vocab_size, "decoder.embed_tokens.weight", 0),
            Size("word_embed_proj_dim", config.embedding_size, "decoder.embed_tokens.weight", 1),
            Size("max_position_embeddings + 2", config.max_positions + 2, "decoder.embed_positions.weight", 0),
            Size("hidden_size", config.hidden_size, "decoder.embed_positions.weight", 1),
            Size("ffn_dim", config.intermediate_size, "decoder.layers.0.fc1.weight", 0),
            Size("num_hidden_layers", config.num_layers, r"decoder\.layers\.(\d+)\.", None)]


def parameter_count(config) -> int:
    """The number of parameters of the model (before it is built)."""
    h, f, e = config.hidden_size, config.intermediate_size, config.embedding_size
    block = 4 * h * h + 2 * h * f + 9 * h + f
    extra = (2 * e * h if config.projects_embeddings else 0) + (0 if config.tie_word_embeddings else config.vocab_size * e)
    return config.vocab_size * e + (config.max_positions + 2) * h + config.num_layers * block + 2 * h + extra
