"""What the native float32 kernel buys: one model, `generate` traced twice in one process, with and without
the kernel (`xlagen.native.set_float32_kernel`), timed call by call in alternation.

    python benchmarks/float32_kernel_ab.py --model gpt2 --strategy greedy --batch-size 1 --calls 9

Prints the median ms/token of each and their ratio (XLA's dot / the kernel: above 1, the kernel is
faster), and checks that both programs generate the same tokens. Random weights of the bench's shapes
(`xlagen bench` model names), 8-token prompts, TensorFlow on --threads threads.
"""

from __future__ import annotations

import argparse
import json
import statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", help="an `xlagen bench` model: gpt2, opt, t5, whisper")
    parser.add_argument("--strategy", default="greedy", help="greedy, beam2, beam4")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--calls", type=int, default=9, help="timed calls of each program")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import numpy as np

    from xlagen import native
    from xlagen.cli import bench

    bench.configure_threads(args.threads)
    system = bench.XlagenSystem()
    model = system.build(args.model, "float32")
    scenario = bench.Scenario(args.model, args.strategy, args.batch_size, args.new_tokens, "xla")
    programs, tokens = {}, {}
    for name, enabled in (("xla_dot", False), ("kernel", True)):
        native.set_float32_kernel(enabled)  # read while tracing: each program keeps its choice
        function, inputs, options = bench.prepare(system, model, scenario)
        bench._timed(function, inputs, options, args.new_tokens)  # trace + compile
        programs[name] = (function, inputs, options)
        model_inputs = {k: v for k, v in inputs.items() if k != "_prefix"}
        tokens[name] = np.asarray(function(**model_inputs, **dict(options, max_new_tokens=args.new_tokens)))
    native.set_float32_kernel(True)
    times = {name: [] for name in programs}
    for index in range(args.calls):
        for name in list(programs)[::-1 if index % 2 else 1]:
            function, inputs, options = programs[name]
            times[name].append(1000.0 * bench._timed(function, inputs, options, args.new_tokens) / args.new_tokens)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(json.dumps({"scenario": scenario.label(), "same_tokens": bool(np.array_equal(*tokens.values())),
                      "ms_per_token": {k: round(v, 2) for k, v in medians.items()},
                      "runs_ms_per_token": {k: [round(t, 2) for t in v] for k, v in times.items()},
                      "xla_dot_over_kernel": round(medians["xla_dot"] / medians["kernel"], 3)}))


if __name__ == "__main__":
    main()
