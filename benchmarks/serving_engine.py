"""The slot engine's aggregate tokens/s at 1, 4 and 16 concurrent requests, against the same requests one at
a time through `CompiledGenerator` and in static batches of 8; the cost of its programs (a step of 1, 4 and 16
rows, a prefill of 1 and `--prefill-batch` prompts); and one step of 4 tokens per call against single steps.

    python benchmarks/serving_engine.py --concurrency 1 4 16 --prefill-batch 16 --prompt-buckets 16 32 \\
        --chunk-rounds 0 --cost-repeats 3 --out benchmarks/results/serving-engine-gpt2-small.json

Random weights of GPT-2 small's shapes (float32), TensorFlow on --threads threads. Every request has a
random prompt of 8-32 tokens and asks for 16-48 new tokens (mixed, fixed by --seed); generation never stops
early (no EOS), so every system produces the same number of tokens. Times are wall clock from the first
submission to the last token, after a warm-up that compiled every program; the engine decodes the text (the
built-in model's tokenizer, as a server would). Each concurrency level runs the engine and then
`CompiledGenerator` on the same requests, back to back (this machine's load moves from minute to minute).
The step-chunk comparison times `SlotDecoder.step` at 1 and 4 tokens per call, in alternation. Not a test:
no assertion on speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import numpy as np
from serving_setup import serving_model, write_report


def _workload(count: int, seed: int, vocab: int):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, int(rng.integers(8, 33))).tolist(), int(rng.integers(16, 49)))
            for _ in range(count)]


def _engine_run(engine, requests) -> dict:
    """All `requests` submitted at once; aggregate tokens/s, time to first token, inter-token gaps."""
    async def one(prompt, new):
        submitted = time.perf_counter()
        stamps = []
        async for _ in engine.stream(prompt, max_new_tokens=new):
            stamps.append(time.perf_counter())
        return submitted, stamps

    async def main():
        return await asyncio.gather(*(one(prompt, new) for prompt, new in requests))

    started = time.perf_counter()
    results = asyncio.run(main())
    seconds = time.perf_counter() - started
    tokens = sum(len(stamps) for _, stamps in results)
    assert tokens == sum(new for _, new in requests), "every request must produce all its tokens"
    first = [stamps[0] - submitted for submitted, stamps in results]
    gaps = [b - a for _, stamps in results for a, b in zip(stamps, stamps[1:])]
    return {"seconds": round(seconds, 3), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
            "ttft_ms_p50": round(1000 * statistics.median(first), 1), "ttft_ms_p99": round(1000 * float(np.percentile(first, 99)), 1),
            "ttft_ms_max": round(1000 * max(first), 1),
            "inter_token_ms_p50": round(1000 * statistics.median(gaps), 2),
            "inter_token_ms_p99": round(1000 * float(np.percentile(gaps, 99)), 2)}


def _generator_run(generator, requests, batch: int) -> dict:
    """`requests` through `CompiledGenerator`, `batch` at a time (each batch runs to its longest request)."""
    started = time.perf_counter()
    tokens = 0
    for start in range(0, len(requests), batch):
        group = requests[start:start + batch]
        width = max(len(prompt) for prompt, _ in group)
        ids = np.zeros((len(group), width), np.int32)
        mask = np.zeros_like(ids)
        for row, (prompt, _) in enumerate(group):
            ids[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
        new = max(n for _, n in group)
        out = generator.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=None, pad_token_id=0)
        tokens += sum(n for _, n in group)  # tokens asked for (a static batch computes `new` for every row)
        assert np.asarray(out).shape == (len(group), width + new)
    seconds = time.perf_counter() - started
    return {"seconds": round(seconds, 3), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)}


def _chunk_comparison(model, slots: int, max_length: int, rounds: int) -> dict:
    """ms per token of `SlotDecoder.step` advancing every slot by 1 token per call against 4 per call, timed
    in alternation (16 tokens each way per round)."""
    from xlagen.generation.row_sampling import RowOptions
    from xlagen.generation.slots import SlotDecoder

    options = RowOptions(np.zeros(slots, bool), np.ones(slots, np.float32), np.zeros(slots, np.int32),
                         np.ones(slots, np.float32), np.ones(slots, np.float32), np.zeros((slots, 2), np.int32),
                         np.zeros(slots, np.int32))
    decoders = {steps: SlotDecoder(model, slots, max_length, steps) for steps in (1, 4)}
    for decoder in decoders.values():
        decoder.step(32, options)  # compile
    times = {steps: [] for steps in decoders}
    for round_ in range(rounds):
        for steps in (1, 4) if round_ % 2 == 0 else (4, 1):
            started = time.perf_counter()
            for call in range(16 // steps):
                decoders[steps].step(32 + call * steps, options)
            times[steps].append(1000 * (time.perf_counter() - started) / 16)
    return {f"steps_per_call={steps}": {"ms_per_token_median": round(statistics.median(values), 2),
                                        "ms_per_token_runs": [round(v, 2) for v in values]}
            for steps, values in times.items()}


def _step_costs(model, slots: int, max_length: int, bucket: int, prefill_batch: int, repeats: int) -> dict:
    """Median ms of one `SlotDecoder` call: the step at each width (greedy), and the prefill of 1 and
    `prefill_batch` prompts of `bucket` tokens; what bounds the engine's throughput and latencies."""
    from xlagen.generation.row_sampling import RowOptions
    from xlagen.generation.slots import SlotDecoder

    def options(rows: int) -> RowOptions:
        return RowOptions(np.zeros(rows, bool), np.ones(rows, np.float32), np.zeros(rows, np.int32),
                          np.ones(rows, np.float32), np.ones(rows, np.float32), np.zeros((rows, 2), np.int32),
                          np.zeros(rows, np.int32))

    def median_ms(call) -> float:
        call()  # compile
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            call()
            times.append(1000 * (time.perf_counter() - started))
        return round(statistics.median(times), 1)

    decoder = SlotDecoder(model, slots, max_length)
    costs = {f"step_width_{w}_ms": median_ms(lambda w=w: decoder.step(bucket, options(w), w))
             for w in sorted({1, 4, slots})}
    for rows in sorted({1, prefill_batch}):
        ids = np.ones((rows, bucket), np.int32)
        costs[f"prefill_{rows}x{bucket}_ms"] = median_ms(lambda ids=ids: decoder.prefill(ids, ids, {},
                                                                                           options(len(ids))))
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=128, help="columns per request (prompt + new tokens)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--chunk-rounds", type=int, default=6)
    parser.add_argument("--prefill-batch", type=int, default=4, help="the engine's prefill_batch")
    parser.add_argument("--prompt-buckets", type=int, nargs="+", default=[32], help="the engine's prompt_buckets")
    parser.add_argument("--cost-repeats", type=int, default=5, help="calls per program in the step-cost table "
                        "(0: no table)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the JSON here too")
    args = parser.parse_args()

    from xlagen import Buckets, CompiledGenerator
    from xlagen.cli import bench
    from xlagen.serving import Engine

    model, tokenizer, threads = serving_model(args.threads)
    vocab = model.config.vocab_size
    record = {"model": "gpt2 (GPT-2 small shapes, random weights)", "dtype": "float32", "slots": args.slots,
              "max_length": args.max_length, "threads": threads, "machine": bench.machine_info(),
              "load_average_1min_start": bench.load_average(), "runs": {}}

    generator = CompiledGenerator(model, Buckets(batch_sizes=(1, 8), prompt_lengths=(32,), new_tokens=(48,)))
    for batch in (1, 8):  # compile
        _generator_run(generator, _workload(batch, 99, vocab), batch)
    engine = Engine(model, tokenizer, slots=args.slots, max_length=args.max_length,
                    prompt_buckets=args.prompt_buckets, prefill_batch=args.prefill_batch)
    record["prefill_batch"], record["prompt_buckets"] = args.prefill_batch, args.prompt_buckets
    record["engine_warmup_s"] = round(engine.warmup(), 1)
    engine.start()
    _engine_run(engine, _workload(2, 98, vocab))
    for count in args.concurrency:  # each system right after the other on the same requests
        requests = _workload(count, args.seed + count, vocab)
        run = {"engine": _engine_run(engine, requests),
               "compiled_generator_one_at_a_time": _generator_run(generator, requests, 1)}
        if count >= 8:
            run["compiled_generator_static_batches_of_8"] = _generator_run(generator, requests, 8)
        run["engine_over_one_at_a_time"] = round(
            run["engine"]["tokens_per_s"] / run["compiled_generator_one_at_a_time"]["tokens_per_s"], 2)
        record["runs"][str(count)] = run
        print(f"concurrency {count}: {json.dumps(run)}", flush=True)
    engine.close()
    record["engine_stats"] = engine.stats()
    if args.cost_repeats:
        record["program_costs"] = _step_costs(model, args.slots, args.max_length, max(args.prompt_buckets),
                                              args.prefill_batch,
                                              args.cost_repeats)
        print(json.dumps(record["program_costs"]), flush=True)
    if args.chunk_rounds:
        record["step_chunks"] = _chunk_comparison(model, args.slots, args.max_length, args.chunk_rounds)
    record["load_average_1min_end"] = bench.load_average()
    write_report(record, args.out)


if __name__ == "__main__":
    main()
