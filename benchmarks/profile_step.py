"""Where a compiled `generate` spends its time, per XLA instruction, from TensorFlow's profiler.

XLA's CPU runtime records each thunk it runs (a fusion, a dot, a dynamic-update-slice, ...) when
`--xla_cpu_enable_xprof_traceme=true` is in XLA_FLAGS; this script sets it, runs one profiled call of
`tf.function(model.generate, jit_compile=True)` after a warm-up, and sums the recorded time by
instruction name (numeric suffixes dropped, so `dot.823` and `dot.824` count as `dot`), per decoding
step, over all threads.

    python benchmarks/profile_step.py --model gpt2 --strategy beam2 --new-tokens 128
    python benchmarks/profile_step.py --model gpt2 --timeline 3   # every event of 3 ms mid-call
    python benchmarks/profile_step.py --model whisper --batch-size 8 --phase before-loop   # the encoder
    python benchmarks/profile_step.py --prompt-tokens 512 --new-tokens 1 --phase before-loop   # a long prompt

The profiler itself adds about 10-20 % to a call, mostly at the thread-pool hand-offs, so compare rows
with each other rather than with `xlagen bench`. The models are `xlagen bench`'s random-weight shapes.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile
import time


def _events(logdir: str):
    """(start ps, duration ps, thread index, name) of every host event of the profile in `logdir`."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    path = sorted(glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb")))[-1]
    space = xplane_pb2.XSpace()
    with open(path, "rb") as file:
        space.ParseFromString(file.read())
    plane = next(p for p in space.planes if p.name == "/host:CPU")
    names = {key: value.name for key, value in plane.event_metadata.items()}
    for thread, line in enumerate(plane.lines):
        for event in line.events:
            name = names.get(event.metadata_id, "?")
            yield line.timestamp_ns * 1000 + event.offset_ps, event.duration_ps, thread, name


# Events that wrap others (the whole call, the executor) rather than being work themselves.
WRAPPERS = ("ThunkExecutor::Execute", "ThreadpoolListener", "generate", "EagerExecute", "EagerLocalExecute",
            "EagerKernelExecute", "TFE_Py_Execute", "CpuExecutable", "BlockUntilReady", "__inference")


def phase(events: list, which: str) -> list:
    """The events of one phase of the call: `before-loop` (prefill, and an encoder's whole run), `loop` (the
    decoding steps: inside the outermost `while`), or `all`."""
    if which == "all":
        return events
    loops = [(s, s + d) for s, d, _, n in events if n == "while" or n.startswith("while.")]
    if not loops:
        raise SystemExit("no `while` event in the profile")
    start, end = min(loops)[0], max(e for _, e in loops)
    if which == "before-loop":
        return [e for e in events if e[0] + e[1] <= start or e[3].startswith("CpuExecutable::ExecuteAsyncOnStream")]
    return [e for e in events if start <= e[0] < end or e[3].startswith("CpuExecutable::ExecuteAsyncOnStream")]


def summarise(events: list, steps: int, top: int, by_instruction: bool = False) -> str:
    totals, counts = collections.Counter(), collections.Counter()
    call = 0
    for _, duration, _, name in events:
        if name.startswith("CpuExecutable::ExecuteAsyncOnStream"):
            call = max(call, duration)
        if name.startswith(WRAPPERS) or name.startswith("end:"):
            continue
        key = name if by_instruction else re.sub(r"\.\d+$", "", name)
        totals[key] += duration
        counts[key] += 1
    lines = [f"one call: {call / 1e9:.1f} ms, {call / 1e6 / steps:.1f} us per step (profiled)", "",
             "| instruction | per step | us per step (all threads) | ms per call | share of the call |",
             "|---|---|---|---|---|"]
    for key, total in totals.most_common(top):
        share = total / call if call else 0.0
        lines.append(f"| {key} | {counts[key] / steps:.1f} | {total / 1e6 / steps:.1f} | {total / 1e9:.1f} "
                     f"| {share:.1%} |")
    return "\n".join(lines)


def timeline(events: list, start_ms: float, window_ms: float) -> str:
    events = sorted(events)
    origin = events[0][0] + int(start_ms * 1e9)
    rows = [f"{(s - origin) / 1e6:9.1f} us  thread {t}  {d / 1e6:8.1f} us  {n}" for s, d, t, n in events
            if origin <= s < origin + int(window_ms * 1e9) and not n.startswith("end:")]
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", help="an `xlagen bench` model: gpt2, opt, t5, whisper, tiny-gpt2")
    parser.add_argument("--strategy", default="greedy", help="greedy, beam2 or beam4")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="prompt length (default: `xlagen bench`'s); with --new-tokens 1 and --phase before-loop, "
                        "the prompt pass alone")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32",
                        help="an `xlagen bench` dtype: float32, bfloat16-weights or int8-weights (packed weights)")
    parser.add_argument("--top", type=int, default=25, help="rows of the table")
    parser.add_argument("--timeline", type=float, default=0.0, metavar="MS",
                        help="also print every event of a window of this many ms from the middle of the decoding loop")
    parser.add_argument("--by-instruction", action="store_true",
                        help="one row per instruction (a block traced once, `share_traces`, has one instruction per "
                        "product for all its layers): e.g. each of a block's custom calls")
    parser.add_argument("--phase", choices=("all", "before-loop", "loop"), default="all",
                        help="sum only the events before the decoding loop (prefill, an encoder) or inside it")
    args = parser.parse_args()

    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()
    import tensorflow as tf

    from xlagen.cli import bench_timing

    bench_timing.configure_threads(args.threads)
    model = bench_timing.XlagenSystem().build(args.model, args.dtype)
    scenario = bench_timing.Scenario(model=args.model, strategy=args.strategy, batch_size=args.batch_size,
                                     new_tokens=args.new_tokens, mode="xla", dtype=args.dtype,
                                     **({"prompt_tokens": args.prompt_tokens} if args.prompt_tokens else {}))
    function, inputs, options = bench_timing.prepare(bench_timing.XlagenSystem(), model, scenario)
    for _ in range(2):  # compile, then one warm call
        bench_timing.timed(function, inputs, options, args.new_tokens)
    unprofiled = bench_timing.timed(function, inputs, options, args.new_tokens)
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        started = time.perf_counter()
        bench_timing.timed(function, inputs, options, args.new_tokens)
        profiled = time.perf_counter() - started
        tf.profiler.experimental.stop()
        events = list(_events(logdir))
    print(f"{scenario.label()}: {unprofiled / args.new_tokens * 1e3:.2f} ms/token unprofiled, "
          f"{profiled / args.new_tokens * 1e3:.2f} profiled\n")
    print(summarise(phase(events, args.phase), args.new_tokens, args.top, args.by_instruction))
    if args.timeline:
        loops = [(d, s) for s, d, _, n in events if n == "while" or n.startswith("while.")]
        if loops:  # the middle of the decoding loop
            duration, start = max(loops)
            middle = start + duration // 2 - min(s for s, _, _, _ in events)
        else:
            middle = (max(s + d for s, d, _, _ in events) - min(s for s, _, _, _ in events)) // 2
        print("\n" + timeline(events, middle / 1e9, args.timeline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
