"""The Llama family (llama, mistral, qwen2, qwen3): transformers tensor names -> xlagen variable paths.

The projections are PyTorch Linear weights `[out, in]`, transposed to Keras' Dense `[in, out]`; the
separate q/k/v projections are fused into our one `qkv` kernel (stacked on the output axis, q then k then
v, before the transpose), of unequal parts with grouped-query attention (`concat_first_sized`). The RMS
norms' weights are Keras' `scale`.
"""

from __future__ import annotations

from xlagen.weights.loader import Rule, Size, chain, concat_first_sized, transpose

# *ForCausalLM prefixes the trunk with "model."; a bare *Model checkpoint does not.
PREFIX = "model."


def _qkv_sizes(config) -> tuple[int, int, int]:
    keys = config.num_key_value_heads * config.head_dim
    return config.num_heads * config.head_dim, keys, keys


def _dense(target: str, source: str, bias: bool) -> list[Rule]:
    table = [Rule(f"{target}/kernel", (f"{source}.weight",), transpose)]
    return table + ([Rule(f"{target}/bias", (f"{source}.bias",))] if bias else [])


def rules(config) -> list[Rule]:
    """The conversion table for a `LlamaConfig`."""
    table = [Rule("token_embedding/kernel", ("embed_tokens.weight",), transpose),
             Rule("final_norm/scale", ("norm.weight",))]
    for i in range(config.num_layers):
        ours, theirs = f"block_{i}/", f"layers.{i}."
        qkv = tuple(f"{theirs}self_attn.{name}_proj" for name in ("q", "k", "v"))
        table.append(Rule(ours + "attention/qkv/kernel", tuple(f"{p}.weight" for p in qkv),
                          chain(concat_first_sized(*_qkv_sizes(config)), transpose)))
        if config.attention_bias:
            table.append(Rule(ours + "attention/qkv/bias", tuple(f"{p}.bias" for p in qkv),
                              concat_first_sized(*_qkv_sizes(config))))
        table += _dense(ours + "attention/output_projection", theirs + "self_attn.o_proj",
                        config.attention_output_bias)
        if config.head_norm:
            table += [Rule(ours + "attention/query_norm/scale", (theirs + "self_attn.q_norm.weight",)),
                      Rule(ours + "attention/key_norm/scale", (theirs + "self_attn.k_norm.weight",))]
        table += _dense(ours + "mlp/gate_projection", theirs + "mlp.gate_proj", config.mlp_bias)
        table += _dense(ours + "mlp/input_projection", theirs + "mlp.up_proj", config.mlp_bias)
        table += _dense(ours + "mlp/output_projection", theirs + "mlp.down_proj", config.mlp_bias)
        table += [Rule(ours + "attention_norm/scale", (theirs + "input_layernorm.weight",)),
                  Rule(ours + "mlp_norm/scale", (theirs + "post_attention_layernorm.weight",))]
    if not config.tie_word_embeddings:
        table.append(Rule("lm_head/kernel", ("lm_head.weight",), transpose))
    return table


def ignore(config) -> tuple[str, ...]:
    """HF tensors to skip: the LM head when tied, and the rotary frequencies older checkpoints stored."""
    skipped = (r"lm_head\.weight",) if config.tie_word_embeddings else ()
    return skipped + (r"layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)


def saved_name(name: str) -> str:
    """The name transformers' *ForCausalLM gives a tensor of the table (the trunk is prefixed)."""
    return name if name.startswith("lm_head.") else PREFIX + name


def sizes(config) -> list[Size]:
    """The config values that the checkpoint's tensor shapes must agree with."""
    queries, keys, _ = _qkv_sizes(config)
    return [Size("vocab_size", config.vocab_size, "embed_tokens.weight", 0),
            Size("hidden_size", config.hidden_size, "embed_tokens.weight", 1),
            Size("num_attention_heads * head_dim", queries, "layers.0.self_attn.q_proj.weight", 0),
            Size("num_key_value_heads * head_dim", keys, "layers.0.self_attn.k_proj.weight", 0),
            Size("intermediate_size", config.intermediate_size, "layers.0.mlp.gate_proj.weight", 0),
            Size("num_hidden_layers", config.num_layers, r"layers\.(\d+)\.", None)]


def parameter_count(config) -> int:
    """The number of parameters of the model (before it is built)."""
    h, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    queries, keys, _ = _qkv_sizes(config)
    attention = h * (queries + 2 * keys) + queries * h
    attention += (queries + 2 * keys if config.attention_bias else 0) + (h if config.attention_output_bias else 0)
    attention += 2 * config.head_dim if config.head_norm else 0
    mlp = 3 * h * f + ((2 * f + h) if config.mlp_bias else 0)
    head = 0 if config.tie_word_embeddings else v * h
    return v * h + config.num_layers * (attention + mlp + 2 * h) + h + head
