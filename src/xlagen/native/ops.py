"""The native kernels as XLA custom calls, with the formulas they compute in TensorFlow ops (their gradients,
and the path without them). Whether to call one is the policy's question (`policy.Kernels.use_*`); these
emit the call.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from xlagen.native.library import constant, load
from xlagen.native.packing import unpack
from xlagen.native.policy import ATTENTION_HEAD_DIMS, current

TARGET = "xlagen_bf16_matmul"
FLOAT32_TARGET = "xlagen_f32_matmul"
INT8_TARGET = "xlagen_int8_matmul"
INT8_INTEGER_TARGET = "xlagen_int8_imatmul"
INT8_MANY_INTEGER_TARGET = "xlagen_int8_many_imatmul"
GEMM_TARGETS = {"float32": "xlagen_f32_gemm", "bfloat16": "xlagen_bf16_gemm", "int8": "xlagen_int8_gemm"}
BF16_TILE_TARGET = "xlagen_bf16_tile_gemm"
# The products that can add a bias, apply an activation and add a residual connection's input as they store
# their output: target -> the target with that epilogue (`matmul`'s bias and residual, `projection`'s
# activations).
EPILOGUE_TARGETS = {INT8_MANY_INTEGER_TARGET: "xlagen_int8_many_imatmul_epilogue",
                    BF16_TILE_TARGET: "xlagen_bf16_tile_gemm_epilogue",
                    GEMM_TARGETS["float32"]: "xlagen_f32_gemm_epilogue"}
# The activations an epilogue applies, by the names of `xlagen.layers.feedforward.ACTIVATIONS`, and their codes.
EPILOGUE_ACTIVATIONS = {"relu": 1, "gelu_new": 2, "gelu_pytorch_tanh": 2}
ATTENTION_TARGET = "xlagen_f32_attention"
MASKED_ATTENTION_TARGET = "xlagen_f32_masked_attention"
BIASED_ATTENTION_TARGET = "xlagen_f32_biased_attention"
RELATIVE_ATTENTION_TARGET = "xlagen_f32_relative_attention"
STEP_ATTENTION_TARGET = "xlagen_f32_step_attention"
ARGMAX_TARGET = "xlagen_f32_argmax"
LOOKUP_TARGET = "xlagen_f32_lookup_columns"
LAYER_NORM_TARGET = "xlagen_f32_layer_norm"
RMS_NORM_TARGET = "xlagen_f32_rms_norm"
SPLIT_HEADS_TARGET = "xlagen_f32_split_heads"
MEMORY_ATTENTION_TARGET = "xlagen_f32_memory_attention"


def matmul(x, words, n: int, bias=None, residual=None):
    """`x [..., K] @ W` for W packed by `pack_bfloat16` or `pack_int8` (N = n columns), in float32; with
    `bias` (float32 `[n]`), `x @ W + b`; with `residual` (float32 `[..., n]`, a residual connection's input),
    that plus the residual.

    The native kernel's custom call where the policy of the trace says so (`Kernels.use_packed_product`:
    under XLA, in a decoding step always, elsewhere for at most `packed_max_rows` rows). Otherwise (long
    prompts, encoders, eager or non-XLA graphs, kernels off) the weights are unpacked to float32 and
    multiplied by TensorFlow's matmul, never inside a step, where XLA would unpack every iteration (10x slower
    than the kernel at 16 rows). Outside a step, more than `packed_max_rows` rows go to the many-row
    product (`Kernels.many_rows`), which widens each block of weights once and reuses it for every row.
    All compute `x @ unpack(W)`.

    int8 weights multiplied by several rows (`Kernels.use_integer_product`: at least `int8_integer_min_rows`,
    in or out of a decoding step) run in integers instead: each row of x quantized to int8 with its own scale
    (max |x| / 127, no zero point), int8 x int8 products summed exactly in int32, then scaled by the row's
    and the column's scales in float32; which adds the rounding of x to int8 to that of the weights. From
    `int8_many_integer_min_rows` rows (`Kernels.use_many_integer_product`: prompts, encoders) each row of x
    is quantized to 7 bits with a zero point instead (scale (max(x, 0) - min(x, 0)) / 126), which the CPU
    multiplies in fewer instructions. bfloat16 weights' many-row products run on AMX's bfloat16 tiles where
    the policy says so (`Kernels.use_bfloat16_tiles`): x rounded to bfloat16, sums in float32. These two
    many-row products add the bias and the residual as they store their output (their `EPILOGUE_TARGETS`: no
    pass of XLA's over it after the call); the others leave them to XLA, as `x @ W - (-b) + r`
    (`xlagen.layers.dense.Dense`); both are the same float32 adds.

    Raises:
        TypeError: x is not float32.
        ValueError: the residual is not float32 of y's shape.
        NativeUnavailable: `Kernels.bfloat16_tiles` is True where this process has no AMX tiles.
    """
    import tensorflow as tf

    x = tf.convert_to_tensor(x)
    if x.dtype != tf.float32:
        raise TypeError(f"packed weights multiply float32 activations; got {x.dtype.name}")
    residual = _checked_residual(x, n, residual)
    target = _packed_target(x, words)
    if target is None:  # also for rows of unknown or zero count
        y = tf.tensordot(x, unpack(words, n), 1)
    elif (bias is not None or residual is not None) and target in EPILOGUE_TARGETS:
        return _epilogue_call(target, x, words, n, bias, None, residual)
    else:
        load()
        y = _custom_call(target, x, words, n)
    return _add_after(y, bias, residual)


def _add_after(y, bias, residual):
    """`y - (-bias) + residual` (either may be None) in TensorFlow ops, after a product without an epilogue."""
    import tensorflow as tf

    y = y if bias is None else tf.subtract(y, tf.negative(bias))
    return y if residual is None else tf.add(y, residual)


def projection(x, words, n: int, bias, activation: str):
    """`activation(x @ W + b)` (`bias` may be None) where the product the policy picks for x applies the
    activation itself as it stores y (the 7-bit int8, the bfloat16 tile and the float32 many-row products of a
    prompt's or an encoder's rows; activations `EPILOGUE_ACTIVATIONS`), so that no pass of XLA's over y
    follows; else None, and the caller applies it. W is packed (`matmul`'s product) or a float32 kernel
    `[K, n]` (`matmul_float32`'s, where `Kernels.use_float32_product` says so). The epilogue's GELU is computed
    as y / (1 + exp(-2u)), u = sqrt(2 / pi) (y + 0.044715 y^3), within a few float32 roundings of
    `0.5 y (1 + tanh(u))`."""
    import tensorflow as tf

    x = tf.convert_to_tensor(x)
    if x.dtype != tf.float32 or activation not in EPILOGUE_ACTIVATIONS:
        return None
    if words.dtype == tf.float32:
        target = _float32_target(x) if current().use_float32_product(x, words) else None
    else:
        target = _packed_target(x, words)
    if target not in EPILOGUE_TARGETS:
        return None
    return _epilogue_call(target, x, words, n, bias, activation)


def _checked_residual(x, n: int, residual):
    """`residual` as a tensor, or None.

    Raises:
        ValueError: it is not float32 of the product's output shape (x's leading dimensions, then n): a residual is
            added element by element, never broadcast.
    """
    import tensorflow as tf

    if residual is None:
        return None
    residual = tf.convert_to_tensor(residual)
    expected = [*x.shape[:-1], n]
    if residual.shape.as_list() != expected or residual.dtype != tf.float32:
        raise ValueError(f"the residual must be float32 {expected}, as the product's output; got "
                         f"{residual.dtype.name} {residual.shape.as_list()}")
    return residual


def _epilogue_call(target: str, x, words, n: int, bias, activation: str | None, residual=None):
    """`target`'s product with its epilogue: the bias (or None) added, `activation` (or None) applied, then the
    residual (`[..., n]` as y, checked by the caller with `_checked_residual`, or None) added."""
    import tensorflow as tf

    load()
    code = 0 if activation is None else EPILOGUE_ACTIVATIONS[activation]
    extra = [] if bias is None else [tf.cast(bias, tf.float32)]
    if residual is not None:
        extra.append(tf.reshape(residual, (-1, n)))
    return _custom_call(EPILOGUE_TARGETS[target], x, words, n, extra,
                        f",{int(bias is not None)},{code},{int(residual is not None)}")


def _packed_target(x, words) -> str | None:
    """The custom call that multiplies x by the packed `words` under the policy of the trace (see `matmul`),
    or None for TensorFlow's product of the unpacked weights."""
    import tensorflow as tf

    policy = current()
    if words.dtype == tf.int8 and policy.use_many_integer_product(x):
        return INT8_MANY_INTEGER_TARGET
    if words.dtype == tf.int8 and policy.use_integer_product(x):
        return INT8_INTEGER_TARGET
    if not policy.use_packed_product(x):
        return None
    if _many_rows(policy, x, policy.packed_max_rows):
        if words.dtype != tf.int8 and policy.use_bfloat16_tiles():
            return BF16_TILE_TARGET
        return GEMM_TARGETS["int8" if words.dtype == tf.int8 else "bfloat16"]
    return INT8_TARGET if words.dtype == tf.int8 else TARGET


def _many_rows(policy, x, most: int) -> bool:
    """Whether x's product goes to the many-row product: more than `most` rows, outside a decoding step,
    under a policy with `many_rows`."""
    from xlagen.native.policy import in_decoding_step

    return policy.many_rows and x.shape[:-1].num_elements() > most and not in_decoding_step()


def _custom_call(target: str, x, weights, n: int, extra=(), config: str = ""):
    """The custom call `target` on x `[..., K]` (rows flattened), the weights and the `extra` operands ->
    float32 `[..., n]`; its backend config is "M,K,N" and then `config`."""
    import tensorflow as tf
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops

    k = x.shape[-1]
    leading = x.shape[:-1]
    rows = leading.num_elements()
    (y,) = gen_xla_ops.xla_custom_call_v2(
        operands=[tf.reshape(x, (rows, k)), weights, *extra], call_target_name=target,
        backend_config=f"{rows},{k},{n}{config}",
        has_side_effect=False, result_dtypes=[tf.float32], result_shapes=[tf.TensorShape([rows, n])])
    return tf.reshape(y, [*leading, n])


def matmul_float32(x, kernel, bias=None, residual=None):
    """`x [..., K] @ kernel [K, N]`, float32, as the native kernel's custom call (call it under XLA only;
    see `Kernels.use_float32_product`): the streaming product up to the policy's `float32_max_rows` rows,
    the many-row product above. Computes the same sums as XLA's dot in another order. With `bias` (float32
    `[N]`), `x @ kernel + b`, and with `residual` (float32 `[..., N]`) that plus the residual: the many-row
    product adds them as it stores y, else XLA after the call, as `y - (-b) + r`; both are the same float32
    adds.

    Raises:
        TypeError: x or the kernel is not float32 (the kernel would read their bytes as float32).
        ValueError: the residual is not float32 of y's shape.
    """
    import tensorflow as tf

    x, kernel = tf.convert_to_tensor(x), tf.convert_to_tensor(kernel)
    if x.dtype != tf.float32 or kernel.dtype != tf.float32:
        raise TypeError(f"the float32 kernel multiplies float32 by float32; got {x.dtype.name} @ {kernel.dtype.name}")
    residual = _checked_residual(x, kernel.shape[-1], residual)
    target = _float32_target(x)
    if (bias is not None or residual is not None) and target in EPILOGUE_TARGETS:
        return _epilogue_call(target, x, kernel, kernel.shape[-1], bias, None, residual)
    load()
    return _add_after(_custom_call(target, x, kernel, kernel.shape[-1]), bias, residual)


def _float32_target(x) -> str:
    """The float32 product's custom call for x's rows under the policy of the trace: the many-row product
    (`Kernels.many_float32_rows`) above `float32_max_rows` rows, else the streaming one."""
    policy = current()
    many = policy.many_float32_rows() and x.shape[:-1].num_elements() > policy.float32_max_rows
    return GEMM_TARGETS["float32"] if many else FLOAT32_TARGET


def _with_reference_gradient(call, reference, *inputs):
    """`call(*inputs)` (a native custom call) with the gradients of `reference(*inputs)`, the same formula
    in TensorFlow ops."""
    import tensorflow as tf

    @tf.custom_gradient
    def fused(*inputs):
        def gradient(upstream):
            with tf.GradientTape() as tape:
                tape.watch(inputs)
                expected = reference(*inputs)
            return tape.gradient(expected, list(inputs), output_gradients=upstream)

        return call(*inputs), gradient

    return fused(*inputs)


class Heads(NamedTuple):
    """Heads `[B, H, T, D]` left where a fused projection `tensor` `[B, T, W]` put them: head h's D columns
    start at column `column + h * D` of each token's row. The attention kernels read them in place, so no
    transpose into heads runs before the call (`split` is that transpose, for everything else)."""

    tensor: Any
    column: int
    heads: int
    head_dim: int

    def check(self) -> None:
        """Raises ValueError unless `tensor` is a float32 `[B, T, W]` of static shape that holds the heads'
        columns."""
        import tensorflow as tf

        shape = self.tensor.shape
        if (shape.rank != 3 or not shape.is_fully_defined() or self.tensor.dtype != tf.float32 or self.column < 0
                or self.heads < 1 or self.column + self.heads * self.head_dim > shape[2]):
            raise ValueError(f"Heads: {self.heads} heads of {self.head_dim} from column {self.column} of a "
                             f"{self.tensor.dtype.name} {shape}; a float32 [B, T, W] of static shape holds them")

    def split(self, tensor=None):
        """The heads as a tensor `[B, H, T, D]` (of `tensor` in place of `self.tensor`, for gradients)."""
        import tensorflow as tf

        tensor = self.tensor if tensor is None else tensor
        part = tensor[..., self.column:self.column + self.heads * self.head_dim]
        return tf.transpose(tf.reshape(part, (-1, part.shape[1], self.heads, self.head_dim)), (0, 2, 1, 3))

    @property
    def shape(self):
        import tensorflow as tf

        return tf.TensorShape([self.tensor.shape[0], self.heads, self.tensor.shape[1], self.head_dim])


def _operand(heads, rows: int):
    """A kernel's operand for `heads` (`Heads`, or a tensor `[B, H, rows, D]`) and its layout (offset and
    the strides of a sequence, a head and a row, in floats: see `xlagen_attention_at`), with how the
    operand's tensor turns back into heads `[B, H, rows, D]` for the reference formula."""
    if isinstance(heads, Heads):
        width = heads.tensor.shape[-1]
        return heads.tensor, [heads.column, rows * width, heads.head_dim, width], heads.split
    return heads, _packed_layout(heads.shape[1], rows, heads.shape[3]), lambda tensor: tensor


def _packed_layout(heads: int, rows: int, head_dim: int) -> list[int]:
    """The layout (see `_operand`) of a tensor `[B, heads, rows, head_dim]` of its own."""
    return [0, heads * rows * head_dim, rows * head_dim, head_dim]


def _attention_call(target: str, config: str, query, key, value, extra, bias, merged: bool, reference,
                    barrier: bool = False, bias_row=None):
    """The attention custom call `target` on `query`, `key` and `value` (each `Heads` or a tensor `[B, H,
    rows, D]`), the further operands `extra` and the optional `bias`, with their layout appended to
    `config`; returns `[B, H, T, D]`, or with `merged` `[B, T, H * D]` (the next product's input, no
    transpose after the call). The bias is passed as `[-1, T, S]`, or as `[-1, bias_row]` if that is given. `reference(query, key, value, *bias)` of heads tensors is the formula the
    gradients come from. With `barrier`, keys and values given as tensors (a cache just written) pass an
    XLA optimization barrier first (see `masked_attention`).

    Raises:
        ValueError: the three do not have the same batch, heads and head size, the keys and values the same
            length, or a `Heads` does not fit its tensor (the kernel would read past it).
    """
    import tensorflow as tf
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops

    for heads in (query, key, value):
        if isinstance(heads, Heads):
            heads.check()
    shapes = [tuple(t.shape) for t in (query, key, value)]
    if (len({(s[0], s[1], s[3]) for s in shapes}) != 1 or shapes[1][2] != shapes[2][2]
            or not all(isinstance(n, int) for s in shapes for n in s)):
        raise ValueError(f"attention: queries {shapes[0]}, keys {shapes[1]} and values {shapes[2]} differ in "
                         "batch, heads or head size, or keys and values in length")
    batch, heads, length, head_dim = query.shape
    keys = key.shape[2]
    laid = [_operand(query, length), _operand(key, keys), _operand(value, keys)]
    if merged:
        out_shape, out_layout = (batch, length, heads * head_dim), [0, length * heads * head_dim, head_dim,
                                                                     heads * head_dim]
    else:
        out_shape, out_layout = (batch * heads, length, head_dim), _packed_layout(heads, length, head_dim)
    layout = ",".join(str(n) for n in [*(n for _, numbers, _ in laid for n in numbers), *out_layout])
    cached = [i for i in (1, 2) if barrier and not isinstance((query, key, value)[i], Heads)]
    # The distinct tensors (one projection may hold q, k and v): a gradient per tensor, not one per use.
    tensors = []
    for tensor, _, _ in laid:
        if not any(tensor is t for t in tensors):
            tensors.append(tensor)
    which = [next(i for i, t in enumerate(tensors) if t is tensor) for tensor, _, _ in laid]
    given = len(tensors)

    def call(*inputs):
        operands = [inputs[i] for i in which]
        if cached:
            for i, t in zip(cached, gen_xla_ops.xla_optimization_barrier([operands[i] for i in cached])):
                operands[i] = t
        biases = [tf.reshape(b, (-1, length, keys) if bias_row is None else (-1, bias_row)) for b in inputs[given:]]
        (out,) = gen_xla_ops.xla_custom_call_v2(
            operands=[*operands, *extra, *biases], call_target_name=target, backend_config=f"{config},{layout}",
            has_side_effect=False, result_dtypes=[tf.float32], result_shapes=[tf.TensorShape(out_shape)])
        return out if merged else tf.reshape(out, (batch, heads, length, head_dim))

    def formula(*inputs):
        attended = reference(*(split(inputs[i]) for (_, _, split), i in zip(laid, which)), *inputs[given:])
        if merged:
            return tf.reshape(tf.transpose(attended, (0, 2, 1, 3)), (-1, length, heads * head_dim))
        return attended

    return _with_reference_gradient(call, formula, *tensors, *([] if bias is None else [bias]))


def _reference_attention(query, key, value, scale: float, key_transposed: bool = False):
    import tensorflow as tf

    weights = tf.nn.softmax(tf.matmul(query, key, transpose_b=not key_transposed) * scale, axis=-1)
    return tf.matmul(weights, value)


def attention(query, key, value, scale: float, key_transposed: bool = False, merged: bool = False):
    """`softmax(scale * query @ key^T) @ value` for float32 `[B, H, T, D]` queries and `[B, H, S, D]`
    keys and values, as the native kernel's custom call (call it under XLA only; see
    `Kernels.use_attention`). With `key_transposed` the keys are `[B, H, D, S]` (a decoder's
    cross-attention memory, `CrossAttention.project_memory`) and are read in place. Otherwise query, key and
    value may be `Heads` of a fused projection, also read in place, and with `merged` the output is `[B, T,
    H * D]`. The scores of a few query rows at a time (12 with AVX2, 8 with AVX-512) stay in the core's cache
    instead of being written out `[T, S]` and read back twice (Whisper-tiny's encoder, 1500 positions: about
    2x XLA's attention; its decoding steps' cross-attention: `benchmarks/ab.py --compare cross-attention`).
    Gradients are those of the same formula in TensorFlow ops."""
    import tensorflow as tf
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops

    load()
    batch, heads, length, head_dim = query.shape
    keys = key.shape[3] if key_transposed else key.shape[2]
    config = f"{batch * heads},{length},{keys},{head_dim},{float(np.float32(scale))!r},{int(key_transposed)}"
    if not key_transposed:
        return _attention_call(ATTENTION_TARGET, f"{config},{heads}", query, key, value, [], None, merged,
                               lambda *inputs: _reference_attention(*inputs, scale))
    if merged or any(isinstance(t, Heads) for t in (query, key, value)):
        raise ValueError("attention: keys given transposed come with queries and values [B, H, T, D] and return "
                         "them so")

    def call(query, key, value):
        (out,) = gen_xla_ops.xla_custom_call_v2(
            operands=[tf.reshape(t, (batch * heads, -1, t.shape[-1])) for t in (query, key, value)],
            call_target_name=ATTENTION_TARGET, backend_config=config, has_side_effect=False,
            result_dtypes=[tf.float32], result_shapes=[tf.TensorShape([batch * heads, length, head_dim])])
        return tf.reshape(out, (batch, heads, length, head_dim))

    return _with_reference_gradient(call, lambda *inputs: _reference_attention(*inputs, scale, key_transposed),
                                    query, key, value)


def _reference_masked_attention(query, key, value, mask, scale: float, mask_value: float, bias=None):
    import tensorflow as tf

    groups = query.shape[2] // mask.shape[2]
    scores = tf.matmul(query, key, transpose_b=True) * scale
    if bias is not None:
        scores = scores + bias
    weights = tf.nn.softmax(tf.where(tf.tile(mask, (1, 1, groups, 1)), scores, mask_value), axis=-1)
    return tf.matmul(weights, value)


def relative_to_dense(table, queries, keys):
    """A relative bias's table `[..., T + S - 1]` as the matrix `[..., T, S]` whose element (i, j) is
    `table[..., j - i + T - 1]` (`xlagen.layers.attention.RelativeBias`); T and S ints or int32 scalars."""
    import tensorflow as tf

    index = tf.range(keys, dtype=tf.int32)[None, :] - tf.range(queries, dtype=tf.int32)[:, None] + (queries - 1)
    return tf.gather(table, index, axis=-1)


def masked_attention(query, key, value, mask, scale: float, mask_value: float, bias=None, merged: bool = False,
                     relative: bool = False):
    """A prompt's self-attention, `softmax(where(mask, scale * query @ key^T + bias, mask_value)) @ value`, as
    the native kernel's custom call (call it under XLA only; see `Kernels.use_prompt_attention`).

    Args:
        query: float32 `[B, Hkv, g * T, D]`: T queries per head, the g query heads that share a key/value
            head as g groups of T rows (`xlagen.layers.attention.group_queries`); or, with g = 1, `Heads` of
            a fused projection, read in place.
        key, value: float32 `[B, Hkv, S, D]` (the cache: S may be longer than the prompt), or `Heads` (an
            encoder's, read in place).
        mask: bool `[B, 1, T, S]` (`xlagen.layers.attention.causal_mask`), or `[B, 1, 1, S]` (an encoder's
            padding mask), shared by the heads and groups.
        scale: Multiplier of the scores.
        mask_value: The score of a masked key: a row that sees no key is then the mean of all values.
        bias: Optional float32 `[1 or B, Hkv, T, S]` added to the scaled scores (T5's relative positions),
            without grouped queries (g = 1); with `relative`, `[1 or B, Hkv, T + S - 1]`, the bias of key j for
            query i being `bias[..., j - i + T - 1]` (`relative_to_dense`), read so by the kernel.
        merged: Return `[B, T, Hkv * D]`, the next product's input, rather than `[B, Hkv, T, D]` (for g = 1
            only: under an encoder's mask `[B, 1, 1, S]` the g groups of rows cannot be told from tokens, and
            would be written as g * T tokens).

    The kernel scores only the keys between the first and the last that a unit of a few query rows may see:
    under a causal mask about half of them, none of the cache's positions after the prompt. Gradients are
    those of the same formula in TensorFlow ops.
    """
    import tensorflow as tf
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops

    load()
    batch, kv_heads, rows, head_dim = query.shape
    length = key.shape[2]
    if mask.shape[0] != batch or mask.shape[1] != 1 or mask.shape[3] != length or rows % mask.shape[2]:
        raise ValueError(f"masked_attention: mask {mask.shape} does not match queries {query.shape} over "
                         f"{length} keys")
    if head_dim not in ATTENTION_HEAD_DIMS or key.shape[3] != head_dim:
        raise ValueError(f"masked_attention: head size {head_dim}; the kernel takes {ATTENTION_HEAD_DIMS}")
    expected = (kv_heads, rows + length - 1) if relative else (kv_heads, rows, length)
    if bias is not None and (bias.shape.rank != len(expected) + 1 or bias.shape[0] not in (1, batch) or
                             tuple(bias.shape[1:]) != expected):
        raise ValueError(f"masked_attention: {'relative ' if relative else ''}bias {bias.shape} does not match "
                         f"queries {query.shape} over {length} keys")
    if relative and bias is None:
        raise ValueError("masked_attention: relative=True needs a bias")
    config = (f"{batch * kv_heads},{rows},{length},{head_dim},{float(np.float32(scale))!r},{kv_heads},"
              f"{mask.shape[2]}")
    target = MASKED_ATTENTION_TARGET
    if bias is not None:
        target = RELATIVE_ATTENTION_TARGET if relative else BIASED_ATTENTION_TARGET
        config = f"{config},{bias.shape[0] * kv_heads}"
    mask_operand = tf.cast(tf.reshape(mask, (batch, -1, length)), tf.uint8)
    bias = None if bias is None else tf.cast(bias, tf.float32)
    if merged and rows != mask.shape[2] and mask.shape[2] != 1:
        raise ValueError("masked_attention: grouped queries (g > 1) cannot be merged into tokens")
    # Keys and values that are a cache just written (a prompt's) are also the cache the call returns:
    # `_attention_call`'s barrier keeps XLA from computing them twice, once for this operand and once for the
    # cache, and from writing that cache on another thread while the kernel runs (the kernel's own threads
    # would then share the cores with it).
    def reference(*inputs):
        biases = [relative_to_dense(b, rows, length) if relative else b for b in inputs[3:]]
        return _reference_masked_attention(*inputs[:3], mask, scale, mask_value, *biases)

    return _attention_call(target, config, query, key, value, [mask_operand], bias, merged, reference, barrier=True,
                           bias_row=rows + length - 1 if relative else None)


def step_attention(query, keys, values, key, value, bias, scale: float, mask_value: float):
    """One decoding step's self-attention as the native kernel's custom call (call it under XLA only; see
    `Kernels.use_step_attention`): for each of the K queries `[G, H, K, D]`, softmax over the cache's keys
    `[G, H, S', D]` and the step's own new key (`key`, `[G, H, K, D]`, query k's), of `scale * q . k +
    bias`, then the weighted sum of `values` and `value`. `bias` `[G, 1 or H, K, S' + 1]` (float32; the new
    key last) is -inf where a query may not see a key; such a score is `mask_value` (as
    `xlagen.layers.attention` masks, with its `MASK_VALUE`). Returns `[G, H, K, D]`. The cache may have more
    rows than G (`[N >= G, H, S', D]`): the kernel reads the first G, in place.

    The same sums as the two products and the softmax in TensorFlow ops, in one call per layer instead of
    several XLA operations (two dots and the softmax's fusions), reading the cache in place."""
    import tensorflow as tf
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops

    load()
    groups, heads, queries, head_dim = query.shape
    length = keys.shape[2]
    most = constant("step_attention_max_head_dim")
    if keys.shape[0] < groups or values.shape[0] < groups:
        raise ValueError(f"step_attention: a cache of {keys.shape[0]} rows for {groups} groups of queries")
    if head_dim > most or keys.shape[3] != head_dim:
        raise ValueError(f"step_attention: head size {head_dim} (keys {keys.shape[3]}); the kernel takes equal "
                         f"sizes up to {most}")
    if bias.shape[0] != groups or bias.shape[1] not in (1, heads) or tuple(bias.shape[2:]) != (queries, length + 1):
        raise ValueError(f"step_attention: bias {bias.shape} does not match {groups} groups, {heads} heads, "
                         f"{queries} queries and {length} + 1 keys")
    config = (f"{groups},{heads},{queries},{length},{head_dim},{bias.shape[1]},{float(np.float32(scale))!r},"
              f"{float(np.float32(mask_value))!r}")
    (out,) = gen_xla_ops.xla_custom_call_v2(
        operands=[query, keys, values, key, value, tf.cast(bias, tf.float32)], call_target_name=STEP_ATTENTION_TARGET,
        backend_config=config, has_side_effect=False, result_dtypes=[tf.float32],
        result_shapes=[tf.TensorShape([groups, heads, queries, head_dim])])
    return out


def argmax(scores):
    """The index (int32) of each row's largest value of float32 `scores` `[R, N]`, the first on ties, as the
    native kernel's custom call (call it under XLA only; see `Kernels.use_argmax`). The same result as
    `tf.argmax(scores, -1)` except on rows holding NaN, which the kernel skips (a row of only NaN or -inf
    gives 0). XLA's argmax reduces (value, index) pairs one element at a time: over Whisper-tiny's 8 x
    51,865 logits it took about 0.9 ms of a 12 ms decoding step."""
    import tensorflow as tf
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops

    load()
    rows, n = scores.shape
    (out,) = gen_xla_ops.xla_custom_call_v2(
        operands=[scores], call_target_name=ARGMAX_TARGET, backend_config=f"{rows},{n}", has_side_effect=False,
        result_dtypes=[tf.int32], result_shapes=[tf.TensorShape([rows])])
    return out


def split_heads(x, heads: int, head_dim: int, offset: int, transposed: bool, length: int | None = None, start=None):
    """The `heads` heads of `head_dim` columns from column `offset` of float32 `x` `[B, L, width]` of static
    shape: `[B, heads, head_dim, length]` if `transposed`, else `[B, heads, length, head_dim]`, as the native
    kernel's custom call (call it under XLA only; see `Kernels.use_split_heads` and `Kernels.use_fresh_cache`).
    No gradient: the policy takes it in a generation's prompt pass only.

    `length` (default L, at least L): the output's positions, the L of `x` at `[start, start + L)` and zeros
    around them; `start` is an int32 scalar tensor (default 0), clamped to `[0, length - L]` as
    `dynamic_update_slice` clamps its start. So a prompt's keys or values written at `start` into a cache of
    zeros are the cache `length` long.

    Raises:
        ValueError: `length` is less than L.
    """
    import tensorflow as tf
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops

    load()
    b, positions, width = x.shape
    length = positions if length is None else length
    if length < positions:
        raise ValueError(f"split_heads: length {length} is less than the {positions} positions of x")
    start = tf.zeros((), tf.int32) if start is None else tf.cast(tf.reshape(start, ()), tf.int32)
    shape = [b, heads, head_dim, length] if transposed else [b, heads, length, head_dim]
    (out,) = gen_xla_ops.xla_custom_call_v2(
        operands=[x, start], call_target_name=SPLIT_HEADS_TARGET,
        backend_config=f"{b},{positions},{width},{offset},{heads},{head_dim},{int(transposed)},{length}",
        has_side_effect=False, result_dtypes=[tf.float32], result_shapes=[tf.TensorShape(shape)])
    return out


def layer_norm(x, gamma, beta, epsilon: float):
    """LayerNorm over the last axis of float32 `x` `[..., E]` of static shape, `gamma` and `beta` `[E]` or
    None, as the native kernel's custom call (call it under XLA only; see `Kernels.use_layer_norm`): Keras'
    `LayerNormalization` formula, `x * inv + (beta - mean * inv)` with `inv = gamma / sqrt(var + epsilon)`, the
    row's mean and variance summed in another order. No gradient: the policy takes it in a generation's
    prompt pass only."""
    return _norm_call(LAYER_NORM_TARGET, x, epsilon, (gamma, beta), f",{int(gamma is not None)},{int(beta is not None)}")


def _norm_call(target: str, x, epsilon: float, weights, config: str = ""):
    """The norm custom call `target` over the rows of x `[..., E]` with its weights `[E]` (those not None) ->
    x's shape; its backend config is "rows,e,epsilon" and then `config`."""
    import tensorflow as tf
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops

    load()
    e = x.shape[-1]
    rows = x.shape[:-1].num_elements()
    given = [tf.cast(t, tf.float32) for t in weights if t is not None]
    (y,) = gen_xla_ops.xla_custom_call_v2(
        operands=[tf.reshape(x, (rows, e)), *given], call_target_name=target,
        backend_config=f"{rows},{e},{float(np.float32(epsilon))!r}{config}", has_side_effect=False,
        result_dtypes=[tf.float32], result_shapes=[tf.TensorShape([rows, e])])
    return tf.reshape(y, x.shape)


def rms_norm(x, scale, epsilon: float):
    """RMS norm over the last axis of float32 `x` `[..., E]` of static shape, `scale` `[E]`, as the native
    kernel's custom call (call it under XLA only; see `Kernels.use_layer_norm`): Keras' `RMSNormalization`,
    `x * rsqrt(mean(x^2) + epsilon) * scale`, the mean square summed in another order and the scale folded
    into the factor first. No gradient: the policy takes it in a generation's prompt pass only."""
    import tensorflow as tf

    return _norm_call(RMS_NORM_TARGET, x, epsilon, (tf.cast(scale, tf.float32),))  # the call reads a scale


def lookup_columns(table, ids):
    """`table[:, ids]` moved to the last axis: the float32 columns `[..., E]` of a table `[E, V]` for int32
    `ids` `[...]` of static shape, as the native kernel's custom call (call it under XLA only; see
    `Kernels.use_lookup`). Ids outside `[0, V)` are clamped into it, as XLA's gather does. No gradient: the
    policy takes it in a generation's prompt pass only."""
    import tensorflow as tf
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops

    load()
    e, v = table.shape
    n = ids.shape.num_elements()
    (out,) = gen_xla_ops.xla_custom_call_v2(
        operands=[table, tf.reshape(ids, (n,))], call_target_name=LOOKUP_TARGET, backend_config=f"{e},{v},{n}",
        has_side_effect=False, result_dtypes=[tf.float32], result_shapes=[tf.TensorShape([n, e])])
    return tf.reshape(out, [*ids.shape, e])


def reference_memory_attention(query, states, key_kernel_t, kv_kernel, kv_bias, heads: int, scale: float):
    """What `memory_attention` computes, in TensorFlow ops (its gradient, and the path without the kernel):
    each head's softmax attention of `query` over keys `states @ Wk_h` and values `states @ Wv_h + bv_h`,
    where `Wk` is `key_kernel_t` transposed and `[Wk, Wv]`, `[bk, bv]` are `kv_kernel`, `kv_bias`."""
    import tensorflow as tf

    groups, queries, width = tf.shape(query)[0], tf.shape(query)[1], query.shape[-1]
    head_dim = width // heads
    embed = states.shape[-1]
    query = tf.reshape(query, (groups, queries, heads, head_dim))
    folded = tf.einsum("gqhd,hde->gqhe", query, tf.reshape(key_kernel_t, (heads, head_dim, embed))) * scale
    weights = tf.nn.softmax(tf.einsum("gqhe,gle->gqhl", folded, states), axis=-1)
    mixed = tf.einsum("gqhl,gle->gqhe", weights, states)
    values = tf.reshape(kv_kernel[:, width:], (embed, heads, head_dim))
    out = tf.einsum("gqhe,ehd->gqhd", mixed, values) + tf.reshape(kv_bias[width:], (heads, head_dim))
    return tf.reshape(out, (groups, queries, width))


def memory_attention(query, states, key_kernel_t, kv_kernel, kv_bias, heads: int, scale: float):
    """Cross-attention of float32 queries `query` `[G, Q, H * D]` (Q query rows per row of the encoder output:
    the tokens of one step or prompt, times the beams sharing it) over an encoder output `states`
    `[G, L, E]` whose keys and values are its projections: `kv_kernel` `[E, 2 * H * D]` (keys, then
    values, as `CrossAttention.key_value` holds them), `kv_bias` `[2 * H * D]` and `key_kernel_t` the key
    half of `kv_kernel` transposed, `[H * D, E]`. Returns `[G, Q, H * D]`, the heads side by side.

    As the native kernel's custom call (call it under XLA only; see `Kernels.use_memory_attention`), which folds
    the projections into the query and the output: `softmax(q Wk_h^T states^T) states Wv_h + bv_h`, so
    each decoder layer reads `states` rather than its own projected keys and values (half the bytes, and
    no projection before the loop; `benchmarks/ab.py --compare fold`). The key bias moves every score of a row by the
    same amount, which the softmax ignores. Gradients are those of `reference_memory_attention`."""
    import tensorflow as tf
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops

    load()
    groups, queries, width = query.shape
    _, length, embed = states.shape
    head_dim = width // heads
    if head_dim * heads != width or head_dim not in ATTENTION_HEAD_DIMS or embed % 64:
        raise ValueError(f"memory_attention: {heads} heads of width {width} over states of width {embed}; the "
                         f"kernel takes head sizes {ATTENTION_HEAD_DIMS} and widths that are multiples of 64")
    if tuple(key_kernel_t.shape) != (width, embed) or tuple(kv_kernel.shape) != (embed, 2 * width):
        raise ValueError(f"memory_attention: kernels {key_kernel_t.shape} and {kv_kernel.shape} do not match "
                         f"{width} query columns over states of width {embed}")
    config = f"{groups},{queries},{heads},{head_dim},{length},{embed},{float(np.float32(scale))!r}"

    def call(*inputs):
        (out,) = gen_xla_ops.xla_custom_call_v2(
            operands=list(inputs), call_target_name=MEMORY_ATTENTION_TARGET, backend_config=config,
            has_side_effect=False, result_dtypes=[tf.float32], result_shapes=[tf.TensorShape([groups, queries, width])])
        return out

    return _with_reference_gradient(call, lambda *inputs: reference_memory_attention(*inputs, heads, scale),
                                    query, states, key_kernel_t, kv_kernel, kv_bias)
