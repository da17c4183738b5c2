"""Where xlagen's native kernels replace XLA's own operations: one frozen value, `Kernels`.

Every choice lives in a `Kernels` value: whether the kernels run at all, which products, attentions and
argmaxes they take and from which sizes. A program is traced under one policy (`tracing`), which
`generate`, `CompiledGenerator` (part of its programs' key), export and AOT each take or choose; the layers
ask the policy of the trace in progress (`current`) through the `use_*` functions. The decoding loops mark
where a step is traced (`decoding_step`): some kernels only pay off there, where the same small products
repeat at every token.

Environment variables are read here only (`Kernels.from_env`, `PoolSettings.from_env`) and, for the build,
in `build.py`:

| variable | default | meaning |
|---|---|---|
| `XLAGEN_FLOAT32_KERNEL` | `1` | `0`: float32 weights use XLA's dot and attention (`Kernels.float32`) |
| `XLAGEN_NATIVE_THREADS` | CPUs this process may use, at most 8 | the kernels' threads, caller included |
| `XLAGEN_NATIVE_SPIN_US` | `600` | microseconds an idle worker spins at most before it sleeps, while cores are free (`0`: never) |
| `XLAGEN_NATIVE_LOOKAHEAD_KB` | `768` | KiB of the next product each idle worker reads ahead |
| `XLAGEN_CACHE` | `~/.cache/xlagen` | the cache; the library is built into its `native/` folder |
| `CXX` | `g++`, else `c++` | the compiler that builds the library once |
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

ATTENTION_HEAD_DIMS = (16, 32, 64, 128)  # the head sizes the fused attentions have code for


@functools.lru_cache(maxsize=1)
def many_integer_min_rows() -> int:
    """`Kernels.int8_many_integer_min_rows`' default: 8 where the kernels' build has AMX's int8 tiles and
    this process may use them (`build.tiles_granted()`), else 24. With the tiles the 7-bit product of GPT-2-small's shapes
    took 0.75x the 8-bit one's time at 8 rows and 0.5x at 16 (`xlagen_int8_many_integer_product` against
    `xlagen_int8_integer_product` alone, 2 threads); with vectors only it overtakes the 8-bit product at 24."""
    from xlagen.native import build

    return 8 if build.tiles_granted() else 24


def _default(field: dataclasses.Field):
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


# The Kernels fields that may be None.
_OPTIONAL = ("float32_max_columns", "int8_integer_min_rows", "int8_many_integer_min_rows", "layer_norm_min_rows",
             "lookup_min_tokens", "memory_heads_min_positions", "prompt_attention_min_tokens",
             "prompt_cache_min_tokens")


@dataclass(frozen=True)
class Kernels:
    """When the native kernels run; a program traced under a policy keeps what it was traced with.

    Attributes:
        enabled: Whether any native kernel runs (False: XLA's own ops only, as a program that leaves the
            process needs: SavedModel export, `xlagen aot`; packed weights are then unpacked and multiplied
            by XLA's dot).
        float32: Whether float32 weights use the kernels (products, attentions, argmax); bfloat16 and int8
            weights always do while `enabled`.
        float32_max_rows: A decoding step's float32 product uses the kernel up to this many rows (batch x
            beams): 16 covers 2 beams over a batch of 8. So does a generation's prompt pass of at most this
            many rows (prompt tokens x batch) with `float32_prefill`. At 16 rows the product is close to compute-bound;
            the kernel still made the whole of `generate` 1.12-1.20x faster than XLA's dot there (GPT-2,
            OPT, T5, Whisper, beam 2 at batch 8; `benchmarks/ab.py --compare kernel --max-rows 16`).
        float32_min_bytes: Float32 weight matrices smaller than this stay with XLA's dot (0: none do; every
            product on the kernel measured faster or even, `benchmarks/ab.py --compare rules`).
        float32_max_columns: If set, one-row float32 products with more columns than this (LM heads) stay
            with XLA's dot.
        float32_prefill: A generation's prompt pass (`prefill`) of at most `float32_max_rows` rows takes the
            float32 kernel as a decoding step does; XLA's dot on a few rows of a large matrix is far slower
            (the first token of an 8-token prompt, batch 1: GPT-2-small 79 against 164 ms, Qwen2.5-0.5B's
            shapes 167 against 384, Llama-3.2-1B's 628 against 1,731; `benchmarks/ab.py --compare prefill
            --new-tokens 1`). Long prompts keep XLA's dot, which is faster once compute-bound.
        packed_max_rows: Outside a decoding step, products of packed weights with more rows than this (long
            prompts, encoders) run on the many-row product (`many_rows`), or without it unpack the weights
            and use XLA's dot; inside a step they always use the streaming kernel (XLA would unpack at
            every step).
        many_rows: Packed weights' products of more than `packed_max_rows` rows outside a decoding step (a long
            prompt, an encoder) run on the native many-row product (`gemm.cc`: the weights widened to
            float32 once per block of 256 weight rows and reused by every row of x, register tiles of 6
            rows by 16 columns with AVX2) instead of being unpacked for XLA's dot: GPT-2-small's first
            token from a 512-token prompt with bfloat16 weights, 1,331 against 1,000 ms
            (`benchmarks/ab.py --compare many-rows --weights bfloat16 --prompt-tokens 512 --new-tokens 1`).
        bfloat16_tiles: bfloat16 weights' many-row products (`many_rows`) run on AMX's bfloat16 tiles
            (`xlagen_bf16_tile_product`): x rounded to bfloat16 (to nearest even), the pairs' exact products
            summed in float32, 16 x 16 x 32 multiply-adds per instruction, about 3x the float32-compute
            product's speed on GPT-2-small's prompt shapes. It adds the rounding of the activations to that of
            the weights, in prompts and encoders only (a decoding step's products keep float32 activations).
            None (the default): where this process has the tiles (`library.amx_tiles()`); True where it has
            not raises NativeUnavailable at the trace; False: never.
        float32_many_rows: A generation's prompt pass's float32 products of more than `float32_max_rows` rows
            run on the many-row product too, instead of XLA's dot; it adds a projection's bias and applies a
            feed-forward block's ReLU or tanh-form GELU as it stores y (`ops.projection`). None (the default):
            where the kernels run with AVX-512 (`library.isa()`), or XLA's own thread pool has one thread
            (`tf.config.threading.set_intra_op_parallelism_threads(1)`, see `xla_single_threaded`), whose dot
            would then use one core while the kernels' pool has them all. With AVX-512 (register tiles of 14
            rows by 32 columns) the first token of a 512-token prompt came 1.07x as fast as with XLA's dot
            for GPT-2-small and 1.15x for T5-small, Whisper-tiny's (its encoder) 1.00x (2 threads,
            `benchmarks/ab.py --compare many-rows-float32 --prompt-tokens 512 --new-tokens 1`). Not on AVX2
            alone: alone, the many-row product multiplies GPT-2-small's 512 x 768 by 768 x 3072 at
            126-130 GFLOP/s on 2 AVX2 cores against numpy's (OpenBLAS) 114-129, but inside the prompt pass
            it was 0.90-0.94x as fast as XLA's dot on XLA's two threads.
        int8_integer_min_rows: Products of int8 weights with at least this many rows (batch x beams in a
            decoding step; prompt tokens x batch in a prefill; encoder positions) run in integers
            (`xlagen_int8_imatmul`: activations quantized to int8 per row, int8 x int8 sums in int32), which
            does about half the float32 kernel's instructions per multiply-add but first quantizes x and
            interleaves each panel; fewer rows (batch-1 decoding, bandwidth-bound) keep the float32-compute
            int8 kernel. None: never. The int8 x int8 kernel alone against the float32-compute one, all of
            GPT-2-small's decoding products (`benchmarks/kernel_variants.py --model gpt2 --weights int8
            int8-integer`, AVX2, 2 threads, a loaded machine): 0.94x as fast at 1 row, 1.09x at 2, 1.05x
            at 4, 1.35x at 8, 1.40x at 64, 1.77x at 512 (per product, mostly idle, 1.05-1.25x at 4 rows
            and 0.63-0.88x at 1-2); in `generate` (`benchmarks/ab.py --compare integer --weights int8`,
            greedy): GPT-2-small 1.16x at batch 4, 1.23x at batch 8, T5-small 1.21x at batch 8.
        int8_many_integer_min_rows: Products of int8 weights with at least this many rows (a prompt's tokens x
            batch, an encoder's positions; a decoding step's batch x beams) run in integers with the
            activations quantized to 7 bits per row with a zero point (`xlagen_int8_many_imatmul`: scale
            (max(x, 0) - min(x, 0)) / 126), which needs 3 instructions per 32 multiply-adds on AVX2 where the
            8-bit product needs 4, for one bit of the activations (none where a row is one-signed, as after
            GELU). Takes precedence over `int8_integer_min_rows`; None: never. Against the 8-bit product,
            all of GPT-2-small's products, its LM head included (`benchmarks/kernel_variants.py --model gpt2
            --weights int8-integer int8-many-integer`, AVX2, 2 threads): 0.94x as fast at 8 rows, 0.95x at
            16, 1.04x at 24, 1.08x at 32, 1.17x at 64, 1.27x at 512. Where the CPU has AMX's int8 tiles
            the product runs on them, 3.5-4x as fast as with AVX-512 VNNI at 512 rows, and the default is
            8 rows (`many_integer_min_rows`).
        attention_min_keys: Unmasked float32 attention over at least this many keys runs as the fused kernel
            under XLA: Whisper's encoder and its decoder's cross-attention (1500 positions).
        cross_attention: Whether a decoder's cross-attention over keys projected once and kept transposed
            also runs as the fused kernel (`benchmarks/ab.py --compare cross-attention`).
        memory_attention_min_bytes: A generation's cross-attention reads the encoder output itself, the
            projections folded in, from this many bytes of encoder output: the per-layer keys and values it
            replaces (twice as many bytes, per layer) no longer stay in the CPU's caches between steps.
            Whisper-tiny greedy (`benchmarks/ab.py --compare fold`): batch 8 (18 MB) 1.059x, batch 4 (9 MB)
            1.021x, batch 1 (2.3 MB) 0.96x.
        step_attention_min_rows: A decoding step's self-attention runs as one native call per layer from
            this many query rows (batch x beams): at 2 and 8 rows GPT-2-small's `generate` was 1.035x and
            1.074x faster, at one row 0.98-0.99x (`benchmarks/ab.py --compare step-attention`).
        slot_step_attention_min_rows: The same for a step of `xlagen.generation.slots.SlotDecoder` (the serving
            engine's), whose cache holds `max_length * 1.25` columns per slot of which most are masked (left
            of a request's prompt, right of the write column): the native call skips the masked keys, XLA's
            dots read them all. A lone GPT-2-small stream on 8 slots of 1,024 columns ran 19.2 ms per token
            with the native call against 31.5 with XLA's dots (`benchmarks/lone_stream.py --xla-attention`).
        prompt_attention_min_tokens: A generation's prompt pass (`prefill`) of at least this many tokens runs
            its masked self-attention as one native call per layer (`ops.masked_attention`), which scores
            only the keys each tile of 12 query rows (8 with AVX-512) may see: under the causal mask about half of XLA's work,
            and none of the cache's positions after the prompt, with the scores kept in the core's cache.
            So does an encoder's self-attention under its padding mask in the prompt pass, T5's with its
            relative position bias added to the scores. None: never. GPT-2-small's first token
            (`benchmarks/ab.py --compare prompt-attention --prompt-tokens P --new-tokens 1`, AVX2, 2
            threads): 1.07-1.10x as fast as XLA's attention from 512 tokens, even (0.91-0.98x) at 64.
        prompt_cache_min_tokens: A generation's prompt pass of at least this many tokens writes its keys and
            values into the fresh cache (`xlagen.cache.FreshCache`) with the native kernel on the pool
            (`ops.split_heads` of the fused projection, zeros after the prompt), where XLA pads and transposes
            each layer's keys and values on one thread (GPT-2-small's 24 writes from a 512-token prompt: about
            7 ms). Not where the keys are rotated or normed first (the Llama family). None: never.
        argmax: Whether greedy decoding's choice of token runs as the native argmax (XLA's reduces one logit
            at a time: over Whisper-tiny's 8 x 51,865 logits about 0.9 ms of a 12 ms step).
        memory_heads_min_positions: A decoder's cross-attention memory of this many encoder positions or more is
            laid out in heads (keys transposed `[B, H, D, L]`, values `[B, H, L, D]`) by the native kernel
            before the loop (`ops.split_heads`): XLA transposed each into a layout of its own and copied it
            again for the loop and the first step (T5-small at 512 positions: about 9 ms). None: never.
        layer_norm_min_rows: A generation's prompt pass runs its LayerNorms, and its RMS norms (T5's, the Llama
            family's), of this many rows or more as the native kernel (`ops.layer_norm`, `ops.rms_norm`): XLA
            splits each row's sums into a reduce-window and a reduce (GPT-2-small's 25 norms of a 512-token
            prompt: about 9 ms; T5-small's 13 RMS norms: about 4 ms). None: never.
        lookup_min_tokens: A generation's prompt pass looks up the embeddings of this many tokens or more
            with the native lookup (`ops.lookup_columns`): the table is stored `[hidden, V]` (the tied output
            projection's layout), each value in its own cache line, and XLA's gather fetches them one at a
            time (GPT-2-small's 512 tokens: about 3 ms). None: never.
        share_traces: Identical blocks of a model are traced once and called once per layer under XLA
            (`xlagen.layers.block`), which shortens tracing and compiling; False traces block by block.
    """

    enabled: bool = True
    float32: bool = True
    float32_max_rows: int = 16
    float32_min_bytes: int = 0
    float32_max_columns: int | None = None
    float32_prefill: bool = True
    packed_max_rows: int = 32
    many_rows: bool = True
    bfloat16_tiles: bool | None = None
    float32_many_rows: bool | None = None
    int8_integer_min_rows: int | None = 4
    int8_many_integer_min_rows: int | None = dataclasses.field(default_factory=many_integer_min_rows)
    attention_min_keys: int = 256
    cross_attention: bool = True
    memory_attention_min_bytes: int = 8 * 2**20
    step_attention_min_rows: int = 2
    slot_step_attention_min_rows: int = 1
    prompt_attention_min_tokens: int | None = 128
    prompt_cache_min_tokens: int | None = 64
    argmax: bool = True
    memory_heads_min_positions: int | None = 64
    layer_norm_min_rows: int | None = 64
    lookup_min_tokens: int | None = 64
    share_traces: bool = True

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type in ("bool", "bool | None"):
                if not isinstance(value, (bool, np.bool_)) and (value is not None or field.type == "bool"):
                    raise TypeError(f"Kernels.{field.name} must be a bool{' or None' * (field.type != 'bool')}, "
                                    f"got {value!r}")
            elif value is not None or field.name not in _OPTIONAL:
                if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                    raise TypeError(f"Kernels.{field.name} must be an int, got {value!r}")
                if value < 0:
                    raise ValueError(f"Kernels.{field.name} must be >= 0, got {value}")

    def replace(self, **changes) -> "Kernels":
        """This policy with some fields changed (checked as the constructor checks them)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Kernels":
        """The default policy with the environment's choices (`XLAGEN_FLOAT32_KERNEL=0`).

        Raises:
            ValueError: XLAGEN_FLOAT32_KERNEL is neither 0 nor 1.
        """
        environ = os.environ if environ is None else environ
        value = environ.get("XLAGEN_FLOAT32_KERNEL", "1").strip()
        if value not in ("0", "1"):
            raise ValueError(f"XLAGEN_FLOAT32_KERNEL must be 0 or 1, got {value!r}")
        return cls() if value == "1" else cls(float32=False)

    def __str__(self) -> str:
        if not self.enabled:
            return "kernels off"
        changed = [f"{field.name}={getattr(self, field.name)}" for field in dataclasses.fields(self)
                   if getattr(self, field.name) != _default(field)]
        return f"kernels ({', '.join(changed)})" if changed else "default kernels"

    # What the layers ask while a program is traced under this policy (see `current`).

    def use_float32_product(self, x, kernel) -> bool:
        """Whether `x @ kernel` (both float32, x with static leading dimensions) should be
        `ops.matmul_float32`: in a decoding step (or a generation's prompt pass, with `float32_prefill`)
        compiled by XLA, at most `float32_max_rows` rows, a kernel of at least `float32_min_bytes` and, for
        one row, at most `float32_max_columns` columns (if set), and the kernels loadable; or, with
        `float32_many_rows`, more rows in a generation's prompt pass compiled by XLA (`ops.matmul_float32` then
        emits the many-row product)."""
        import tensorflow as tf

        if not self._float32() or x.dtype != tf.float32 or kernel.dtype != tf.float32:
            return False
        rows = x.shape[:-1].num_elements()
        if rows is None or not rows or len(kernel.shape) != 2:
            return False
        if rows > self.float32_max_rows:  # the many-row product, in a prompt pass only
            return self.many_float32_rows() and in_prefill() and under_xla() and _ready()
        if kernel.shape[0] * kernel.shape[1] * 4 < self.float32_min_bytes:
            return False
        if rows == 1 and self.float32_max_columns is not None and kernel.shape[1] > self.float32_max_columns:
            return False
        return (in_decoding_step() or self.float32_prefill and in_prefill()) and under_xla() and _ready()

    def use_packed_product(self, x) -> bool:
        """Whether `x @ W` for packed (bfloat16 / int8) weights should be a native kernel (else the weights
        are unpacked and multiplied by XLA's dot): under XLA, with kernels `enabled`, in a decoding step
        always, elsewhere for at most `packed_max_rows` rows of x or with `many_rows` (`ops.matmul` picks
        the many-row product above `packed_max_rows` rows outside a step)."""
        rows = x.shape[:-1].num_elements()
        if not self.enabled or not rows or not under_xla():
            return False
        return in_decoding_step() or rows <= self.packed_max_rows or self.many_rows

    def use_bfloat16_tiles(self) -> bool:
        """Whether bfloat16 weights' many-row products run on AMX's bfloat16 tiles: `bfloat16_tiles`, None
        resolved to whether this process has them.

        Raises:
            NativeUnavailable: `bfloat16_tiles` is True and this process has no AMX tiles.
        """
        from xlagen.native.library import NativeUnavailable, amx_tiles

        if self.bfloat16_tiles is not None and not self.bfloat16_tiles:  # False, numpy's too
            return False
        try:
            available = amx_tiles()
        except NativeUnavailable as error:
            if self.bfloat16_tiles:
                raise
            return False
        if self.bfloat16_tiles and not available:
            raise NativeUnavailable("Kernels.bfloat16_tiles=True needs AMX's bfloat16 tiles (a CPU with amx_bf16, "
                                    "Linux 5.16 or later); this process has none (use None or False)")
        return available

    def use_integer_product(self, x) -> bool:
        """Whether `x @ W` for int8 weights should be the int8 x int8 kernel: where `use_packed_product`
        says the packed kernel (or XLA's dot on unpacked weights) runs, when x has at least
        `int8_integer_min_rows` rows (and that is not None)."""
        return self._integer_rows(x, self.int8_integer_min_rows)

    def use_many_integer_product(self, x) -> bool:
        """Whether `x @ W` for int8 weights should be the 7-bit integer kernel: under XLA with kernels
        `enabled`, when x has at least `int8_many_integer_min_rows` rows (and that is not None)."""
        return self._integer_rows(x, self.int8_many_integer_min_rows)

    def use_attention(self, query, key, mask=None, bias=None, dropout: bool = False,
                      key_transposed: bool = False) -> bool:
        """Whether `softmax(scale * query @ key^T) @ value` should be `ops.attention`: float32 `[B, H, T, D]`
        queries and `[B, H, S, D]` keys (`[B, H, D, S]` if `key_transposed`) of static shapes, S >=
        `attention_min_keys`, D in `ATTENTION_HEAD_DIMS`, no score bias, a mask that is None or a constant
        all True, no dropout, under XLA (in or out of a decoding step), `cross_attention` for transposed
        keys, and the kernels loadable."""
        import tensorflow as tf

        if bias is not None or dropout or not self._static_float32(4, query, key):
            return False
        if key_transposed and not self.cross_attention:
            return False
        keys, key_dim = (key.shape[3], key.shape[2]) if key_transposed else (key.shape[2], key.shape[3])
        if keys < self.attention_min_keys or query.shape[3] not in ATTENTION_HEAD_DIMS or key_dim != query.shape[3]:
            return False
        if mask is not None:
            constant = tf.get_static_value(mask)
            if constant is None or not np.all(constant):
                return False
        return under_xla() and _ready()

    def use_step_attention(self, query, keys) -> bool:
        """Whether a decoding step's self-attention (`xlagen.layers.attention.Attention._step`) should be
        `ops.step_attention`: float32 `[G, H, K, D]` queries and `[G, Hkv, S', D]` cache keys of static shapes
        (Hkv = H, or fewer key/value heads under grouped-query attention, whose caller then folds each
        key/value head's queries into its rows), at least `step_attention_min_rows` queries (G x K), D at most
        the kernel's largest head size, in a decoding step compiled by XLA, and the kernels loadable."""
        if not self._static_float32(4, query, keys) or keys.shape[3] != query.shape[3]:
            return False
        if query.shape[0] * query.shape[2] < self.step_attention_min_rows:
            return False
        if not (in_decoding_step() and under_xla() and _ready()):
            return False
        from xlagen.native.library import constant

        return query.shape[3] <= constant("step_attention_max_head_dim")

    def use_prompt_attention(self, query, key, mask, bias=None, dropout: bool = False, relative: bool = False) -> bool:
        """Whether a prompt's self-attention (`xlagen.layers.attention._MultiHead._attend` over the cache) or
        an encoder's should be `ops.masked_attention`: float32 `[B, Hkv, g * T, D]` queries and `[B, Hkv, S,
        D]` keys of static shapes, a bool mask `[B, 1, T, S]` (a prompt's) or `[B, 1, 1, S]` (an encoder's
        padding), g * T >= `prompt_attention_min_tokens` and T >= 2 for a prompt's mask, optionally a float32
        score bias `[1 or B, Hkv, T, S]` (with `relative`, the table `[1 or B, Hkv, T + S - 1]` of a
        `layers.attention.RelativeBias`) without grouped queries (T5's relative positions), no dropout, D in
        `ATTENTION_HEAD_DIMS`, in a generation's prompt pass (its encoder included) compiled by XLA, and the
        kernels loadable."""
        import tensorflow as tf

        if self.prompt_attention_min_tokens is None or dropout or mask is None:
            return False
        if not self._static_float32(4, query, key) or mask.dtype != tf.bool or not mask.shape.is_fully_defined():
            return False
        batch, _, tokens, length = mask.shape
        if mask.shape.rank != 4 or batch != query.shape[0] or mask.shape[1] != 1 or length != key.shape[2]:
            return False
        rows = query.shape[2]  # g * T
        prompt = tokens if tokens > 1 else rows
        if prompt < max(self.prompt_attention_min_tokens, 2) or rows % tokens:
            return False
        if query.shape[3] not in ATTENTION_HEAD_DIMS or key.shape[3] != query.shape[3]:
            return False
        if bias is not None:
            if not self._static_float32(3 if relative else 4, bias) or bias.shape[0] not in (1, batch):
                return False
            if tuple(bias.shape[1:]) != ((query.shape[1], rows + length - 1) if relative else
                                         (query.shape[1], rows, length)):
                return False
        return in_prefill() and under_xla() and _ready()

    def use_argmax(self, scores) -> bool:
        """Whether an argmax over the last axis of `scores` should be `ops.argmax`: float32 `[R, N]` of
        static shape, `argmax` on, under XLA (in or out of a decoding step), and the kernels loadable."""
        if not self.argmax or not self._static_float32(2, scores) or scores.shape[1] == 0:
            return False
        return under_xla() and _ready()

    def use_split_heads(self, x) -> bool:
        """Whether a cross-attention memory's key/value projection `x` `[B, L, width]` should be laid out in
        heads by `ops.split_heads`: float32 of static shape, L at least `memory_heads_min_positions`, in a
        generation's prompt pass compiled by XLA, and the kernels loadable."""
        if self.memory_heads_min_positions is None or not self._static_float32(3, x):
            return False
        if x.shape[1] < max(self.memory_heads_min_positions, 1):
            return False
        return in_prefill() and under_xla() and _ready()

    def use_fresh_cache(self, heads, cache) -> bool:
        """Whether a prompt's keys or values, `heads` (`ops.Heads` of the fused projection `[B, T, width]`),
        should be written into a fresh cache tensor `cache` `[B, H, S, D]` of zeros by `ops.split_heads`: both
        float32 of static shapes, the same B, H and D, S at least T, T at least `prompt_cache_min_tokens`, in
        a generation's prompt pass compiled by XLA, and the kernels loadable."""
        x = heads.tensor
        if self.prompt_cache_min_tokens is None or not self._static_float32(3, x) or not self._static_float32(4, cache):
            return False
        batch, head_count, length, head_dim = cache.shape
        if (batch, head_count, head_dim) != (x.shape[0], heads.heads, heads.head_dim) or length < x.shape[1]:
            return False
        if x.shape[1] < max(self.prompt_cache_min_tokens, 1):
            return False
        return in_prefill() and under_xla() and _ready()

    def use_layer_norm(self, x, gamma, beta) -> bool:
        """Whether a LayerNorm over the last axis of `x` should be `ops.layer_norm` (an RMS norm, whose scale is
        `gamma` and `beta` None, `ops.rms_norm`): float32 x of static shape with at least `layer_norm_min_rows`
        rows, float32 `gamma` and `beta` `[E]` (or None), in a generation's prompt pass compiled by XLA, and
        the kernels loadable."""
        if self.layer_norm_min_rows is None or not self._float32():
            return False
        if x.dtype != "float32" or x.shape.rank is None or x.shape.rank < 2 or not x.shape.is_fully_defined():
            return False
        if x.shape[:-1].num_elements() < max(self.layer_norm_min_rows, 1):
            return False
        if any(t is not None and (t.dtype != "float32" or tuple(t.shape) != (x.shape[-1],)) for t in (gamma, beta)):
            return False
        return in_prefill() and under_xla() and _ready()

    def use_lookup(self, table, ids) -> bool:
        """Whether `table[:, ids]` (an embedding lookup from a float32 table `[E, V]`, int32 ids of static
        shape) should be `ops.lookup_columns`: at least `lookup_min_tokens` ids, in a generation's prompt
        pass compiled by XLA, and the kernels loadable."""
        import tensorflow as tf

        if self.lookup_min_tokens is None or not self._static_float32(2, table):
            return False
        if ids.dtype != tf.int32 or not ids.shape.is_fully_defined():
            return False
        if ids.shape.num_elements() < max(self.lookup_min_tokens, 1):
            return False
        return in_prefill() and under_xla() and _ready()

    def use_memory_attention(self, states, mask, head_dim: int) -> bool:
        """Whether a generation's cross-attention over the encoder output `states` `[G, L, E]`
        (`xlagen.models.base.encoder_context`) should be `ops.memory_attention`, the key and value
        projections folded in: float32 of static shape and at least `memory_attention_min_bytes`, L >=
        `attention_min_keys`, E a multiple of 64, D in `ATTENTION_HEAD_DIMS`, no mask (every encoder
        position real), under XLA, and the kernels loadable."""
        if mask is not None or not self._static_float32(3, states):
            return False
        if states.shape[1] < self.attention_min_keys or states.shape[2] % 64 or head_dim not in ATTENTION_HEAD_DIMS:
            return False
        if 4 * states.shape.num_elements() < self.memory_attention_min_bytes:
            return False
        return under_xla() and _ready()

    def _integer_rows(self, x, least: int | None) -> bool:
        """Whether an int8 product of x runs in integers from `least` rows (None: never): under XLA, with
        kernels `enabled`, x with at least that many rows (at least one)."""
        rows = x.shape[:-1].num_elements()
        if not self.enabled or least is None or not rows or not under_xla():
            return False
        return rows >= max(least, 1)

    def many_float32_rows(self) -> bool:
        """`float32_many_rows`, None resolved: whether the kernels run with AVX-512 here, or XLA's thread pool
        has one thread now."""
        if self.float32_many_rows is not None:
            return bool(self.float32_many_rows)
        from xlagen.native.library import isa

        return (isa() or "").startswith("avx512") or xla_single_threaded()

    def _float32(self) -> bool:
        return self.enabled and self.float32

    def _static_float32(self, rank: int, *tensors) -> bool:
        """Whether the float32 kernels may take `tensors` at all: float32 kernels on, every tensor float32
        with `rank` axes of static sizes."""
        import tensorflow as tf

        if not self._float32():
            return False
        return all(t.dtype == tf.float32 and t.shape.rank == rank and t.shape.is_fully_defined() for t in tensors)


Kernels.DEFAULT = Kernels()
Kernels.OFF = Kernels(enabled=False)


@dataclass(frozen=True)
class PoolSettings:
    """The kernels' thread pool, made once per process at the first kernel call (`library.configure_pool`).

    Attributes:
        threads: Threads, the caller included (None: the CPUs this process may use, at most 8).
        spin_us: Microseconds an idle worker spins at most before it sleeps (None: 600); it spins only while the
            machine has a core that no other runnable thread wants, and the calling thread, waiting for a
            worker's part of a call, spins no longer than this either. 0: no thread of the pool ever spins.
        lookahead_kib: KiB of the next float32 product each idle worker reads ahead (None: 768).
    """

    threads: int | None = None
    spin_us: int | None = None
    lookahead_kib: int | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"PoolSettings.{field.name} must be an int or None, got {value!r}")
            if value < (1 if field.name == "threads" else 0):
                raise ValueError(f"PoolSettings.{field.name} must be >= {1 if field.name == 'threads' else 0}, "
                                 f"got {value}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "PoolSettings":
        """XLAGEN_NATIVE_THREADS, XLAGEN_NATIVE_SPIN_US and XLAGEN_NATIVE_LOOKAHEAD_KB (unset: the default).

        Raises:
            ValueError: a variable that is not a whole number in range, named.
        """
        environ = os.environ if environ is None else environ
        values = {}
        for name, variable in (("threads", "XLAGEN_NATIVE_THREADS"), ("spin_us", "XLAGEN_NATIVE_SPIN_US"),
                               ("lookahead_kib", "XLAGEN_NATIVE_LOOKAHEAD_KB")):
            text = environ.get(variable, "").strip()
            if not text:
                continue
            try:
                values[name] = int(text)
                cls(**{name: values[name]})
            except (TypeError, ValueError) as error:
                raise ValueError(f"{variable}={text!r} is not valid: {error}") from error
        return cls(**values)


_active: contextvars.ContextVar[Kernels | None] = contextvars.ContextVar("xlagen_kernels", default=None)
_in_step = contextvars.ContextVar("xlagen_decoding_step", default=False)
_in_prefill = contextvars.ContextVar("xlagen_prefill", default=False)


def current() -> Kernels:
    """The policy of the program being traced: the innermost `tracing` block's, else `Kernels.from_env()`."""
    active = _active.get()
    return Kernels.from_env() if active is None else active


@contextlib.contextmanager
def tracing(kernels: Kernels | None) -> Iterator[Kernels]:
    """Within this block programs are traced under `kernels` (None: the policy already in force, `current`).

    Raises:
        TypeError: kernels is not a `Kernels`.
        NativeUnavailable: kernels asks for what this CPU or process lacks (`bfloat16_tiles=True` without AMX):
            here, before anything is traced, not from inside a trace.
    """
    if kernels is None:
        kernels = current()
    if not isinstance(kernels, Kernels):
        raise TypeError(f"kernels must be a xlagen.native.Kernels policy, got {type(kernels).__name__}")
    if kernels.bfloat16_tiles:
        kernels.use_bfloat16_tiles()
    token = _active.set(kernels)
    try:
        yield kernels
    finally:
        _active.reset(token)


@contextlib.contextmanager
def _marked(flag: contextvars.ContextVar) -> Iterator[None]:
    """Within this block `flag` is True (what is being traced is part of what it marks)."""
    token = flag.set(True)
    try:
        yield
    finally:
        flag.reset(token)


def decoding_step() -> contextlib.AbstractContextManager[None]:
    """Marks what is traced within as one step of a decoding loop (the body of its `tf.while_loop`)."""
    return _marked(_in_step)


def in_decoding_step() -> bool:
    """Whether the operation being traced is part of a decoding step (`decoding_step`)."""
    return _in_step.get()


def prefill() -> contextlib.AbstractContextManager[None]:
    """Marks what is traced within as a generation's prompt pass, before its decoding loop: inference, so
    products of few rows may take the float32 kernel (which has no gradient) as a decoding step's do."""
    return _marked(_in_prefill)


def in_prefill() -> bool:
    """Whether the operation being traced is part of a generation's prompt pass (`prefill`)."""
    return _in_prefill.get()


def under_xla() -> bool:
    """Whether the operation being traced is compiled by XLA (`jit_compile=True`); never when eager."""
    import tensorflow as tf
    from tensorflow.python.framework import ops as tf_ops
    from tensorflow.python.ops import control_flow_util

    return not tf.executing_eagerly() and control_flow_util.GraphOrParentsInXlaContext(tf_ops.get_default_graph())


def _ready() -> bool:
    from xlagen.native.library import ready

    return ready()


# The layers' questions, asked of the policy of the trace in progress.

def use_float32_kernel(x, kernel) -> bool:
    """`current().use_float32_product(x, kernel)`."""
    return current().use_float32_product(x, kernel)


def xla_single_threaded() -> bool:
    """Whether TensorFlow's intra-op pool, which XLA's CPU programs run their own operations (and dots) on,
    was given one thread with `tf.config.threading.set_intra_op_parallelism_threads(1)`: the process then
    leaves the cores to the kernels' own pool (`PoolSettings`, by default the CPUs this process may use, at
    most 8), and no idle XLA thread competes with the kernels' threads for them while a kernel runs. (A
    limit set otherwise, e.g. by a session config, reads as 0 here, and counts as not one thread.)"""
    import tensorflow as tf

    return tf.config.threading.get_intra_op_parallelism_threads() == 1


def use_attention_kernel(query, key, mask=None, bias=None, dropout: bool = False, key_transposed: bool = False) -> bool:
    """`current().use_attention(...)`."""
    return current().use_attention(query, key, mask, bias, dropout, key_transposed)


def use_step_attention(query, keys) -> bool:
    """`current().use_step_attention(query, keys)`."""
    return current().use_step_attention(query, keys)


def use_prompt_attention(query, key, mask, bias=None, dropout: bool = False, relative: bool = False) -> bool:
    """`current().use_prompt_attention(...)`."""
    return current().use_prompt_attention(query, key, mask, bias, dropout, relative)


def use_split_heads(x) -> bool:
    """`current().use_split_heads(x)`."""
    return current().use_split_heads(x)


def use_fresh_cache(heads, cache) -> bool:
    """`current().use_fresh_cache(heads, cache)`."""
    return current().use_fresh_cache(heads, cache)


def use_layer_norm(x, gamma, beta) -> bool:
    """`current().use_layer_norm(x, gamma, beta)`."""
    return current().use_layer_norm(x, gamma, beta)


def use_lookup(table, ids) -> bool:
    """`current().use_lookup(table, ids)`."""
    return current().use_lookup(table, ids)


def use_argmax(scores) -> bool:
    """`current().use_argmax(scores)`."""
    return current().use_argmax(scores)


def use_memory_attention(states, mask, head_dim: int) -> bool:
    """`current().use_memory_attention(states, mask, head_dim)`."""
    return current().use_memory_attention(states, mask, head_dim)
