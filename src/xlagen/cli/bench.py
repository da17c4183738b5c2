"""`xlagen bench`: how fast xlagen generates on this machine, for a model.

For each scenario (model x strategy x batch x new tokens x XLA/eager x dtype) it times the first call
of `tf.function(model.generate, jit_compile=True)` (trace + compile + one run), then the median of
`--repeats` runs after `--warmup` runs, as ms per decoding step ("ms/token": one step makes one token
per row) and tokens/s over all rows. A model is a checkpoint (folder or Hub id, its own weights) or
one of `ARCHITECTURES`, built with random weights at the shapes of the smallest public checkpoint
(speed does not depend on the values). Generation never stops early (`eos_token_id=None`). The reports
are NAME.json, NAME.md and, with matplotlib, NAME.png.

The measurement is `bench_timing` (shared with harnesses that time other libraries the same way),
the reports `bench_report`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

from xlagen.cli.bench_report import markdown, plot, write_reports
from xlagen.cli.bench_timing import (ARCHITECTURES, MODES, PACKED_BF16, PACKED_INT8, STRATEGIES, Scenario, TFSystem,
                                     XlagenSystem, busy_processes, configure_threads, describe, environment, label,
                                     load_average, machine_info, run_in_process, set_thread_pools)
from xlagen.cli.common import non_negative_int, positive_int

SCHEMA = "xlagen-bench/2"
# Options left unset on the command line take these values; --quick and --tiny override some.
DEFAULTS = {"models": ["gpt2"], "strategies": ["greedy", "beam2", "beam4"], "batch_sizes": [1, 8],
            "new_tokens": [32, 128, 512], "modes": list(MODES), "repeats": 5, "warmup": 1, "eager_new_tokens": 16,
            "eager_repeats": 2}
PRESETS = {
    "quick": {"strategies": ["greedy", "beam2"], "batch_sizes": [1], "new_tokens": [128], "repeats": 3},
    "tiny": {"models": ["tiny-gpt2"], "strategies": ["greedy", "beam2"], "batch_sizes": [1], "new_tokens": [8],
             "repeats": 1, "warmup": 0, "eager_new_tokens": 4, "eager_repeats": 1},
}


def scenarios_from(args: argparse.Namespace) -> list[Scenario]:
    """The scenario matrix of the options; eager runs once per (model, strategy, batch), short."""
    scenarios = []
    for model in args.models:
        for mode in args.modes:
            lengths = args.new_tokens if mode == "xla" else [args.eager_new_tokens]
            for strategy in args.strategies:
                for batch_size in args.batch_sizes:
                    for dtype in args.dtype:
                        scenarios += [Scenario(model, strategy, batch_size, n, mode, dtype) for n in lengths]
    return scenarios


def command_line(args: argparse.Namespace, program: list[str]) -> list[str]:
    """`program` followed by every scenario and timing option spelled out: a command that repeats the run."""
    command = list(program)
    for name in DEFAULTS:
        value = getattr(args, name)
        command += [f"--{name.replace('_', '-')}", *map(str, value if isinstance(value, list) else [value])]
    command += ["--dtype", *args.dtype, "--threads", str(args.threads)]
    command += ["--load", str(args.load)] if args.load else []
    return command + (["--ttft"] if args.ttft else [])


def run_benchmark(args: argparse.Namespace, system: TFSystem) -> int:
    """Runs every scenario in this process and writes the reports.

    Returns:
        0 when every scenario ran, 1 when one failed (the reports list it and keep the others).
    """
    scenarios = scenarios_from(args)
    started, load_start = datetime.datetime.now(datetime.timezone.utc), load_average()
    systems = {system.name: {"system": system.name, "versions": system.versions(),
                             "threads": configure_threads(args.threads), "env": environment()}}
    results: list[dict] = []

    def emit(result: dict) -> None:
        result["load_average_1min"] = load_average()
        results.append(result)
        progress(args, f"[{len(results)}/{len(scenarios)}] {label(result)}: " + describe(result))

    with busy_processes(args.load):
        run_in_process(system, scenarios, args, emit)
        load_end = load_average()
    machine = machine_info()
    machine["load_average_1min"] = {"start": load_start, "end": load_end}
    machine["busy_processes"] = args.load
    report = {"schema": SCHEMA, "created": started.isoformat(timespec="seconds"),
              "seconds": round((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(), 1),
              "command": command_line(args, ["xlagen", "bench"]), "machine": machine, "systems": systems,
              "options": {k: getattr(args, k) for k in DEFAULTS} | {"threads": args.threads, "dtype": args.dtype,
                                                                     "ttft": args.ttft, "load": args.load},
              "results": results}
    paths = write_reports(report, Path(args.output_dir), args.name or started.strftime("bench-%Y%m%d-%H%M%S"),
                          markdown, plot if not args.no_plot else None)
    print(markdown(report))
    progress(args, "wrote " + ", ".join(str(p) for p in paths))
    return 1 if any("error" in r for r in results) else 0


def progress(args: argparse.Namespace, message: str) -> None:
    if not args.quiet:
        print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- command line

def add_scenario_arguments(parser: argparse.ArgumentParser, models_help: str) -> None:
    """The scenario and timing options, shared with harnesses that time other libraries the same way."""
    what = parser.add_argument_group("scenarios (defaults: the full matrix; --quick / --tiny change them)")
    what.add_argument("--quick", action="store_true", help="greedy and beam2, batch 1, 128 new tokens, 3 repeats")
    what.add_argument("--tiny", action="store_true", help="a tiny random GPT-2, a few tokens, 1 repeat (smoke test)")
    what.add_argument("--models", nargs="+", metavar="MODEL", help=models_help)
    what.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), help="default: all")
    what.add_argument("--batch-sizes", nargs="+", type=positive_int, metavar="B", help="default: 1 8")
    what.add_argument("--new-tokens", nargs="+", type=positive_int, metavar="N", help="XLA; default: 32 128 512")
    what.add_argument("--modes", nargs="+", choices=MODES, help="default: xla eager")
    what.add_argument("--dtype", nargs="+", default=["float32"],
                      help=f"weights and compute dtype policies, each scenario once per dtype (default: float32); "
                           f"{PACKED_BF16!r} / {PACKED_INT8!r}: a float32 model whose matrix products read "
                           f"bfloat16 / int8 weights")
    timing = parser.add_argument_group("timing")
    timing.add_argument("--repeats", type=positive_int, help="timed XLA runs, median reported (default: 5)")
    timing.add_argument("--warmup", type=int, help="untimed XLA runs after the first call (default: 1)")
    timing.add_argument("--eager-new-tokens", type=positive_int, metavar="N", help="eager run length (default: 16)")
    timing.add_argument("--eager-repeats", type=positive_int, help="timed eager runs (default: 2)")
    timing.add_argument("--ttft", action="store_true", help="also time max_new_tokens=2 to split time to first "
                        "token from decode ms/token (one more compile per scenario)")
    timing.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1,
                        help="TensorFlow intra- and inter-op threads (default: all cores)")
    timing.add_argument("--load", type=non_negative_int, default=0, metavar="N",
                        help="N busy processes (a pure-Python loop each, in sessions of their own) run beside the "
                        "timed scenarios and are killed after them: a loaded machine on purpose (default: 0)")


def add_output_arguments(parser: argparse.ArgumentParser, default_dir: str) -> None:
    out = parser.add_argument_group("output")
    out.add_argument("--output-dir", default=default_dir, metavar="DIR", help=f"(default: {default_dir})")
    out.add_argument("--name", help="file name stem of the reports (default: bench-DATE-TIME)")
    out.add_argument("--no-plot", action="store_true", help="skip the PNG")


def resolve_arguments(args: argparse.Namespace) -> argparse.Namespace:
    """Fills unset options from --tiny / --quick, then from `DEFAULTS`."""
    preset = PRESETS["tiny"] if args.tiny else PRESETS["quick"] if args.quick else {}
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, preset.get(name, default))
    return args


def add_parser(subparsers, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Registers `bench` on the `xlagen` sub-parsers.

    Args:
        subparsers: The result of `ArgumentParser.add_subparsers()`.
        parents: Parsers holding the options common to all subcommands (--verbose, --quiet).

    Returns:
        The `bench` parser, with `run` set as its default.
    """
    parser = subparsers.add_parser("bench", parents=parents, help="measure generation speed on this machine",
                                   description="Measure xlagen's generation speed on this machine: first call "
                                   "(trace + compile), steady-state ms/token and tokens/s, XLA and eager.")
    add_scenario_arguments(parser, f"checkpoint folders or Hub ids, or architectures with random weights "
                                   f"({', '.join(ARCHITECTURES)}); default: gpt2")
    add_output_arguments(parser, ".")
    # `xlagen` imports TensorFlow before `run`: the thread pools are set in between (see xlagen.cli.__main__).
    parser.set_defaults(run=run, configure_tensorflow=lambda args: set_thread_pools(args.threads))
    return parser


def run(args: argparse.Namespace) -> int:
    """Runs `xlagen bench`.

    Returns:
        0 when every scenario ran, 1 when one failed (the reports still list the others).
    """
    return run_benchmark(resolve_arguments(args), XlagenSystem())
