"""The transformer block shared by every model: self-attention, optional cross-attention over an
encoder's output, and a feed-forward, each with a residual connection and a norm.

GPT-2 and OPT use it as a decoder-only block; T5 uses it for its encoder (bidirectional mask, no
cross-attention) and its decoder (causal mask, cross-attention).

Shapes: B batch, T tokens in this call, S cache length (static), L encoder length, H heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import keras

from xlagen import cache as cache_lib
from xlagen import native
from xlagen.layers.attention import Attention, CrossAttention, FoldedMemory
from xlagen.layers.dense import Dense
from xlagen.layers.feedforward import FeedForward
from xlagen.layers.norms import layer_norm, rms_norm
from xlagen.native.policy import in_decoding_step


@dataclass(frozen=True)
class BlockSpec:
    """Everything that shapes one block; a model derives it from its config.

    Attributes:
        hidden_size: Model width.
        num_heads: H.
        head_dim: D.
        intermediate_size: Feed-forward inner width.
        activation: HF activation name of the feed-forward.
        attention_scale: Multiplier of the query-key scores.
        layer_norm_eps: Norm epsilon.
        norm_first: Pre-norm `x + f(norm(x))` (GPT-2, OPT, T5) or post-norm `norm(x + f(x))` (OPT-350m).
        use_bias: Biases in the attention and feed-forward projections.
        norm_affine: LayerNorms with a learned scale and bias.
        attention_dropout: Dropout of the attention probabilities (training only).
        residual_dropout: Dropout of each sub-layer's output before the residual sum (training only).
        rms_norm: T5's RMS norm (scale only) instead of LayerNorm.
        gated: Gated feed-forward (T5 v1.1), see `FeedForward`.
        feed_forward_dropout: Dropout of the feed-forward's inner activations (training only).
        cross_attention: Add cross-attention over an encoder's output after the self-attention.
        num_key_value_heads: The self-attention's key/value heads (grouped-query attention); None: num_heads.
        attention_bias: Biases of the self-attention's query/key/value projections (None: `use_bias`).
        attention_output_bias: Bias of the self-attention's output projection (None: as `attention_bias`).
        head_norm: An RMS norm of each query and key head before the rotation (Qwen3).
    """

    hidden_size: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    activation: str
    attention_scale: float
    layer_norm_eps: float
    norm_first: bool = True
    use_bias: bool = True
    norm_affine: bool = True
    attention_dropout: float = 0.0
    residual_dropout: float = 0.0
    rms_norm: bool = False
    gated: bool = False
    feed_forward_dropout: float = 0.0
    cross_attention: bool = False
    num_key_value_heads: int | None = None
    attention_bias: bool | None = None
    attention_output_bias: bool | None = None
    head_norm: bool = False


class CrossInputs(NamedTuple):
    """What a block's cross-attention attends to.

    Attributes:
        memory: The encoder output's keys `[B, H, D, L]` and values `[B, H, L, D]` for this layer (`LayerCache`),
            or the encoder output itself (`attention.FoldedMemory`).
        mask: bool `[B, 1, 1, L]`, see `attention.padding_mask`; or None, every position real.
    """

    memory: cache_lib.LayerCache | FoldedMemory
    mask: object


class TransformerBlock(keras.layers.Layer):
    """Self-attention, optional cross-attention, then a feed-forward; each with a residual and a norm.

    Args:
        spec: The block's shape and options.
    """

    def __init__(self, spec: BlockSpec, **kwargs):
        super().__init__(**kwargs)
        self.spec = spec
        policy = self.dtype_policy
        self.attention_norm = self._norm("attention_norm")
        qkv_bias = spec.use_bias if spec.attention_bias is None else spec.attention_bias
        self.attention = Attention(spec.hidden_size, spec.num_heads, spec.head_dim, spec.attention_scale,
                                   use_bias=qkv_bias, dropout=spec.attention_dropout, name="attention", dtype=policy,
                                   num_key_value_heads=spec.num_key_value_heads,
                                   output_bias=spec.attention_output_bias,
                                   head_norm_eps=spec.layer_norm_eps if spec.head_norm else None)
        self.cross_attention_norm = self.cross_attention = None
        if spec.cross_attention:
            self.cross_attention_norm = self._norm("cross_attention_norm")
            self.cross_attention = CrossAttention(spec.hidden_size, spec.num_heads, spec.head_dim,
                                                  spec.attention_scale, use_bias=spec.use_bias,
                                                  dropout=spec.attention_dropout, name="cross_attention",
                                                  dtype=policy)
        self.mlp_norm = self._norm("mlp_norm")
        self.mlp = FeedForward(spec.hidden_size, spec.intermediate_size, spec.activation, use_bias=spec.use_bias,
                               gated=spec.gated, dropout=spec.feed_forward_dropout, name="mlp", dtype=policy)
        self.residual_dropout = keras.layers.Dropout(spec.residual_dropout, dtype=policy)

    def _norm(self, name: str):
        if self.spec.rms_norm:
            return rms_norm(self.spec.layer_norm_eps, name, self.dtype_policy)
        return layer_norm(self.spec.layer_norm_eps, name, self.dtype_policy, self.spec.norm_affine)

    def build(self, input_shape):
        layers = (self.attention_norm, self.attention, self.cross_attention_norm, self.cross_attention,
                  self.mlp_norm, self.mlp)
        for layer in layers:
            if layer is not None:
                layer.build((None, None, self.spec.hidden_size))
        self.built = True

    def _fuses_residual(self, training) -> bool:
        """Whether the self-attention and the feed-forward add the residual connection's input themselves, as
        their output projection stores its output (`Dense.call`: the many-row products' epilogue, no pass of
        XLA's over the sum): outside a decoding step (whose products of a few rows have no epilogue, and whose
        steps ran 1.02-1.07x as long with the add moved into the projection: GPT-2-small and Whisper-tiny with
        int8 weights), and where no residual dropout runs between them."""
        if in_decoding_step():
            return False
        return self.residual_dropout.rate == 0 or training is None or training is False

    def _residual(self, x, update, norm, training, fused=False):
        """Adds a sub-layer's output (`fused`: the update is already the sum); post-norm blocks normalise the
        sum."""
        x = update if fused else x + self.residual_dropout(update, training=training)
        return x if self.spec.norm_first else norm(x)

    def call(self, x, key_mask, layer_cache=None, cache_index=None, training=False, position_bias=None,
             cross=None, rotary=None, last_only=False):
        """Runs the block.

        Args:
            x: `[B, T, hidden]`.
            key_mask: bool `[B, 1, T, S]` (see `attention.causal_mask`) or `[B, 1, 1, S]` (an encoder), or
                None (every key visible: Whisper's encoder). Not named `mask`: Keras fills an argument of
                that name left None from the input's Keras mask.
            layer_cache: Optional `LayerCache` `[B, H, S, D]`.
            cache_index: int32 scalar write offset, required with a cache.
            training: Applies dropout.
            position_bias: Optional additive self-attention score bias `[1 or B, H, T, S]`, or a
                `attention.RelativeBias`.
            cross: `CrossInputs`, required when the block has cross-attention.
            rotary: Optional `(cos, sin)` `[B, T, D]` rotary tables of the tokens (`layers.rotary`).
            last_only: The output of the last token only, `[B, 1, hidden]` (every token's key and value still
                cached): without a position bias, only its row goes on past the self-attention's keys and
                values (a prompt's last block: about 3/4 of its products and its attention not computed).

        Returns:
            `(output [B, T, hidden] (T = 1 with last_only), layer_cache or None)`.
        """
        def before(norm, h):
            return norm(h) if self.spec.norm_first else h

        last_row = last_only and position_bias is None and x.shape[1] != 1
        fused = self._fuses_residual(training)
        kept = x[:, -1:] if last_row else x  # the rows that go on past the self-attention
        attended, layer_cache = self.attention(before(self.attention_norm, x), key_mask, layer_cache, cache_index,
                                               training=training, bias=position_bias, rotary=rotary,
                                               last_only=last_row, residual=kept if fused else None)
        x = self._residual(kept, attended, self.attention_norm, training, fused)
        if self.cross_attention is not None:
            attended = self.cross_attention(before(self.cross_attention_norm, x), cross.memory, cross.mask,
                                            training=training)
            x = self._residual(x, attended, self.cross_attention_norm, training)
        update = self.mlp(before(self.mlp_norm, x), training=training, residual=x if fused else None)
        x = self._residual(x, update, self.mlp_norm, training, fused)
        return (x[:, -1:] if last_only else x), layer_cache


def run_blocks(blocks, x, mask, caches=None, cache_index=None, training=False, position_bias=None, cross=None,
               rotary=None, last_only=False):
    """Runs `blocks` one after the other (a model's stack).

    Args:
        blocks: `TransformerBlock`s.
        x, mask, cache_index, training, position_bias, rotary: As `TransformerBlock.call` (mask: its
            `key_mask`), the same for every block; `mask` may also be a tuple of one per block.
        caches: Optional sequence of one `LayerCache` per block.
        cross: Optional sequence of one `CrossInputs` per block.
        last_only: The last block's output for the last token only (`TransformerBlock.call`'s `last_only`).

    Returns:
        `(output [B, T, hidden] (T = 1 with last_only), tuple of the blocks' updated caches, or None without
        caches)`.

    While a graph is being traced for inference (not eagerly, not training), blocks of one `BlockSpec`
    share one trace: the first of them is traced once as a nested `tf.function` with its weights as
    arguments (`keras.StatelessScope`), and every block calls that function with its own weights. XLA
    inlines the calls, so the compiled program is the one the blocks would have traced one by one (same
    operations, same results), but the traced graph of GPT-2-small's greedy `generate` has 463 operations
    instead of 2,035, and its trace takes 0.3-0.5 s instead of 1.0-1.8 s (`benchmarks/first_call.py`).
    """
    shared = _SharedTrace() if _share_traces(training) else None
    new_caches = []
    for i, block in enumerate(blocks):
        inputs = (x, mask[i] if isinstance(mask, tuple) else mask, None if caches is None else caches[i], cache_index)
        options = dict(position_bias=position_bias, cross=None if cross is None else cross[i], rotary=rotary)
        if last_only and i == len(blocks) - 1:
            options["last_only"] = True
        if shared is None:
            x, layer_cache = block(*inputs, training=training, **options)
        else:
            x, layer_cache = shared(block, *inputs, **options)
        new_caches.append(layer_cache)
    return x, None if caches is None else tuple(new_caches)


def _share_traces(training) -> bool:
    """Whether to trace identical blocks once: under the policy's `share_traces`, in graphs, not training."""
    import tensorflow as tf

    return native.current().share_traces and training is False and not tf.executing_eagerly()


class _SharedTrace:
    """One nested `tf.function` per `BlockSpec`, made for one `run_blocks` call (so that a trace never
    outlives the graph it was traced for: what a block traces can depend on where it is traced, e.g. the
    native kernel only inside a compiled decoding loop)."""

    def __init__(self):
        self.functions = {}

    def __call__(self, block, *inputs, **options):
        import tensorflow as tf

        if block.spec not in self.functions:
            self.functions[block.spec] = tf.function(_bound_call(block), autograph=False)
        weights = [variable.value for variable in block.weights]
        packed = [layer.packed_kernel for layer in _projections(block)]
        return self.functions[block.spec](weights, packed, *inputs, **options)


def _projections(block):
    """The block's `Dense` layers, in a fixed order (their packed bfloat16 kernels are not variables)."""
    return [layer for layer in block._flatten_layers(include_self=False) if isinstance(layer, Dense)]


def _bound_call(template):
    """`template`'s forward pass as a function of the weights (and packed kernels) of any block of its spec."""

    def call(weights, packed, *inputs, **options):
        projections = _projections(template)
        own = [layer.packed_kernel for layer in projections]
        for layer, kernel in zip(projections, packed):
            layer.packed_kernel = kernel
        try:
            with keras.StatelessScope(state_mapping=list(zip(template.weights, weights))):
                return template(*inputs, training=False, **options)
        finally:
            for layer, kernel in zip(projections, own):
                layer.packed_kernel = kernel

    return call
