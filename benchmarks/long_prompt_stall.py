"""What a long prompt does to the requests already decoding on the slot engine: N streams decode, then one
prompt of --long-prompt tokens arrives; the streams' gaps between tokens (p50, p99, the longest) and the long
request's time to first token, with the prompt prefilled at once (`prefill_chunk=None`) and in chunks
(`--chunks`), the variants alternating round by round in one process.

    python benchmarks/long_prompt_stall.py --streams 7 --slots 8 --long-prompt 1000 --chunks 256 --rounds 3 \\
        --out benchmarks/results/long-prompt-stall-gpt2-small.json

Random weights of GPT-2 small's shapes (float32), TensorFlow on --threads threads, the built-in model's
tokenizer. The streams have 16-token prompts and ask for --stream-tokens new tokens; the long prompt comes
once every stream has its 8th token and asks for 8. Generation never stops early (no EOS). Gaps are measured
where a consumer receives its tokens, from the long prompt's arrival to the streams' end; with several tokens
per step call (`steps_per_call`, 4 by default) tokens arrive in bursts, so p50 is within a burst and the
longest gap is the stall. Not a test: no assertion on speed.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import numpy as np
from serving_setup import serving_model, write_report


def _round(engine, streams: int, stream_tokens: int, long_prompt: list, rng) -> dict:
    prompts = [rng.integers(0, 50000, 16).tolist() for _ in range(streams)]

    async def main():
        arrived = asyncio.Event()
        started = [0]
        gaps: list[float] = []

        async def stream(prompt):
            last = None
            count = 0
            async for _ in engine.stream(prompt, max_new_tokens=stream_tokens):
                now = time.perf_counter()
                count += 1
                if count == 8:
                    started[0] += 1
                    if started[0] == streams:
                        arrived.set()
                if arrived.is_set() and last is not None:
                    gaps.append(now - last)
                last = now

        async def long():
            await arrived.wait()
            submitted = time.perf_counter()
            first = None
            async for _ in engine.stream(long_prompt, max_new_tokens=8):
                first = first or time.perf_counter()
            return first - submitted

        *_, ttft = await asyncio.gather(*(stream(p) for p in prompts), long())
        return gaps, ttft

    gaps, ttft = asyncio.run(main())
    return {"gaps": gaps, "ttft": ttft}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=7)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--long-prompt", type=int, default=1000, help="tokens of the prompt that arrives")
    parser.add_argument("--stream-tokens", type=int, default=96, help="new tokens each stream asks for")
    parser.add_argument("--chunks", type=int, nargs="+", default=[256], help="prefill_chunk values to compare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the JSON here too")
    args = parser.parse_args()

    from xlagen.cli import bench
    from xlagen.serving import Engine

    model, tokenizer, threads = serving_model(args.threads)
    load_start = bench.load_average()
    rng = np.random.default_rng(args.seed)
    long_prompt = rng.integers(0, 50000, args.long_prompt).tolist()
    variants = {"at once": None} | {f"chunks of {c}": c for c in args.chunks}
    engines = {}
    for name, chunk in variants.items():
        engine = Engine(model, tokenizer, slots=args.slots, max_length=args.max_length, prefill_chunk=chunk)
        engine.warmup(buckets=(16, args.long_prompt))
        engine.start()
        engines[name] = engine
    runs = {name: [] for name in engines}
    for round_ in range(args.rounds):
        for name in (list(engines) if round_ % 2 == 0 else list(engines)[::-1]):
            runs[name].append(_round(engines[name], args.streams, args.stream_tokens, long_prompt, rng))
            print(name, "round", round_, "ttft %.2f s" % runs[name][-1]["ttft"], flush=True)
    for engine in engines.values():
        engine.close()

    def summary(results):
        gaps = np.array([g for r in results for g in r["gaps"]]) * 1000
        return {"gap_ms_p50": round(float(np.percentile(gaps, 50)), 1),
                "gap_ms_p99": round(float(np.percentile(gaps, 99)), 1),
                "gap_ms_max": round(float(gaps.max()), 1),
                "long_ttft_s_median": round(statistics.median(r["ttft"] for r in results), 2),
                "long_ttft_s_runs": [round(r["ttft"], 2) for r in results]}

    report = {"machine": bench.machine_info(), "threads": threads, "load_average_1min_start": load_start,
              "load_average_1min_end": bench.load_average(),
              "command": "python benchmarks/long_prompt_stall.py " + " ".join(sys.argv[1:]),
              "config": vars(args) | {"model": "gpt2 (GPT-2 small shapes, random weights)", "dtype": "float32"},
              "results": {name: summary(results) for name, results in runs.items()}}
    write_report(report, args.out)


if __name__ == "__main__":
    main()
