"""GPT-2: transformers tensor names -> xlagen variable paths.

GPT-2 stores its projections as Conv1D weights `[in, out]`, which is already Keras' Dense layout, so
no transposes are needed; the fused `c_attn` maps onto our fused `qkv` kernel unchanged.
"""

from __future__ import annotations

from xlagen.weights.loader import Rule, Size, transpose

# GPT2LMHeadModel prefixes the trunk with "transformer."; a bare GPT2Model checkpoint does not.
PREFIX = "transformer."

# Non-persistent buffers older checkpoints still carry.
IGNORE = (r"h\.\d+\.attn\.(masked_)?bias",)


def rules(config) -> list[Rule]:
    """The conversion table for a `GPT2Config`."""
    table = [Rule("token_embedding/kernel", ("wte.weight",), transpose),
             Rule("position_embedding/embeddings", ("wpe.weight",)),
             Rule("final_norm/gamma", ("ln_f.weight",)),
             Rule("final_norm/beta", ("ln_f.bias",))]
    for i in range(config.num_layers):
        ours, theirs = f"block_{i}/", f"h.{i}."
        pairs = {"attention_norm/gamma": "ln_1.weight", "attention_norm/beta": "ln_1.bias",
                 "attention/qkv/kernel": "attn.c_attn.weight", "attention/qkv/bias": "attn.c_attn.bias",
                 "attention/output_projection/kernel": "attn.c_proj.weight",
                 "attention/output_projection/bias": "attn.c_proj.bias",
                 "mlp_norm/gamma": "ln_2.weight", "mlp_norm/beta": "ln_2.bias",
                 "mlp/input_projection/kernel": "mlp.c_fc.weight", "mlp/input_projection/bias": "mlp.c_fc.bias",
                 "mlp/output_projection/kernel": "mlp.c_proj.weight",
                 "mlp/output_projection/bias": "mlp.c_proj.bias"}
        table += [Rule(ours + target, (theirs + source,)) for target, source in pairs.items()]
    if not config.tie_word_embeddings:
        table.append(Rule("lm_head/kernel", ("lm_head.weight",), transpose))
    return table


def ignore(config) -> tuple[str, ...]:
    """HF tensors to skip: buffers, and the LM head when it is tied to the embedding."""
    return IGNORE + ((r"lm_head\.weight",) if config.tie_word_embeddings else ())


def saved_name(name: str) -> str:
    """The name transformers' GPT2LMHeadModel gives a tensor of the table (the trunk is prefixed)."""
    return name if name.startswith("lm_head.") else PREFIX + name


def sizes(config) -> list[Size]:
    """The config values that the checkpoint's tensor shapes must agree with."""
    return [Size("vocab_size", config.vocab_size, "wte.weight", 0), Size("n_embd", config.hidden_size, "wte.weight", 1),
            Size("n_positions", config.max_positions, "wpe.weight", 0),
            Size("n_inner", config.intermediate_size, "h.0.mlp.c_fc.weight", 1),
            Size("n_layer", config.num_layers, r"h\.(\d+)\.", None)]


def parameter_count(config) -> int:
    """The number of parameters of the model (before it is built)."""
    h, f = config.hidden_size, config.intermediate_size
    block = 4 * h * h + 2 * h * f + 9 * h + f
    head = 0 if config.tie_word_embeddings else config.vocab_size * h
    return (config.vocab_size + config.max_positions) * h + config.num_layers * block + 2 * h + head
