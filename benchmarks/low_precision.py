"""Can XLA on this CPU read lower-precision weights faster? A GPT-2-small-shaped decode step, five ways.

One XLA program with a `tf.while_loop` whose body does, per step, 12 layers of batch-1 MLP-sized
matrix-vector products (768 x 3072 and 3072 x 768) plus the 768 x 50257 LM head: the weight reads of a
GPT-2-small decode step (95 M weights). Each variant stores the weights differently:

* `float32`: `x @ W` with float32 weights (XLA's own dot);
* `bfloat16`: bfloat16 weights and activations, `x @ W` in bfloat16;
* `int8-upcast`: int8 weights with a per-column scale, `x @ float(W) * s`;
* `int8-dot`: int8 weights and dynamically quantised int8 activations, an s8 x s8 -> s32 dot
  (`BatchMatMulV3` with `Tout=int32`);
* `int8-reduce`: int8 weights stored `[out, in]`, the product written as an elementwise multiply and
  a row reduction (a form XLA can fuse with the int8 -> float conversion);
* `bfloat16-native`: bfloat16 weights in xlagen's packed layout, multiplied by xlagen's native kernel
  (`xlagen.native`, an XLA custom call) in float32: what `weight_dtype="bfloat16"` runs;
* `int8-native`: int8 weights with a per-column scale in xlagen's packed layout, the same kind of
  kernel: what `weight_dtype="int8"` runs;
* `float32-native`: float32 weights through xlagen's float32 kernel (what float32 decoding runs).

Run it twice to compare XLA's default CPU dot emitter with its oneDNN custom calls:

    python benchmarks/low_precision.py
    XLA_FLAGS=--xla_cpu_experimental_onednn_custom_call=true python benchmarks/low_precision.py

Each variant runs in its own process (the flag is read once per process); the table gives the median
ms per step over `--repeats` timed runs of `--steps` steps and the weight bytes read per ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("float32", "bfloat16", "int8-upcast", "int8-dot", "int8-reduce", "bfloat16-native", "int8-native",
            "float32-native")
LAYERS, WIDTH, INNER, VOCAB = 12, 768, 3072, 50257


def _weights(variant: str, shape, tf):
    w = tf.random.normal(shape, seed=0) * 0.02
    if variant in ("float32", "bfloat16"):
        return tf.Variable(tf.cast(w, variant)), None
    if variant == "float32-native":
        return tf.Variable(w), None
    if variant in ("bfloat16-native", "int8-native"):
        from xlagen import native

        return native.pack_tensor(w, variant.split("-")[0]), shape[1]
    if variant == "int8-reduce":
        w = tf.transpose(w)  # [out, in]
        scale = tf.reduce_max(tf.abs(w), axis=1) / 127.0
        return tf.Variable(tf.cast(tf.round(w / scale[:, None]), tf.int8)), tf.Variable(scale)
    scale = tf.reduce_max(tf.abs(w), axis=0) / 127.0
    return tf.Variable(tf.cast(tf.round(w / scale), tf.int8)), tf.Variable(scale)


def _product(variant: str, x, weights, tf):
    """x `[1, in]` times the stored weights -> float32 `[1, out]`."""
    w, scale = weights
    if variant in ("float32", "bfloat16"):
        return tf.cast(tf.matmul(tf.cast(x, w.dtype), w), tf.float32)
    if variant == "float32-native":
        from xlagen import native

        return native.matmul_float32(x, w)
    if variant in ("bfloat16-native", "int8-native"):
        from xlagen import native

        return native.matmul(x, w, scale)  # `scale` holds the column count here
    if variant == "int8-upcast":
        return tf.matmul(x, tf.cast(w, tf.float32)) * scale
    if variant == "int8-dot":
        x_scale = tf.reduce_max(tf.abs(x)) / 127.0 + 1e-12
        xq = tf.cast(tf.round(x / x_scale), tf.int8)
        y = tf.raw_ops.BatchMatMulV3(x=xq[None], y=w[None], Tout=tf.int32)[0]
        return tf.cast(y, tf.float32) * scale * x_scale
    return tf.reduce_sum(tf.cast(w, tf.float32) * x, axis=1)[None, :] * scale  # int8-reduce


def run_variant(variant: str, steps: int, repeats: int) -> dict:
    import numpy as np
    import tensorflow as tf

    up = [_weights(variant, [WIDTH, INNER], tf) for _ in range(LAYERS)]
    down = [_weights(variant, [INNER, WIDTH], tf) for _ in range(LAYERS)]
    head = _weights(variant, [WIDTH, VOCAB], tf)

    @tf.function(jit_compile=True)
    def decode(x, n):
        def body(i, x):
            h = x
            for a, b in zip(up, down):
                h = h + _product(variant, tf.nn.relu(_product(variant, h, a, tf)), b, tf) * 0.1
            return i + 1, x + tf.reduce_mean(_product(variant, h, head, tf)) * 1e-6
        return tf.while_loop(lambda i, x: i < n, body, (0, x))[1]

    x = tf.ones([1, WIDTH])
    decode(x, tf.constant(2)).numpy()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        decode(x, tf.constant(steps)).numpy()
        times.append((time.perf_counter() - started) / steps * 1000.0)
    variables = [v for pair in (*up, *down, head) for v in pair if v is not None and not isinstance(v, int)]
    weight_bytes = sum(int(np.prod(v.shape)) * v.dtype.size for v in variables)
    median = statistics.median(times)
    return {"variant": variant, "ms_per_step": round(median, 2), "weight_mb": round(weight_bytes / 1e6, 1),
            "gb_per_s": round(weight_bytes / median / 1e6, 1), "xla_flags": os.environ.get("XLA_FLAGS", "")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)  # worker mode
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_variant(args.one, args.steps, args.repeats)))
        return 0
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    print("| variant | weights MB | ms/step | weight GB/s | XLA_FLAGS |\n|---|---|---|---|---|")
    for variant in args.variants:
        # int8-dot is ~15x slower: fewer steps keep the run short.
        steps = max(3, args.steps // 10) if variant in ("int8-dot", "int8-reduce") else args.steps
        out = subprocess.run([sys.executable, __file__, "--one", variant, "--steps", str(steps), "--repeats",
                              str(args.repeats)], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {r['variant']} | {r['weight_mb']} | {r['ms_per_step']} | {r['gb_per_s']} | {r['xla_flags']} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
