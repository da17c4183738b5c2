"""Where Whisper-tiny's encoder spends its time: the whole encoder and its parts, each compiled alone.

    python benchmarks/whisper_encoder.py --batch-size 1

Random weights of Whisper-tiny's shapes (the bench's `whisper`), 30 s of random log-mel features per
row, TensorFlow on --threads threads, `tf.function(jit_compile=True)` for each part. The parts are
stand-ins of the encoder's work with its shapes, timed apart:

  encoder     `model.encode` (stem, 4 blocks, final norm), as xlagen runs it (the fused attention kernel,
              `xlagen.native.attention`, where the machine can run it)
  encoder, XLA's attention   the same with XLA's ops for the attention (the policy's
              `attention_min_keys` out of reach while tracing)
  stem        the two convolutions
  dense       the 4 blocks' products on [B * 1500, 384]: qkv, output, MLP in (with GELU) and out
  attention   4 x softmax(q k^T / 8) v over [B, 6, 1500, 64]
  fused attention   the same 4 attentions as the native kernel
  scores      4 x q k^T alone; softmax: 4 x softmax over [B, 6, 1500, 1500]; weighted: 4 x p v alone

Prints the median ms of --repeats calls of each and, for the products, GFLOP/s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)

    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    from xlagen import native
    from xlagen.modeling import TFWhisperForConditionalGeneration
    from xlagen.models.whisper import WhisperConfig

    config = WhisperConfig()
    model = TFWhisperForConditionalGeneration(config)
    batch, frames, hidden, heads = args.batch_size, config.input_frames // 2, config.hidden_size, config.encoder_heads
    head_dim = hidden // heads
    rng = np.random.default_rng(0)

    def constant(*shape, scale=1.0):
        return tf.constant((rng.standard_normal(shape) * scale).astype(np.float32))

    features = constant(batch, config.num_mel_bins, config.input_frames)
    rows = constant(batch * frames, hidden)
    ffn = config.encoder_ffn_dim
    kernels = [[constant(hidden, 3 * hidden, scale=0.05), constant(hidden, hidden, scale=0.05),
                constant(hidden, ffn, scale=0.05), constant(ffn, hidden, scale=0.05)]
               for _ in range(config.encoder_layers)]
    queries = constant(batch, heads, frames, head_dim)
    scores = constant(batch, heads, frames, frames)
    layers = config.encoder_layers

    def dense(x):
        for qkv, out, up, down in kernels:
            h = (x @ qkv)[:, :hidden] @ out
            x = x + 0.01 * (tf.nn.gelu(h @ up, approximate=False) @ down)
        return x

    def attention(q):
        for _ in range(layers):
            p = tf.nn.softmax(tf.matmul(q, q, transpose_b=True) * head_dim ** -0.5, axis=-1)
            q = q + 0.01 * tf.matmul(p, q)
        return q

    def fused_attention(q):
        for _ in range(layers):
            q = q + 0.01 * native.attention(q, q, q, head_dim ** -0.5)
        return q

    def xla_attention_encoder(f):
        with native.tracing(native.Kernels(attention_min_keys=sys.maxsize)):  # read while tracing
            return model.encode(f)

    def score_products(q):
        for _ in range(layers):
            q = q + 1e-6 * tf.reduce_sum(tf.matmul(q, q, transpose_b=True), axis=-1, keepdims=True)
        return q

    def softmax(s):
        for _ in range(layers):
            s = tf.nn.softmax(s, axis=-1)
        return s

    def weighted(q):
        for _ in range(layers):
            q = q + 0.01 * tf.matmul(scores, q)
        return q

    product_flops = batch * frames * sum(2 * k.shape[0] * k.shape[1] for block in kernels for k in block)
    attention_flops = layers * 2 * 2 * batch * heads * frames * frames * head_dim
    parts = [("encoder", lambda f: model.encode(f), features, None),
             ("encoder, XLA's attention", xla_attention_encoder, features, None),
             ("stem", lambda f: model.stem(f), features, None),
             ("dense", dense, rows, product_flops),
             ("attention", attention, queries, attention_flops),
             *([("fused attention", fused_attention, queries, attention_flops)]
               if native.unavailable_reason() is None else []),
             ("scores", score_products, queries, attention_flops / 2),
             ("softmax", softmax, scores, None),
             ("weighted", weighted, queries, attention_flops / 2)]
    print(f"Whisper-tiny encoder parts, batch {batch}, {args.threads} threads, median of {args.repeats} calls:")
    for name, function, argument, flops in parts:
        compiled = tf.function(function, jit_compile=True, autograph=False)
        compiled(argument).numpy()
        spent = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            compiled(argument).numpy()
            spent.append(time.perf_counter() - start)
        median = statistics.median(spent)
        rate = f", {flops / median / 1e9:.0f} GFLOP/s" if flops else ""
        print(f"  {name}: {median * 1e3:.1f} ms{rate}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
