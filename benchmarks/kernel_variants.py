"""xlagen's kernels alone, two or more builds of the kernel sources side by side in one process.

    mkdir -p old && git archive HEAD~1 src/xlagen/native | tar -x --strip-components=3 -C old
    python benchmarks/kernel_variants.py --model gpt2 --rows 1 2 8 --sources old/native src/xlagen/native

Each source folder (its *.cc and *.h, as in src/xlagen/native) is compiled with xlagen's own flags and
loaded with ctypes (TensorFlow is not involved), and the plain entry point of `--weights` (float32:
`xlagen_f32_product` on XLA's [K, N] layout; bfloat16 and int8: `xlagen_bf16_product` /
`xlagen_int8_product` on `xlagen.native`'s packed layouts; see kernels.h) is called. One "step" is every
product of the model's decoding step for one turn of `generate`'s loop: each layer's projections, with
weights of their own (so they come from memory, as in a real step, not from the cache), then the LM head,
on `--rows` rows of x. The builds take turns, `--repeats` steps each per round, so that a shared machine's
bandwidth, which moves from minute to minute, is shared alike. Every build's output is checked against
numpy first. Prints, per row count, each build's median ms per step, the weights' GB/s, its GFLOP/s, and
the first build's time over each other's (above 1: that build is faster). A source may also be a library
already built (a `.so` file, e.g. the one xlagen loaded), which is then loaded as it is.

numpy's BLAS on the same products is printed too (`--blas`), timed after the builds, as a yardstick;
XLA's own dot is another program (see `ab.py --compare kernel` for the kernel against it inside `generate`).

`--weights int8-integer` is the int8 x int8 product (`xlagen_int8_integer_product`: activations quantized
to int8 per row) on the same packed int8 weights, `int8-many-integer` the many-row one (7-bit activations
with a zero point); their output is checked against numpy within the rounding of the activations. `--weights` takes one value, or one per source, of one packed layout, so that the two
int8 products of one source can be compared:

    python benchmarks/kernel_variants.py --model gpt2 --rows 4 8 512 --weights int8 int8-integer \
        --sources src/xlagen/native src/xlagen/native

`--gap-us G` spins the calling thread for G microseconds after each product, as XLA's other operations of
a decoding step do (GPT-2-small greedy: about 2.3 ms in 49 gaps); the GB/s are then those of the step
without its gaps. `--lookahead KIB [KIB ...]` sets each build's read-ahead (`xlagen_set_lookahead`; one
value for all builds, or one per source), so that one source can be compared with itself:

    python benchmarks/kernel_variants.py --model t5 --rows 1 --gap-us 30 --lookahead 0 768 \
        --sources src/xlagen/native src/xlagen/native
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# (layers, [K, N] of each layer's decoding products, [K, N] of the head); decoders of the bench's shapes,
# as xlagen's layers multiply them: self-attention's fused q/k/v and its output; for T5-small and
# Whisper-tiny also cross-attention's query and output (its keys and values are computed once per call);
# the feed-forward pair.
MODELS = {
    "gpt2": (12, [(768, 2304), (768, 768), (768, 3072), (3072, 768)], (768, 50257)),
    "opt": (12, [(768, 2304), (768, 768), (768, 3072), (3072, 768)], (768, 50272)),
    "t5": (6, [(512, 1536)] + [(512, 512)] * 3 + [(512, 2048), (2048, 512)], (512, 32128)),
    "whisper": (4, [(384, 1152)] + [(384, 384)] * 3 + [(384, 1536), (1536, 384)], (384, 51865)),
    # ragged shapes for the test suite: a narrow last block, a product split over K, a 3-row tail
    "tiny": (2, [(64, 96), (200, 40)], (64, 300)),
}


ENTRY_POINTS = {"float32": "xlagen_f32_product", "bfloat16": "xlagen_bf16_product", "int8": "xlagen_int8_product",
                "int8-integer": "xlagen_int8_integer_product", "int8-many-integer": "xlagen_int8_many_integer_product"}
LAYOUTS = {"int8-integer": "int8", "int8-many-integer": "int8"}  # entry points that read another's packed weights
STEPS = {"int8-integer": 127 * 2, "int8-many-integer": 126}  # the activations' rounding: half a step of a row


def _spin(seconds: float) -> None:
    """Keeps the calling thread busy for `seconds`, as XLA's operations between two products do."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def stored(w: np.ndarray, weights: str) -> tuple[np.ndarray, np.ndarray]:
    """(what the kernel reads, the float32 weights it multiplies by): the reference is computed here, not by
    xlagen's unpacking."""
    from xlagen import native

    if weights == "float32":
        return w, w
    if weights == "bfloat16":
        import ml_dtypes

        return native.pack_bfloat16(w), w.astype(ml_dtypes.bfloat16).astype(np.float32)
    scale = np.abs(w).max(axis=0) / 127
    return native.pack_int8(w), np.rint(w / scale) * scale


def build(source: Path, folder: Path, built: dict) -> Path:
    """Compiles `source` into `folder`; a source named again, or a library already built (a `.so` file), is
    copied (its own file, so that it loads as a library of its own) instead of compiled."""
    from xlagen import native

    library = folder / f"{len(list(folder.iterdir()))}-{source.name}.so"
    if source.is_file() and source.suffix == ".so":
        shutil.copyfile(source, library)
        return library
    first = built.setdefault(source.resolve(), library)
    if first is library:
        native.compile_library(source, library)
    else:
        shutil.copyfile(first, library)
    return library


def entry(library: Path, weights: str):
    function = getattr(ctypes.CDLL(str(library)), ENTRY_POINTS[weights])
    function.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3
    function.restype = ctypes.c_char_p
    return function


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sources", nargs="+", type=Path, required=True,
                        help="folders of kernel sources to compare, or libraries already built (.so)")
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt2")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8], help="rows of x (batch x beams)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=3, help="steps per build and round")
    parser.add_argument("--weights", choices=sorted(ENTRY_POINTS), nargs="+", default=["float32"],
                        help="the entry point of each source (one value for all, or one per source), all of "
                        "one packed layout")
    parser.add_argument("--blas", action="store_true", help="also time numpy's matmul on the same products "
                        "(in float32)")
    parser.add_argument("--gap-us", type=float, default=0.0, help="microseconds the calling thread spins after "
                        "each product (XLA's other work between two products)")
    parser.add_argument("--lookahead", type=int, nargs="+", default=None, metavar="KIB",
                        help="KiB each build's idle workers read ahead (one value, or one per source)")
    args = parser.parse_args(argv)
    if args.lookahead is not None and len(args.lookahead) not in (1, len(args.sources)):
        parser.error("--lookahead takes one value or one per source")
    if len(args.weights) not in (1, len(args.sources)):
        parser.error("--weights takes one value or one per source")
    entries = args.weights * len(args.sources) if len(args.weights) == 1 else args.weights
    layouts = {LAYOUTS.get(weights, weights) for weights in entries}
    if len(layouts) != 1:
        parser.error(f"--weights {' '.join(args.weights)}: one packed layout at a time")
    layout = layouts.pop()

    layers, shapes, head = MODELS[args.model]
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal(shape, dtype=np.float32) for _ in range(layers) for shape in shapes]
    weights.append(rng.standard_normal(head, dtype=np.float32))
    kernels, references = zip(*(stored(w, layout) for w in weights))
    step_bytes = sum(packed.nbytes for packed in kernels)
    with tempfile.TemporaryDirectory() as scratch:
        names = [str(source) for source in args.sources]
        built = {}
        libraries = [build(source, Path(scratch), built) for source in args.sources]
        functions = [entry(library, weights) for library, weights in zip(libraries, entries)]
        if len(set(entries)) > 1:
            names = [f"{name} ({weights})" for name, weights in zip(names, entries)]
        if args.lookahead is not None:
            for library, kib in zip(libraries, args.lookahead * len(libraries) if len(args.lookahead) == 1
                                    else args.lookahead):
                ctypes.CDLL(str(library)).xlagen_set_lookahead(ctypes.c_long(kib))
            names = [f"{name} (lookahead {kib} KiB)" for name, kib in
                     zip(names, args.lookahead * len(names) if len(args.lookahead) == 1 else args.lookahead)]
        if args.blas:
            names.append("numpy")
        flops_per_row = sum(w.size for w in weights)
        print(f"{args.model}, {layout} weights: {len(weights)} products per step, {step_bytes / 1e6:.1f} MB "
              "of weights", flush=True)
        for rows in args.rows:
            xs = {k: rng.standard_normal((rows, k), dtype=np.float32) for k in {w.shape[0] for w in weights}}
            calls = []
            for w, packed in zip(weights, kernels):
                k, n = w.shape
                y = np.empty((rows, n), np.float32)
                calls.append((xs[k], w, y, packed, (rows, k, n)))

            gap = args.gap_us * 1e-6

            def kernel_step(function, calls=calls):
                for x, _, y, packed, sizes in calls:
                    function(x.ctypes.data, packed.ctypes.data, y.ctypes.data, *sizes)
                    _spin(gap)

            def blas_step(calls=calls):
                for x, w, y, _, _ in calls:
                    np.matmul(x, w, out=y)
                    _spin(gap)

            steps = [lambda f=f: kernel_step(f) for f in functions] + ([blas_step] if args.blas else [])
            for name, step, product in zip(names, steps, entries + ["float32"]):
                step()
                for (x, w, y, _, _), reference in zip(calls, references):
                    expected = x.astype(np.float64) @ (reference if step is not blas_step else w).astype(np.float64)
                    atol = 1e-3 * np.sqrt(x.shape[1])
                    if product in STEPS:  # quantized activations: half a step of the row per element
                        spread = np.abs(x).max(1) if product == "int8-integer" else np.ptp(np.c_[x, np.zeros(len(x))], 1)
                        atol = atol + spread[:, None] / STEPS[product] * np.abs(reference).sum(0)[None, :]
                    if not np.allclose(y, expected, rtol=1e-4, atol=atol):
                        raise SystemExit(f"{name}: wrong product for {x.shape} @ {w.shape}")
            # numpy's BLAS is timed after the builds' rounds, not among them: its threads spin after a
            # call and would slow whichever build came next.
            times = [[] for _ in steps]

            def run(index, count):
                for _ in range(count):
                    start = time.perf_counter()
                    steps[index]()
                    times[index].append(time.perf_counter() - start)

            for _ in range(args.rounds):
                for index in range(len(functions)):
                    run(index, args.repeats)
            if args.blas:
                run(len(functions), args.rounds * args.repeats)
            medians = [statistics.median(spent) for spent in times]
            gaps = gap * len(calls)
            print(f"rows {rows}:" + (f" (each step with {gaps * 1e3:.2f} ms of gaps)" if gaps else ""), flush=True)
            for name, median in zip(names, medians):
                read = step_bytes if name != "numpy" else 4 * flops_per_row
                busy = median - gaps
                print(f"  {name}: {median * 1e3:.2f} ms/step, {read / busy / 1e9:.1f} GB/s, "
                      f"{2 * rows * flops_per_row / busy / 1e9:.0f} GFLOP/s, first / this "
                      f"{medians[0] / median:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
