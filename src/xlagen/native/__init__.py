"""Native kernels: the matrix products of a decoding step, called by XLA as custom calls (the C++ files of
this folder; `kernels.h` lists them).

A decoding step reads every weight once, so its time is the time to stream the weights from memory.
xlagen brings its own product for the few rows of a decoding step, in three forms:

- float32 weights as XLA stores them (`matmul_float32`): XLA's CPU dot streams a decoding step's
  weights more slowly than the cores can read them; this kernel streams long runs of weight rows
  (GPT-2-small greedy, batch 1: the whole step is 1.09-1.16x faster than with XLA's dot in
  `benchmarks/ab.py --compare kernel` runs). Used for the products of
  a compiled decoding step with at most `Kernels.float32_max_rows` rows, when the machine can run the
  kernel; elsewhere, and with `Kernels(float32=False)`, XLA's own dot. Only the summation order differs.
- bfloat16 weights (`matmul`, `pack_bfloat16`): XLA's CPU dot does not read bfloat16 weights directly
  (it multiplies an upcast float32 copy, no faster than float32 weights: `benchmarks/low_precision.py`); this one
  reads weights stored as bfloat16 in a packed panel layout, widens them in registers and multiplies in
  float32. It computes exactly `x @ float32(W)` with half the bytes read.
- int8 weights with one float32 scale per output column (`matmul`, `pack_int8`): a quarter of float32's
  bytes, widened in registers and multiplied in float32; `x @ (Q * s)` up to float32 rounding. From
  `Kernels.int8_integer_min_rows` rows (batch decoding, prompts, encoders) the activations are quantized
  to int8 per row as well and multiplied in integers (int32 sums), about half the instructions; from
  `Kernels.int8_many_integer_min_rows` rows (prompts, encoders) to 7 bits with a zero point, which AVX2
  multiplies in three quarters of the 8-bit product's instructions.
- On a CPU with AMX (`amx_int8`, `amx_bf16`: the "avx512amx" build), the 7-bit product runs on tile
  registers with the same int32 sums, and bfloat16 weights' products of many rows (prompts, encoders) take
  x rounded to bfloat16 on the bfloat16 tiles (`Kernels.bfloat16_tiles`); `amx_tiles()` says whether this
  process has them.

And one fused attention (`attention`): `softmax(scale * q k^T) v` over every key, for long unmasked
float32 attention under XLA: Whisper's encoder (1500 positions), whose scores XLA writes out and reads
back twice, and its decoder's cross-attention over them, whose keys and values XLA's dots read at a third
of the memory's rate; the kernel keeps the scores in the core's cache and streams the keys and values
once (`Kernels.use_attention` says where it runs). And a decoding step's masked self-attention over the
static cache (`step_attention`): one call per layer instead of XLA's two dots and softmax fusions, from 2
query rows (`Kernels.step_attention_min_rows`). And a prompt's causal self-attention (`masked_attention`),
which scores only the keys a block of queries may see, about half of XLA's work under a causal mask
(`Kernels.prompt_attention_min_tokens`). And greedy decoding's choice of token (`argmax`), which XLA computes one
logit at a time.

The library is compiled with the system C++ compiler (`$CXX`, else `g++` / `c++`) on first use and
cached under `$XLAGEN_CACHE/native` (default `~/.cache/xlagen/native`), keyed by the instruction set and
the source, in a folder only this user may write, with its SHA-256 beside it; a cached build is loaded only
if it is this user's, not writable by others and matches that hash, else it is built again (`build.py`
says how). It needs
Linux on x86-64 with AVX-512 (`avx512f`) or AVX2 and FMA (`avx2`, `fma`): the kernels are written once
against a small vector layer (`simd.h`) and built for the instruction set the CPU has, AVX-512 first
(`library.isa()`), each with its own tile sizes. Where it cannot be built, float32 decoding uses XLA's dot,
with one warning; packed weights raise `NativeUnavailable` with the reason.

Where the kernels run is one value, a `Kernels` policy (`policy.py`, which also lists the environment
variables): programs are traced under one (`tracing`; `generate(kernels=...)`, `CompiledGenerator(kernels=...)`),
and programs that leave the process (SavedModel export, `xlagen aot`) under `Kernels.OFF`, without them.

The modules: `build` (compile and cache the library), `library` (load it, its constants and thread pool),
`packing` (weight layouts), `ops` (the custom calls and their reference formulas), `policy` (when).
"""

from xlagen.native.build import NO_COMPILER, SOURCES, NativeUnavailable, compile_library
from xlagen.native.library import (amx_tiles, configure_pool, constant, hardware_reason, load, lookahead_counts,
                                   lookahead_kib, pool_counts, ready, set_lookahead, status_supported,
                                   unavailable_reason)
from xlagen.native.ops import (ARGMAX_TARGET, ATTENTION_TARGET, BF16_TILE_TARGET, BIASED_ATTENTION_TARGET,
                               FLOAT32_TARGET, GEMM_TARGETS, INT8_INTEGER_TARGET, INT8_MANY_INTEGER_TARGET,
                               INT8_TARGET, LAYER_NORM_TARGET, LOOKUP_TARGET, MASKED_ATTENTION_TARGET, MEMORY_ATTENTION_TARGET,
                               RELATIVE_ATTENTION_TARGET, RMS_NORM_TARGET, SPLIT_HEADS_TARGET, STEP_ATTENTION_TARGET,
                               TARGET, Heads, argmax, attention, layer_norm, lookup_columns, masked_attention, matmul,
                               matmul_float32, memory_attention, projection, reference_memory_attention,
                               relative_to_dense, rms_norm, split_heads, step_attention)
from xlagen.native.packing import WEIGHT_DTYPES, pack_bfloat16, pack_int8, pack_tensor, unpack
from xlagen.native.policy import (ATTENTION_HEAD_DIMS, Kernels, PoolSettings, current, decoding_step, prefill,
                                  tracing, use_argmax, use_attention_kernel, use_float32_kernel, use_fresh_cache,
                                  use_layer_norm, use_lookup,
                                  use_memory_attention, use_prompt_attention, use_split_heads, use_step_attention)

# The kernels' constants that Python code reads by these names (`native.PANEL`, ...), from the library.
_CONSTANTS = {"PANEL": "panel", "INT8_PANEL": "int8_panel",
              "STEP_ATTENTION_MAX_HEAD_DIM": "step_attention_max_head_dim"}


def __getattr__(name: str):
    if name in _CONSTANTS:
        return constant(_CONSTANTS[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ARGMAX_TARGET", "ATTENTION_HEAD_DIMS", "ATTENTION_TARGET", "BF16_TILE_TARGET", "BIASED_ATTENTION_TARGET",
           "FLOAT32_TARGET", "GEMM_TARGETS", "Heads", "INT8_INTEGER_TARGET", "INT8_MANY_INTEGER_TARGET",
           "INT8_TARGET", "Kernels", "LAYER_NORM_TARGET", "LOOKUP_TARGET", "MASKED_ATTENTION_TARGET", "MEMORY_ATTENTION_TARGET",
           "NO_COMPILER", "NativeUnavailable", "PoolSettings", "RELATIVE_ATTENTION_TARGET", "RMS_NORM_TARGET", "SOURCES", "SPLIT_HEADS_TARGET",
           "STEP_ATTENTION_TARGET", "TARGET", "WEIGHT_DTYPES", "amx_tiles", "argmax", "attention", "compile_library",
           "configure_pool", "constant", "current", "decoding_step", "hardware_reason", "load", "lookahead_counts",
           "layer_norm", "lookahead_kib", "lookup_columns", "masked_attention", "matmul", "matmul_float32", "memory_attention",
           "pack_bfloat16", "pack_int8", "pack_tensor", "pool_counts", "prefill", "projection", "ready",
           "reference_memory_attention", "relative_to_dense", "rms_norm", "set_lookahead", "split_heads", "status_supported", "step_attention",
           "tracing", "unavailable_reason", "unpack", "use_argmax", "use_attention_kernel", "use_float32_kernel",
           "use_fresh_cache", "use_layer_norm", "use_lookup", "use_memory_attention", "use_prompt_attention",
           "use_split_heads",
           "use_step_attention"]
