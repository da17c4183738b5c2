"""xlagen under two or more variants, each a revision of its source and environment variables, with their timed
calls alternating in worker processes; optionally on a machine loaded on purpose.

    python benchmarks/variants.py --variant spin-600 main --variant spin-0 main XLAGEN_NATIVE_SPIN_US=0 \\
        --variant adaptive . --models gpt2 --batch-sizes 1 8 --new-tokens 32 --repeats 7 --load 0 4 \\
        --name pool-waiting-under-load

A variant is a name, a revision (`.`: this checkout's `src/` as it is, uncommitted changes included; a folder
holding a `src/xlagen`: that copy; else `git archive REVISION src` into a scratch folder) and NAME=VALUE
variables for its workers' environment. Every
scenario (greedy or beam search under XLA, random weights of the real shapes, as `xlagen bench`) gets a fresh
worker process per variant: `peer/compare.py`'s worker, with the variant's `src/` first on PYTHONPATH (each
variant's kernels are built from its own sources). The workers start one after the other (build, first call),
then their timed calls alternate A B C, C B A, ... so that load from elsewhere falls on every variant alike.
With `--load N [N ...]` the whole matrix runs once per N, beside N busy processes
(`xlagen.cli.bench_timing.busy_processes`). Writes NAME.json (every call's seconds, the machine, the variants
and their commits, the load average at the end of each scenario) and NAME.md (median ms/token per variant and
its ratio to the first variant's, one table per load).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPOSITORY = HERE.parent
PEER = HERE / "peer"
sys.path.insert(0, str(PEER))

import workers  # noqa: E402 - after the path is set
from xlagen.cli import bench_report, bench_timing  # noqa: E402
from xlagen.cli.common import non_negative_int, positive_int  # noqa: E402

SCHEMA = "xlagen-variants/1"


@dataclass
class Variant:
    """One side of the comparison: `revision`'s `src/` (`.`: the working tree) run with `env` added."""

    name: str
    revision: str
    env: dict[str, str] = field(default_factory=dict)
    commit: str | None = None
    source: Path | None = None

    def record(self) -> dict:
        return {"name": self.name, "revision": self.revision, "commit": self.commit, "env": self.env}


def parse_variant(words: list[str]) -> Variant:
    """`NAME REVISION [VAR=VALUE ...]` as a `Variant`.

    Raises:
        ValueError: fewer than two words, or a variable that is not NAME=VALUE.
    """
    if len(words) < 2:
        raise ValueError(f"--variant {' '.join(words)}: give NAME REVISION [VAR=VALUE ...]")
    malformed = [word for word in words[2:] if "=" not in word or word.startswith("=")]
    if malformed:
        raise ValueError(f"--variant {words[0]}: {' '.join(malformed)}: give VAR=VALUE")
    return Variant(words[0], words[1], dict(word.split("=", 1) for word in words[2:]))


def _git(*arguments: str) -> str:
    return subprocess.run(["git", "-C", str(REPOSITORY), *arguments], capture_output=True, text=True,
                          check=True).stdout.strip()


def checkout(variant: Variant, scratch: Path) -> None:
    """Sets the variant's `source` (a `src/` folder) and `commit` (with "+dirty" for a changed working tree; None
    for a folder outside git)."""
    if variant.revision == ".":
        variant.source = REPOSITORY / "src"
        variant.commit = _git("rev-parse", "HEAD") + ("+dirty" if _git("status", "--porcelain", "src") else "")
        return
    if (Path(variant.revision) / "src" / "xlagen").is_dir():  # a copy of the sources, changed by hand
        variant.source = Path(variant.revision).resolve() / "src"
        return
    variant.commit = _git("rev-parse", variant.revision)
    folder = scratch / variant.commit
    if not folder.exists():
        folder.mkdir()
        archive = subprocess.run(["git", "-C", str(REPOSITORY), "archive", variant.commit, "src"], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    variant.source = folder / "src"


def environment_of(variant: Variant) -> dict[str, str]:
    """The variant's workers' environment: its `src/` first on PYTHONPATH, its variables added.

    Raises:
        RuntimeError: the worker's python would import xlagen from elsewhere.
    """
    path = [str(variant.source), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path),
           "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"), **variant.env}
    origin = subprocess.run([sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('xlagen')"
                             ".origin)"], env=env, capture_output=True, text=True, check=True).stdout.strip()
    if not Path(origin).is_relative_to(variant.source):
        raise RuntimeError(f"variant {variant.name}: xlagen comes from {origin}, not from {variant.source}")
    return env


def run_scenario(scenario: bench_timing.Scenario, variants: list[Variant], envs: dict[str, dict],
                 args: argparse.Namespace) -> list[dict]:
    """One scenario with a worker per variant, their timed calls alternating; a result record per variant."""

    def start(index: int, timing: dict) -> workers.Worker | None:
        variant = variants[index]
        command = [sys.executable, str(PEER / "compare.py"), "--worker", "xlagen", "--threads", str(args.threads),
                   "--scenario", json.dumps(asdict(scenario))]
        try:
            worker = workers.Worker(variant.name, command, envs[variant.name], "ready")
        except RuntimeError as error:
            timing[index]["error"] = str(error)
            return None
        timing[index]["ready"] = worker.ready
        return worker

    timing = workers.alternate_calls(len(variants), start, scenario.new_tokens, args.repeats, args.warmup, False)
    results = []
    for index, variant in enumerate(variants):
        if "error" in timing[index]:
            result = {"system": "xlagen", **asdict(scenario), "error": timing[index]["error"]}
        else:
            result = bench_timing.summarise("xlagen", scenario, timing[index]["ready"]["first_call_s"],
                                            timing[index]["runs"], [])
        results.append({"variant": variant.name, **result})
    return results


def markdown(report: dict) -> str:
    """Per load, one row per scenario: each variant's median ms/token and its ratio to the first variant's."""
    names = [v["name"] for v in report["variants"]]
    machine = report["machine"]
    lines = ["# xlagen variants", "",
             f"- Machine: {machine.get('cpu')}, {machine.get('usable_cores')} cores, {machine.get('memory_gib')} GiB; "
             f"flags: {' '.join(machine.get('cpu_flags', []))}; sessions scheduled as groups (autogroup): "
             f"{machine.get('autogroup')}",
             f"- Command: `{' '.join(report['command'])}`",
             *(f"- {v['name']}: {v['revision']} ({v['commit']})" + (" with " + " ".join(f"{k}={x}" for k, x in
                                                                                     v["env"].items())
                                                                  if v["env"] else "") for v in report["variants"]),
             "", f"ms/token: median of {report['options']['repeats']} calls per variant, calls alternating between "
                 f"the variants' workers (each a process of its own); ratio: a variant's ms/token over "
                 f"{names[0]}'s (below 1: faster). Load average: 1 minute, at the end of the scenario."]
    for load in report["loads"]:
        count = load["busy_processes"]
        rows = [r for r in report["results"] if r["busy_processes"] == count]
        lines += ["", f"## Busy processes: {count} (load average {load['load_average_1min']['start']} at the start, "
                      f"{load['load_average_1min']['end']} at the end)", "",
                  "| model | dtype | strategy | batch | new | " + " | ".join(f"{n} ms/token" for n in names) + " | "
                  + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " | load average |",
                  "|" + "---|" * (6 + 2 * len(names) - 1)]
        for label in dict.fromkeys(bench_timing.label(r) for r in rows):
            by = {r["variant"]: r for r in rows if bench_timing.label(r) == label}
            first = by[names[0]]
            times = [f"{by[n]['ms_per_token']:.2f}" if "error" not in by[n] else "failed" for n in names]
            ratios = [f"{by[n]['ms_per_token'] / first['ms_per_token']:.2f}"
                      if "error" not in by[n] and "error" not in first else "" for n in names[1:]]
            lines.append("| " + " | ".join([first["model"], first["dtype"], first["strategy"], str(first["batch_size"]),
                                            str(first["new_tokens"]), *times, *ratios,
                                            str(by[names[-1]]["load_average_1min"])]) + " |")
    failed = [r for r in report["results"] if "error" in r]
    lines += ["", *(f"- FAILED {r['variant']} {bench_timing.label(r)}: {r['error']}" for r in failed)]
    return "\n".join(lines).rstrip() + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="variants.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", nargs="+", action="append", required=True, metavar="WORD",
                        help="NAME REVISION [VAR=VALUE ...]: a variant (REVISION `.`: this working tree; or a folder "
                        "holding src/xlagen); two or more")
    parser.add_argument("--models", nargs="+", default=["gpt2"], choices=list(bench_timing.ARCHITECTURES))
    parser.add_argument("--strategies", nargs="+", default=["greedy"], choices=list(bench_timing.STRATEGIES))
    parser.add_argument("--batch-sizes", nargs="+", type=positive_int, default=[1, 8], metavar="B")
    parser.add_argument("--new-tokens", nargs="+", type=positive_int, default=[32], metavar="N")
    parser.add_argument("--dtype", nargs="+", default=["float32"], help="as xlagen bench's --dtype")
    parser.add_argument("--repeats", type=positive_int, default=7, help="timed calls per variant (default: 7)")
    parser.add_argument("--warmup", type=non_negative_int, default=1, help="untimed calls after the first")
    parser.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1,
                        help="TensorFlow's and the kernels' threads (default: all cores)")
    parser.add_argument("--load", nargs="+", type=non_negative_int, default=[0], metavar="N",
                        help="run the matrix once per N, beside N busy processes (default: 0)")
    parser.add_argument("--output-dir", type=Path, default=HERE / "results", metavar="DIR")
    parser.add_argument("--name", help="file name stem of the reports (default: variants-DATE-TIME)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        variants = [parse_variant(words) for words in args.variant]
    except ValueError as error:
        parser.error(str(error))
    if len(variants) < 2 or len({v.name for v in variants}) < len(variants):
        parser.error("--variant: give two or more, with different names")

    def progress(message: str) -> None:
        if not args.quiet:
            print(message, file=sys.stderr, flush=True)

    started = datetime.datetime.now(datetime.timezone.utc)
    scenarios = [bench_timing.Scenario(model, strategy, batch, new, "xla", dtype) for model in args.models
                 for dtype in args.dtype for strategy in args.strategies for batch in args.batch_sizes
                 for new in args.new_tokens]
    results, loads = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for variant in variants:
            checkout(variant, Path(scratch))
        envs = {variant.name: environment_of(variant) for variant in variants}
        for count in args.load:
            start = bench_timing.load_average()
            with bench_timing.busy_processes(count):
                for index, scenario in enumerate(scenarios):
                    order = variants if index % 2 == 0 else variants[::-1]  # who compiles and runs first
                    progress(f"[load {count}] {scenario.label()} ...")
                    for result in run_scenario(scenario, order, envs, args):
                        result.update(busy_processes=count, load_average_1min=bench_timing.load_average())
                        results.append(result)
                        progress(f"    {result['variant']}: " + bench_timing.describe(result))
                loads.append({"busy_processes": count, "load_average_1min": {"start": start,
                                                                           "end": bench_timing.load_average()}})
    command = ["python", "benchmarks/variants.py", *(w for v in args.variant for w in ("--variant", *v)),
               "--models", *args.models, "--strategies", *args.strategies,
               "--batch-sizes", *map(str, args.batch_sizes), "--new-tokens", *map(str, args.new_tokens),
               "--dtype", *args.dtype, "--repeats", str(args.repeats), "--warmup", str(args.warmup),
               "--threads", str(args.threads), "--load", *map(str, args.load)]
    report = {"schema": SCHEMA, "created": started.isoformat(timespec="seconds"),
              "seconds": round((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(), 1),
              "command": command, "machine": bench_timing.machine_info(), "variants": [v.record() for v in variants],
              "options": {"repeats": args.repeats, "warmup": args.warmup, "threads": args.threads},
              "loads": loads, "results": results}
    paths = bench_report.write_reports(report, args.output_dir, args.name or started.strftime("variants-%Y%m%d-%H%M%S"),
                                       markdown, None)
    print(markdown(report))
    progress("wrote " + ", ".join(str(p) for p in paths))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
