"""One request alone through the slot engine against the same request through `CompiledGenerator`: ms per token,
with the engine's default steps per call and with one step per call (and, with --xla-attention, with the
one-row attention left to XLA's dots), alternating in one process.

    python benchmarks/lone_stream.py --new-tokens 64 --rounds 5 --out benchmarks/results/lone-stream-gpt2-small.json

Random weights of GPT-2 small's shapes (float32), TensorFlow on --threads threads, the built-in model's
tokenizer. The prompt is 20 tokens; generation never stops early (no EOS). The engine has --slots slots of
--max-length columns, as a server would; `CompiledGenerator` sizes its cache to the prompt and the new tokens.
Wall time from submission to the last token, and the process's CPU time over the same span. Not a test: no
assertion on speed.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import numpy as np
from serving_setup import serving_model, write_report


def _timed(call, tokens: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    call()
    return 1000 * (time.perf_counter() - wall) / tokens, 1000 * (time.process_time() - cpu) / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--xla-attention", action="store_true",
                        help="also the engine with Kernels.slot_step_attention_min_rows=2 (one row: XLA's dots)")
    parser.add_argument("--out", help="write the JSON here too")
    args = parser.parse_args()

    from xlagen import CompiledGenerator, native
    from xlagen.cli import bench
    from xlagen.serving import Engine

    model, tokenizer, threads = serving_model(args.threads)
    load_start = bench.load_average()
    prompt = list(range(5, 25))
    ids = np.array([prompt], np.int32)
    generator = CompiledGenerator(model)
    generator.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)  # compile
    engines = {}
    variants = [("engine", 4, None), ("engine, one step per call", 1, None)]
    if args.xla_attention:
        xla_attention = native.current().replace(slot_step_attention_min_rows=2)
        variants.append(("engine, XLA's one-row attention", 4, xla_attention))
    for name, steps, kernels in variants:
        engine = Engine(model, tokenizer, slots=args.slots, max_length=args.max_length, steps_per_call=steps,
                        kernels=kernels)
        engine.warmup(buckets=(len(prompt),))
        engine.start()
        engines[name] = engine

    def through(engine):
        async def stream():
            async for _ in engine.stream(prompt, max_new_tokens=args.new_tokens):
                pass
        return lambda: asyncio.run(stream())

    systems = {"CompiledGenerator": lambda: generator.generate(ids, max_new_tokens=args.new_tokens,
                                                               do_sample=False).numpy()}
    systems |= {name: through(engine) for name, engine in engines.items()}
    runs = {name: [] for name in systems}
    for round_ in range(args.rounds):
        for name in (list(systems) if round_ % 2 == 0 else list(systems)[::-1]):
            runs[name].append(_timed(systems[name], args.new_tokens))
    for engine in engines.values():
        engine.close()
    results = {name: {"ms_per_token_median": round(statistics.median(r[0] for r in values), 2),
                      "cpu_ms_per_token_median": round(statistics.median(r[1] for r in values), 2),
                      "ms_per_token_runs": [round(r[0], 2) for r in values]} for name, values in runs.items()}
    library = results["CompiledGenerator"]["ms_per_token_median"]
    for name, result in results.items():
        result["speed_over_compiled_generator"] = round(library / result["ms_per_token_median"], 2)
    report = {"machine": bench.machine_info(), "threads": threads, "load_average_1min_start": load_start,
              "load_average_1min_end": bench.load_average(),
              "command": "python benchmarks/lone_stream.py " + " ".join(sys.argv[1:]),
              "config": vars(args) | {"model": "gpt2 (GPT-2 small shapes, random weights)", "dtype": "float32",
                                      "prompt_tokens": len(prompt)},
              "results": results}
    write_report(report, args.out)


if __name__ == "__main__":
    main()
