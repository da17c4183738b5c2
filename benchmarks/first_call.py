"""What a `generate` first call costs with the blocks traced once per spec (`xlagen.layers.block.run_blocks`,
the default) and block by block (`Kernels(share_traces=False)`), in fresh processes, alternating.

    python benchmarks/first_call.py --model gpt2 --strategy greedy --pairs 3

Each process builds the bench's random-weight model, warms XLA up with a trivial function (as
`xlagen bench` does), then times: the trace (`get_concrete_function`), the first call after it (TF->HLO
lowering, XLA compile, one generation), and the median of 3 more calls; "trace + compile" is the trace
plus the first call minus that median, what `xlagen bench` reports as trace + compile. Prints each
process's numbers and the medians per variant as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = """
import json, statistics, time
from xlagen import native
from xlagen.cli import bench_timing
bench_timing.configure_threads({threads})
system = bench_timing.XlagenSystem()
model = system.build({model!r}, "float32")
scenario = bench_timing.Scenario({model!r}, {strategy!r}, {batch_size}, {new_tokens}, "xla")
function, inputs, options = bench_timing.prepare(system, model, scenario)
model_inputs = {{k: v for k, v in inputs.items() if k != "_prefix"}}
options = dict(options, max_new_tokens={new_tokens})
started = time.perf_counter()
with native.tracing(native.Kernels(share_traces={shared})):
    function.get_concrete_function(**model_inputs, **options)
trace = time.perf_counter() - started
first = bench_timing.timed(function, inputs, options, {new_tokens})
median = statistics.median(bench_timing.timed(function, inputs, options, {new_tokens}) for _ in range(3))
operations = len(function.get_concrete_function(**model_inputs, **options).graph.as_graph_def().node)
print(json.dumps({{"trace_s": trace, "first_call_after_trace_s": first, "median_call_s": median,
                  "trace_plus_compile_s": trace + first - median, "traced_operations": operations}}))
"""


def run(shared: bool, args) -> dict:
    code = CHILD.format(shared=shared, threads=args.threads, model=args.model, strategy=args.strategy,
                        batch_size=args.batch_size, new_tokens=args.new_tokens)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", help="an `xlagen bench` model: gpt2, opt, t5, whisper")
    parser.add_argument("--strategy", default="greedy", help="greedy, beam2, beam4")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=3, help="processes per variant, alternating")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    runs = {"shared": [], "block_by_block": []}
    for index in range(args.pairs):
        for name in list(runs)[::-1 if index % 2 else 1]:
            runs[name].append(run(name == "shared", args))
            print(json.dumps({name: runs[name][-1]}), flush=True)
    medians = {name: {key: round(statistics.median(r[key] for r in values), 3) for key in values[0]}
               for name, values in runs.items()}
    print(json.dumps({"model": args.model, "strategy": args.strategy, "batch_size": args.batch_size,
                      "new_tokens": args.new_tokens, "medians": medians}, indent=2))


if __name__ == "__main__":
    main()
