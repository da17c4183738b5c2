"""How XLA's CPU backend runs the matrix products of a decoding step, written in different forms.

Each case is one XLA program: a `tf.while_loop` of `--steps` steps whose body does the products of
one decoding step with `rows` rows (1 = greedy batch 1, 2 = two beams, 8 = a batch of 8). All
variants of a case are compiled first and then timed interleaved, `--repeats` rounds, median ms per
step, in one process (so the machine's drifting bandwidth hits every variant alike).

* `head`: the LM head, `x [rows, hidden] -> logits [rows, V]`, for GPT-2 (768 x 50257) and
  Whisper-tiny (384 x 51865) sizes, with the tied matrix stored as the checkpoint stores it
  (`[V, hidden]`, `x @ E^T`) or as xlagen stores it since (`[hidden, V]`, `x @ K`).
* `bias`: GPT-2-small's 12 layers of batch-1 products (qkv, output, MLP in and out), without and with
  a bias add after each product (XLA fuses the add into the product; the fused form runs on one
  thread, the plain product on the thread pool).

    python benchmarks/dot_forms.py
    python benchmarks/dot_forms.py --threads 1   # the fused form runs as fast as with 2 threads
"""

from __future__ import annotations

import argparse
import statistics
import time

HEADS = {"gpt2": (768, 50257), "whisper-tiny": (384, 51865)}
LAYER_SHAPES = ((768, 2304), (768, 768), (768, 3072), (3072, 768))


def _loop(tf, steps: int, step):
    @tf.function(jit_compile=True)
    def program(x):
        return tf.while_loop(lambda i, x: i < steps, lambda i, x: (i + 1, step(x)), (0, x))[1]

    return program


def head_variants(tf, hidden: int, vocab: int, steps: int):
    """The LM head with the matrix in the checkpoint's layout and in xlagen's."""
    matrix = tf.Variable(tf.random.normal([vocab, hidden], seed=0) * 0.02)  # [V, hidden]
    kernel = tf.Variable(tf.transpose(matrix))  # [hidden, V]

    def tied(x):
        return x + 1e-6 * tf.matmul(x, matrix, transpose_b=True)[:, :hidden]

    def kernel_layout(x):
        return x + 1e-6 * tf.matmul(x, kernel)[:, :hidden]

    return {"[V, hidden], x @ E^T": _loop(tf, steps, tied), "[hidden, V], x @ K": _loop(tf, steps, kernel_layout)}


def bias_variants(tf, steps: int):
    """12 GPT-2-small layers of batch-1 products, without and with a bias add after each."""
    layers = [[(tf.Variable(tf.random.normal(shape, seed=i) * 0.02), tf.Variable(tf.zeros(shape[1])))
               for shape in LAYER_SHAPES] for i in range(12)]

    def step(with_bias: bool):
        def run(x):
            for (qkv, qkv_b), (out, out_b), (up, up_b), (down, down_b) in layers:
                def product(h, w, b):
                    y = tf.matmul(h, w)
                    return y + b if with_bias else y

                h = product(x, qkv, qkv_b)[:, :768]
                h = product(h, out, out_b)
                h = tf.nn.relu(product(h, up, up_b))
                x = x + 1e-3 * product(h, down, down_b)
            return x

        return run

    return {"x @ W": _loop(tf, steps, step(False)), "x @ W + b": _loop(tf, steps, step(True))}


def timed(tf, variants: dict, x, steps: int, repeats: int) -> dict[str, float]:
    """Median ms per step of each variant, compiled first, then timed round-robin."""
    for program in variants.values():
        program(x).numpy()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, program in variants.items():
            started = time.perf_counter()
            program(x).numpy()
            times[name].append((time.perf_counter() - started) / steps * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    print("| case | rows | variant | ms/step |\n|---|---|---|---|")
    for model, (hidden, vocab) in HEADS.items():
        variants = head_variants(tf, hidden, vocab, args.steps)
        for rows in (1, 2, 8):
            results = timed(tf, variants, tf.random.normal([rows, hidden], seed=1), args.steps, args.repeats)
            for name, ms in results.items():
                print(f"| {model} head | {rows} | {name} | {ms:.2f} |", flush=True)
    results = timed(tf, bias_variants(tf, args.steps), tf.random.normal([1, 768], seed=1), args.steps, args.repeats)
    for name, ms in results.items():
        print(f"| 12 layers, {args.threads} thread(s) | 1 | {name} | {ms:.2f} |", flush=True)


if __name__ == "__main__":
    main()
