"""Native kernels: the matrix products of a decoding step, called by XLA as custom calls (the C++ files of
this folder; `kernels.h` lists them).

A decoding step reads every weight once, so its time is the time to stream the weights from memory.
xlagen brings its own product for the few rows of a decoding step, in three forms:

- float32 weights as XLA stores them (`matmul_float32`): XLA's CPU dot streams a decoding step's
  weights more slowly than the cores can read them; this kernel streams long runs of weight rows
  (GPT-2-small greedy, batch 1: the whole step is 1.09-1.16x faster than with XLA's dot in
  `benchmarks/ab.py --compare kernel` runs). Used automatically for the products inside
  a compiled decoding loop with at most `FLOAT32_MAX_ROWS` rows, when the machine can run the kernel;
  elsewhere, and with `XLAGEN_FLOAT32_KERNEL=0`, XLA's own dot. Only the summation order differs.
- bfloat16 weights (`matmul`, `pack_bfloat16`): XLA's CPU dot does not read bfloat16 weights directly
  (it multiplies an upcast float32 copy, no faster than float32 weights: `benchmarks/low_precision.py`); this one
  reads weights stored as bfloat16 in a packed panel layout, widens them in registers and multiplies in
  float32. It computes exactly `x @ float32(W)` with half the bytes read.
- int8 weights with one float32 scale per output column (`matmul`, `pack_int8`): a quarter of float32's
  bytes, widened in registers and multiplied in float32; `x @ (Q * s)` up to float32 rounding.

And one fused attention (`attention`): `softmax(scale * q k^T) v` over every key, for long unmasked
float32 attention under XLA: Whisper's encoder (1500 positions), whose scores XLA writes out and reads
back twice, and its decoder's cross-attention over them, whose keys and values XLA's dots read at a third
of the memory's rate; the kernel keeps the scores in the core's cache and streams the keys and values
once (`use_attention_kernel` says where it runs). And a decoding step's masked self-attention over the
static cache (`step_attention`): one call per layer instead of XLA's two dots and softmax fusions, from 2
query rows (`use_step_attention`). And greedy decoding's choice of token (`argmax`), which XLA computes one
logit at a time.

The library is compiled with the system C++ compiler (`$CXX`, else `g++` / `c++`) on first use and
cached under `$XLAGEN_CACHE/native` (default `~/.cache/xlagen/native`), keyed by the source, in a folder
only this user may write, with its SHA-256 beside it; a cached build is loaded only if it is this user's,
not writable by others and matches that hash, else it is built again (`build.py` says how). It needs
Linux on x86-64 with AVX-512 (`avx512f`). Where it cannot be built, float32 decoding uses XLA's dot, with
one warning; packed weights raise `NativeUnavailable` with the reason. `XLAGEN_NATIVE_THREADS` sets its
thread count (default: the CPUs this process may use, at most 8). Programs that leave the process
(SavedModel export, `xlagen aot`) are traced under `portable()`, without the kernels.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import logging
import os
import platform
from pathlib import Path

import numpy as np

from xlagen.native import build
# Re-exported: NativeUnavailable and compile_library are public (benchmarks/kernel_variants.py), SOURCES too.
from xlagen.native.build import NO_COMPILER, SOURCES, NativeUnavailable, _compiler, compile_library  # noqa: F401

TARGET = "xlagen_bf16_matmul"
FLOAT32_TARGET = "xlagen_f32_matmul"
INT8_TARGET = "xlagen_int8_matmul"
ATTENTION_TARGET = "xlagen_f32_attention"
STEP_ATTENTION_TARGET = "xlagen_f32_step_attention"
ARGMAX_TARGET = "xlagen_f32_argmax"
MEMORY_ATTENTION_TARGET = "xlagen_f32_memory_attention"
# A decoding step's self-attention runs as one native call per layer (`step_attention`) from this many
# query rows (batch x beams): at 2 and 8 rows it made GPT-2-small's `generate` 1.035x and 1.074x faster, at
# one row 0.98-0.99x (the kernel's workers already read the next weights during XLA's attention ops there;
# `benchmarks/ab.py --compare step-attention`).
STEP_ATTENTION_MIN_ROWS = 2
WEIGHT_DTYPES = ("bfloat16", "int8")  # what `pack_tensor` packs
MAX_ROWS = 32  # outside loops, products with more rows (long prompts, encoders) unpack and use XLA's dot
# Rows up to which a float32 product in a decoding loop uses the kernel (batch x beams): 16 covers 2 beams
# over a batch of 8. At 16 rows the product is close to compute-bound; the kernel's streams still made the
# whole of `generate` 1.12-1.20x faster than XLA's dot there (GPT-2, OPT, T5, Whisper, beam 2 at batch 8;
# `benchmarks/ab.py --compare kernel --max-rows 16`). Above it XLA's dot.
FLOAT32_MAX_ROWS = 16
# Two limits that kept some decoding products on XLA's dot, both off by default since every product on
# the kernel measured faster or even in in-process A/B runs (T5-small greedy 1.26-1.35x, GPT-2-small,
# OPT-125m and Whisper-tiny 1.00-1.08x); `benchmarks/ab.py --compare rules` measures
# them again. Matrices of fewer bytes than this stay with XLA's dot:
FLOAT32_MIN_BYTES = 0
# and, when x has one row, matrices with more columns than this (LM heads), if not None:
FLOAT32_MAX_COLUMNS = None
# Unmasked float32 attention over at least this many keys runs as the fused kernel (`attention`) under
# XLA: Whisper's encoder and its decoder's cross-attention (1500 positions). Shorter attention stays
# with XLA's ops.
ATTENTION_MIN_KEYS = 256
ATTENTION_HEAD_DIMS = (16, 32, 64, 128)  # the head sizes the kernel has code for
# A generation's cross-attention reads the encoder output itself, the projections folded in
# (`memory_attention`), when the encoder output has at least this many bytes: the per-layer keys and values
# it replaces (twice as many bytes, per layer) no longer stay in the CPU's caches between steps. Whisper-tiny
# greedy, 128 tokens (`benchmarks/ab.py --compare fold`): batch 8 (18 MB) 1.059x, batch 4 (9 MB) 1.021x,
# batch 1 (2.3 MB) 0.96x.
MEMORY_ATTENTION_MIN_BYTES = 8 * 2**20

logger = logging.getLogger(__name__)
_portable = contextvars.ContextVar("xlagen_native_portable", default=False)
_float32_enabled = os.environ.get("XLAGEN_FLOAT32_KERNEL", "1") != "0"
_cache_dir = build.cache_folder
_build = build.build


def unavailable_reason() -> str | None:
    """Why the native kernels cannot run here, or None if they can (before trying to build them)."""
    return hardware_reason() or (NO_COMPILER if _compiler() is None else None)


def hardware_reason() -> str | None:
    """Why this machine itself cannot run the native kernels (its system, architecture or CPU: nothing that
    an install would change), or None if it can."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return (f"xlagen's native kernels need Linux on x86-64; this is {platform.system()} on "
                f"{platform.machine()}")
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        flags = []
    if "avx512f" not in flags:
        return "xlagen's native kernels need a CPU with AVX-512 (avx512f); this CPU does not report it"
    return None


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    """Builds (once) and opens the kernel library, without registering it with XLA.

    Raises:
        NativeUnavailable: the machine cannot run it (see `unavailable_reason`), the cache folder is unsafe
            (another user's) or not writable, or the build or the loading failed.
    """
    reason = hardware_reason()
    if reason:
        raise NativeUnavailable(reason)
    # `build.opened` verifies the cached build (owner, mode, SHA-256) and names its open descriptor, so the
    # bytes verified are the bytes loaded.
    with build.opened() as verified:
        try:
            return ctypes.CDLL(verified)
        except OSError as error:
            raise NativeUnavailable(f"loading xlagen's native kernels "
                                    f"({build.cache_folder() / build.library_name()}) failed: {error}") from error


@functools.lru_cache(maxsize=None)
def constant(name: str) -> int:
    """A constant of the kernels (`kernels.h`, e.g. "panel"), as the loaded library has it.

    Raises:
        NativeUnavailable: the kernels cannot run here.
        KeyError: the library has no constant of that name.
    """
    value = ctypes.c_long()
    function = _library().xlagen_constant
    function.argtypes, function.restype = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_long)], ctypes.c_int
    if not function(name.encode(), ctypes.byref(value)):
        raise KeyError(f"the native kernels have no constant {name!r}")
    return value.value


# The kernels' constants that Python code reads by these names (`native.PANEL`, ...), from the library.
_CONSTANTS = {"PANEL": "panel", "INT8_PANEL": "int8_panel",
              "STEP_ATTENTION_MAX_HEAD_DIM": "step_attention_max_head_dim"}


def __getattr__(name: str):
    if name in _CONSTANTS:
        return constant(_CONSTANTS[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.lru_cache(maxsize=None)
def load() -> ctypes.CDLL:
    """Builds (once) and loads the kernel library and registers its XLA custom-call targets.

    Raises:
        NativeUnavailable: the machine cannot run it (see `unavailable_reason`), the cache folder is unsafe
            (another user's) or not writable, or the build or the loading failed.
    """
    library = _library()
    import tensorflow as tf  # noqa: F401  (loads libtensorflow_cc, whose registry the kernel joins)

    library.xlagen_register.argtypes = [ctypes.c_char_p]
    code = library.xlagen_register(b"libtensorflow_cc.so.2")
    if code != 0:
        raise NativeUnavailable(f"registering xlagen's native kernels with XLA failed (code {code}): this "
                                "TensorFlow build does not export XLA's custom-call registry")
    return library


def status_supported() -> bool:
    """Whether a native custom call that is handed a configuration it cannot run fails with an XLA error (True),
    or ends the process (False: this TensorFlow's custom-call status differs from the one the kernels know).

    Raises:
        NativeUnavailable: the kernels cannot run here.
    """
    return bool(load().xlagen_status_supported())


def pack_bfloat16(kernel: np.ndarray) -> np.ndarray:
    """A float `[K, N]` kernel -> the kernel's packed bfloat16 words, int32 `[ceil(N / 32), K, 16]`.

    Each weight is rounded to the nearest bfloat16 (ties to even). Word `[p, k, j]` holds column `32p + j`
    in its low half and column `32p + 16 + j` in its high half; columns past N are zero.
    """
    import ml_dtypes

    k, n = kernel.shape
    panel = constant("panel")
    panels = -(-n // panel)
    padded = np.zeros((k, panels * panel), np.float32)
    padded[:, :n] = kernel
    bits = padded.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32).reshape(k, panels, panel)
    words = bits[:, :, :panel // 2] | (bits[:, :, panel // 2:] << 16)
    return np.ascontiguousarray(words.transpose(1, 0, 2)).view(np.int32)


def pack_int8(kernel: np.ndarray) -> np.ndarray:
    """A float `[K, N]` kernel -> int8 `[ceil(N / 64), K + 4, 64]`: each column quantized with its own scale.

    Column n's scale is s = max |W[:, n]| / 127 and its weights are round(W[k, n] / s) (ties to even), in
    -127..127, so the kernel multiplies by `Q * s` (`unpack`), whose error is at most s / 2 per weight.
    Panel p holds rows 0..K-1 of columns 64p..64p+63 (64 bytes per row), then those 64 columns' float32
    scales as 256 bytes (4 more rows); columns past N are zero, with scale zero.
    """
    k, n = kernel.shape
    kernel = np.asarray(kernel, np.float32)
    panel = constant("int8_panel")
    panels = -(-n // panel)
    peak = np.abs(kernel).max(axis=0) if k else np.zeros(n, np.float32)
    scales = np.zeros(panels * panel, np.float32)
    scales[:n] = peak / 127
    quantized = np.zeros((k, panels * panel), np.int8)
    safe = np.where(scales[:n] > 0, scales[:n], 1)
    quantized[:, :n] = np.clip(np.rint(kernel / safe), -127, 127).astype(np.int8)
    weights = quantized.reshape(k, panels, panel).transpose(1, 0, 2)
    scale_rows = scales.view(np.int8).reshape(panels, 4, panel)
    return np.ascontiguousarray(np.concatenate([weights, scale_rows], axis=1))


def pack_tensor(kernel, weight_dtype: str = "bfloat16"):
    """`pack_bfloat16` or `pack_int8` of a variable or tensor, as a TensorFlow constant (loads the kernel
    library first, so that a machine that cannot run it fails here, with the reason, rather than at compile
    time)."""
    import tensorflow as tf

    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"packed weights are one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
    load()
    pack = pack_bfloat16 if weight_dtype == "bfloat16" else pack_int8
    return tf.constant(pack(np.asarray(kernel.numpy() if hasattr(kernel, "numpy") else kernel, np.float32)))


def unpack(words, n: int):
    """Packed weights -> the float32 kernel `[K, n]` they multiply by (TensorFlow ops): bfloat16 words
    `[P, K, 16]` exactly; int8 panels `[P, K + 4, 64]` as `Q * s`."""
    import tensorflow as tf

    if words.dtype == tf.int8:
        k = words.shape[1] - 4
        quantized = tf.cast(words[:, :k, :], tf.float32)  # [P, K, 64]
        scales = tf.bitcast(tf.reshape(words[:, k:, :], (-1, constant("int8_panel"), 4)), tf.float32)  # [P, 64]
        kernel = tf.transpose(quantized * scales[:, None, :], (1, 0, 2))
        return tf.reshape(kernel, (k, -1))[:, :n]
    low = tf.bitcast(tf.bitwise.left_shift(words, 16), tf.float32)
    high = tf.bitcast(tf.bitwise.bitwise_and(words, tf.constant(-65536, tf.int32)), tf.float32)  # 0xFFFF0000
    panels = tf.concat([low, high], axis=-1)  # [P, K, 32]
    k = tf.shape(words)[1]
    return tf.reshape(tf.transpose(panels, (1, 0, 2)), (k, -1))[:, :n]


def _context() -> tuple[bool, bool]:
    """(inside an XLA compilation, inside a `tf.while_loop` body) for the op being traced."""
    import tensorflow as tf
    from tensorflow.python.framework import ops as tf_ops
    from tensorflow.python.ops import control_flow_util

    if tf.executing_eagerly():
        return False, False
    graph = tf_ops.get_default_graph()
    in_loop = False
    while graph is not None:
        in_loop = in_loop or type(graph).__name__ == "WhileBodyFuncGraph"
        graph = getattr(graph, "outer_graph", None)
    return control_flow_util.GraphOrParentsInXlaContext(tf_ops.get_default_graph()), in_loop


def matmul(x, words, n: int):
    """`x [..., K] @ W` for W packed by `pack_bfloat16` or `pack_int8` (N = n columns), in float32.

    Under XLA compilation this is the native kernel's custom call, inside a `tf.while_loop` (a decoding
    step) always and elsewhere for at most `MAX_ROWS` rows of x. Otherwise (long prompts, encoders, eager
    or non-XLA graphs) the weights are unpacked to float32 and multiplied by TensorFlow's matmul: faster
    once the product is compute-bound, but never inside a loop, where XLA would unpack every iteration
    (10x slower than the kernel at 16 rows). Both compute `x @ unpack(W)`.
    """
    import tensorflow as tf

    x = tf.convert_to_tensor(x)
    rows = x.shape[:-1].num_elements()
    if x.dtype != tf.float32:
        raise TypeError(f"packed weights multiply float32 activations; got {x.dtype.name}")
    xla, in_loop = _context()
    if rows is None or rows == 0 or not xla or (rows > MAX_ROWS and not in_loop):
        return tf.tensordot(x, unpack(words, n), 1)
    load()
    return _custom_call(INT8_TARGET if words.dtype == tf.int8 else TARGET, x, words, n)


def _custom_call(target: str, x, weights, n: int):
    """The custom call `target` on x `[..., K]` (rows flattened) and the weights -> float32 `[..., n]`."""
    import tensorflow as tf
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops

    k = x.shape[-1]
    leading = x.shape[:-1]
    rows = leading.num_elements()
    (y,) = gen_xla_ops.xla_custom_call_v2(
        operands=[tf.reshape(x, (rows, k)), weights], call_target_name=target, backend_config=f"{rows},{k},{n}",
        has_side_effect=False, result_dtypes=[tf.float32], result_shapes=[tf.TensorShape([rows, n])])
    return tf.reshape(y, [*leading, n])


@contextlib.contextmanager
def portable():
    """Within this block the float32 products trace as XLA's own dot, never as a native kernel: for
    programs that leave this process (SavedModel, tfcompile), which would not have the kernels.
    (Packed bfloat16 or int8 weights cannot be traced portably; exporting them is refused.)"""
    token = _portable.set(True)
    try:
        yield
    finally:
        _portable.reset(token)


def set_float32_kernel(enabled: bool) -> None:
    """Turns the float32 kernels (the products' and the fused attention's) on or off for programs traced
    from now on (default: on, unless the environment sets XLAGEN_FLOAT32_KERNEL=0). Programs already
    traced keep what they were traced with."""
    global _float32_enabled
    _float32_enabled = bool(enabled)


def set_lookahead(kib: int) -> None:
    """Sets how many KiB of the next product's float32 weights each idle kernel worker reads ahead while XLA
    runs the step's other operations (0 turns it off), for the calls from now on. The next product is the
    one that followed the last product the previous time (a decoding step repeats its products in order).
    The default is XLAGEN_NATIVE_LOOKAHEAD_KB, else 768.

    Raises:
        NativeUnavailable: the kernels cannot run here.
    """
    if kib < 0:
        raise ValueError(f"kib must be >= 0, got {kib}")
    library = load()
    library.xlagen_set_lookahead.argtypes = [ctypes.c_long]
    library.xlagen_set_lookahead(int(kib))


def lookahead_kib() -> int:
    """How many KiB of the next product each idle kernel worker reads ahead (see `set_lookahead`); 0 when
    the kernels run on one thread, which has no idle worker.

    Raises:
        NativeUnavailable: the kernels cannot run here.
    """
    library = load()
    library.xlagen_lookahead.restype = ctypes.c_long
    return int(library.xlagen_lookahead())


def lookahead_counts() -> dict[str, int]:
    """Counters of the float32 kernel's read-ahead since the process started: `calls` (float32 products),
    `predicted` (calls that were the product expected after the previous one) and `bytes_read_ahead` (by
    the idle workers).

    Raises:
        NativeUnavailable: the kernels cannot run here.
    """
    library = load()
    counts = (ctypes.c_long * 3)()
    library.xlagen_lookahead_counts.argtypes = [ctypes.c_void_p]
    library.xlagen_lookahead_counts(counts)
    return {"calls": counts[0], "predicted": counts[1], "bytes_read_ahead": counts[2]}


@functools.lru_cache(maxsize=None)
def _float32_kernel_ready() -> bool:
    """Whether the kernels load here; if not, XLA's dot is used, said once: at INFO level on a system or CPU
    that cannot run them, as a warning when they could run but cannot be built or loaded."""
    reason = hardware_reason()
    if reason:
        logger.info("float32 decoding uses XLA's dot: %s", reason)
        return False
    try:
        load()
    except NativeUnavailable as error:
        logger.warning("float32 decoding uses XLA's dot: %s", error)
        return False
    return True


def use_float32_kernel(x, kernel) -> bool:
    """Whether `x @ kernel` (both float32, x with static leading dimensions) being traced now should be
    `matmul_float32`: inside a `tf.while_loop` compiled by XLA (a decoding step), at most
    `FLOAT32_MAX_ROWS` rows, a kernel of at least `FLOAT32_MIN_BYTES` and, for one row, at most
    `FLOAT32_MAX_COLUMNS` columns (if set), the kernel enabled (`set_float32_kernel`), not `portable()`, and
    loadable."""
    import tensorflow as tf

    if not _float32_enabled or _portable.get() or x.dtype != tf.float32 or kernel.dtype != tf.float32:
        return False
    rows = x.shape[:-1].num_elements()
    if rows is None or not 0 < rows <= FLOAT32_MAX_ROWS or len(kernel.shape) != 2:
        return False
    if kernel.shape[0] * kernel.shape[1] * 4 < FLOAT32_MIN_BYTES:
        return False
    if rows == 1 and FLOAT32_MAX_COLUMNS is not None and kernel.shape[1] > FLOAT32_MAX_COLUMNS:
        return False
    xla, in_loop = _context()
    return xla and in_loop and _float32_kernel_ready()


def matmul_float32(x, kernel):
    """`x [..., K] @ kernel [K, N]`, float32, as the native kernel's custom call (call it under XLA only;
    see `use_float32_kernel`). Computes the same sums as XLA's dot in another order.

    Raises:
        TypeError: x or the kernel is not float32 (the kernel would read their bytes as float32).
    """
    import tensorflow as tf

    x, kernel = tf.convert_to_tensor(x), tf.convert_to_tensor(kernel)
    if x.dtype != tf.float32 or kernel.dtype != tf.float32:
        raise TypeError(f"the float32 kernel multiplies float32 by float32; got {x.dtype.name} @ {kernel.dtype.name}")
    load()
    return _custom_call(FLOAT32_TARGET, x, kernel, kernel.shape[-1])


def _static_float32(rank: int, *tensors) -> bool:
    """Whether the float32 kernels may take `tensors` at all: the kernels enabled (`set_float32_kernel`), not
    `portable()`, and every tensor float32 with `rank` axes of static sizes (what `use_attention_kernel`,
    `use_step_attention` and `use_argmax` all ask first)."""
    import tensorflow as tf

    if not _float32_enabled or _portable.get():
        return False
    return all(t.dtype == tf.float32 and t.shape.rank == rank and t.shape.is_fully_defined() for t in tensors)


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


def use_attention_kernel(query, key, mask=None, bias=None, dropout: bool = False,
                         key_transposed: bool = False) -> bool:
    """Whether `softmax(scale * query @ key^T) @ value` being traced now should be `attention`: float32
    `[B, H, T, D]` queries and `[B, H, S, D]` keys (`[B, H, D, S]` if `key_transposed`) of static shapes,
    S >= `ATTENTION_MIN_KEYS`, D in `ATTENTION_HEAD_DIMS`, no score bias, a mask that is None or a
    constant all True, no dropout, under XLA (in or out of a loop), the float32 kernels enabled
    (`set_float32_kernel`), not `portable()`, and loadable."""
    import tensorflow as tf

    if bias is not None or dropout or not _static_float32(4, query, key):
        return False
    keys, key_dim = (key.shape[3], key.shape[2]) if key_transposed else (key.shape[2], key.shape[3])
    if keys < ATTENTION_MIN_KEYS or query.shape[3] not in ATTENTION_HEAD_DIMS or key_dim != query.shape[3]:
        return False
    if mask is not None:
        constant = tf.get_static_value(mask)
        if constant is None or not np.all(constant):
            return False
    xla, _ = _context()
    return xla and _float32_kernel_ready()


def _reference_attention(query, key, value, scale: float, key_transposed: bool = False):
    import tensorflow as tf

    weights = tf.nn.softmax(tf.matmul(query, key, transpose_b=not key_transposed) * scale, axis=-1)
    return tf.matmul(weights, value)


def attention(query, key, value, scale: float, key_transposed: bool = False):
    """`softmax(scale * query @ key^T) @ value` for float32 `[B, H, T, D]` queries and `[B, H, S, D]`
    keys and values, as the native kernel's custom call (call it under XLA only; see
    `use_attention_kernel`). With `key_transposed` the keys are `[B, H, D, S]` (a decoder's
    cross-attention memory, `CrossAttention.project_memory`) and are read in place. The scores of 8 query
    rows at a time stay in the core's cache instead of being written out `[T, S]` and read back twice
    (Whisper-tiny's encoder, 1500 positions: about 2x XLA's attention; its decoding steps' cross-attention:
    `benchmarks/ab.py --compare cross-attention`). Gradients are those of the same formula in TensorFlow ops."""
    import tensorflow as tf
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops

    load()
    batch, heads, length, head_dim = query.shape
    keys = key.shape[3] if key_transposed else key.shape[2]
    config = f"{batch * heads},{length},{keys},{head_dim},{float(np.float32(scale))!r},{int(key_transposed)}"

    def call(query, key, value):
        (out,) = gen_xla_ops.xla_custom_call_v2(
            operands=[tf.reshape(t, (batch * heads, -1, t.shape[-1])) for t in (query, key, value)],
            call_target_name=ATTENTION_TARGET, backend_config=config, has_side_effect=False,
            result_dtypes=[tf.float32], result_shapes=[tf.TensorShape([batch * heads, length, head_dim])])
        return tf.reshape(out, (batch, heads, length, head_dim))

    return _with_reference_gradient(call, lambda *inputs: _reference_attention(*inputs, scale, key_transposed),
                                    query, key, value)


def use_step_attention(query, keys) -> bool:
    """Whether a decoding step's self-attention being traced now (`xlagen.layers.attention.Attention._step`)
    should be `step_attention`: float32 `[G, H, K, D]` queries and `[G, H, S', D]` cache keys of static
    shapes, at least `STEP_ATTENTION_MIN_ROWS` queries (G x K), D at most `STEP_ATTENTION_MAX_HEAD_DIM`,
    inside a `tf.while_loop` compiled by XLA, the float32 kernels enabled (`set_float32_kernel`), not
    `portable()`, and loadable."""
    if not _static_float32(4, query, keys) or keys.shape[3] != query.shape[3]:
        return False
    if query.shape[0] * query.shape[2] < STEP_ATTENTION_MIN_ROWS:
        return False
    xla, in_loop = _context()
    return (xla and in_loop and _float32_kernel_ready()
            and query.shape[3] <= constant("step_attention_max_head_dim"))


def step_attention(query, keys, values, key, value, bias, scale: float, mask_value: float):
    """One decoding step's self-attention as the native kernel's custom call (call it under XLA only; see
    `use_step_attention`): for each of the K queries `[G, H, K, D]`, softmax over the cache's keys
    `[G, H, S', D]` and the step's own new key (`key`, `[G, H, K, D]`, query k's), of `scale * q . k +
    bias`, then the weighted sum of `values` and `value`. `bias` `[G, 1 or H, K, S' + 1]` (float32; the new
    key last) is -inf where a query may not see a key; such a score is `mask_value` (as
    `xlagen.layers.attention` masks, with its `MASK_VALUE`). Returns `[G, H, K, D]`.

    The same sums as the two products and the softmax in TensorFlow ops, in one call per layer instead of
    several XLA operations (two dots and the softmax's fusions), reading the cache in place."""
    import tensorflow as tf
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops

    load()
    groups, heads, queries, head_dim = query.shape
    length = keys.shape[2]
    most = constant("step_attention_max_head_dim")
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


def use_argmax(scores) -> bool:
    """Whether an argmax over the last axis of `scores` being traced now should be `argmax`: float32 `[R, N]`
    of static shape, under XLA (in or out of a loop), the float32 kernels enabled (`set_float32_kernel`),
    not `portable()`, and loadable."""
    if not _static_float32(2, scores) or scores.shape[1] == 0:
        return False
    xla, _ = _context()
    return xla and _float32_kernel_ready()


def argmax(scores):
    """The index (int32) of each row's largest value of float32 `scores` `[R, N]`, the first on ties, as the
    native kernel's custom call (call it under XLA only; see `use_argmax`). The same result as
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


def use_memory_attention(states, mask, head_dim: int) -> bool:
    """Whether a generation's cross-attention over the encoder output `states` `[G, L, E]` (being traced now,
    `xlagen.models.base.encoder_context`) should run as `memory_attention`, the key and value projections
    folded in: float32 of static shape and at least `MEMORY_ATTENTION_MIN_BYTES`, L >= `ATTENTION_MIN_KEYS`,
    E a multiple of 64, D in `ATTENTION_HEAD_DIMS`, no mask (every encoder position real), under XLA (in or
    out of a loop), the float32 kernels enabled (`set_float32_kernel`), not `portable()`, and loadable."""
    if mask is not None or not _static_float32(3, states):
        return False
    if states.shape[1] < ATTENTION_MIN_KEYS or states.shape[2] % 64 or head_dim not in ATTENTION_HEAD_DIMS:
        return False
    if 4 * states.shape.num_elements() < MEMORY_ATTENTION_MIN_BYTES:
        return False
    xla, _ = _context()
    return xla and _float32_kernel_ready()


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

    As the native kernel's custom call (call it under XLA only; see `use_memory_attention`), which folds
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
