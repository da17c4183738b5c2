"""What beam search costs per token against greedy decoding, measured side by side: one process, one
model, a compiled `generate` per strategy, timed call by call in alternation.

    python benchmarks/beam_cost.py --model gpt2 --strategies greedy beam2 --new-tokens 128 --calls 7

`xlagen bench` runs its scenarios one after another, minutes apart, and a shared machine's read
bandwidth can move by up to 2x from minute to minute, so its beam2 / greedy ratio compares different
machine states. Here
each round times every strategy once, back to back (the order alternates), and the ratio is taken per
round; the median of those ratios is the figure. Random weights of the bench's shapes, 8-token prompts,
batch --batch-size, TensorFlow on --threads threads.
"""

from __future__ import annotations

import argparse
import json
import statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", help="an `xlagen bench` model: gpt2, opt, t5, whisper")
    parser.add_argument("--strategies", nargs="+", default=["greedy", "beam2"],
                        help="the first is the baseline of the ratios: greedy, beam2, beam4")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--calls", type=int, default=7, help="timed rounds (one call of each strategy each)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from xlagen.cli import bench_timing

    bench_timing.configure_threads(args.threads)
    system = bench_timing.XlagenSystem()
    model = system.build(args.model, "float32")
    programs = {}
    for strategy in args.strategies:
        scenario = bench_timing.Scenario(args.model, strategy, args.batch_size, args.new_tokens, "xla")
        programs[strategy] = bench_timing.prepare(system, model, scenario)
        bench_timing.timed(*programs[strategy], args.new_tokens)  # trace + compile
    times = {strategy: [] for strategy in programs}
    for index in range(args.calls):
        for strategy in list(programs)[::-1 if index % 2 else 1]:
            seconds = bench_timing.timed(*programs[strategy], args.new_tokens)
            times[strategy].append(1000.0 * seconds / args.new_tokens)
    baseline = args.strategies[0]
    ratios = {strategy: [t / b for t, b in zip(times[strategy], times[baseline])]
              for strategy in args.strategies[1:]}
    print(json.dumps({
        "model": args.model, "batch_size": args.batch_size, "new_tokens": args.new_tokens,
        "ms_per_token": {s: round(statistics.median(v), 2) for s, v in times.items()},
        "runs_ms_per_token": {s: [round(t, 2) for t in v] for s, v in times.items()},
        f"over_{baseline}_per_round": {s: [round(r, 3) for r in v] for s, v in ratios.items()},
        f"over_{baseline}_median": {s: round(statistics.median(v), 3) for s, v in ratios.items()},
    }, indent=1))


if __name__ == "__main__":
    main()
