"""xlagen beside transformers 4.57 TensorFlow on the scenarios of `xlagen bench`, against the machine's
memory-bandwidth roofline.

    bash benchmarks/peer/setup_transformers_tf.sh      # once: the reference's environment
    python benchmarks/peer/compare.py --quick          # both systems, interleaved
    python benchmarks/peer/compare.py --models gpt2 opt t5 whisper --strategies greedy beam2 \
        --batch-sizes 1 8 --new-tokens 128 --modes xla --repeats 5 --threads 2

Every scenario gets a fresh worker process per system (this script with `--worker`; the reference's
runs with the python of its environment). The workers start one after the other (model build and
first call, so no compile overlaps a timed run), then stay alive while the driver asks them for one
timed call at a time, alternating A B, B A, A B, ... (and which system starts, from one scenario to
the next), so load from elsewhere on the machine hits both alike. Both systems are timed by the same
lines: `xlagen.cli.bench`'s measurement, which imports only the standard library at module level and
so loads in the reference's environment from this checkout's `src/`. The machine's read bandwidth is
measured before and after the scenarios (`bandwidth.py`). Reports: NAME.json, NAME.md, NAME.png in
--output-dir; the command exits 1 if a scenario failed (the reports keep the others).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPOSITORY = HERE.parents[1]
if importlib.util.find_spec("xlagen") is None:  # the reference's environment has no xlagen installed
    sys.path.insert(0, str(REPOSITORY / "src"))

import bandwidth  # noqa: E402 - after the path is set
from xlagen.cli import bench, bench_report, bench_timing  # noqa: E402
from xlagen.cli.common import positive_int  # noqa: E402

logger = logging.getLogger("compare")
SCHEMA = "xlagen-comparison/1"
RESULT_PREFIX = "XLAGEN_BENCH "  # marks the workers' JSON lines on stdout
REFERENCE = "transformers-tf"  # transformers_tf.NAME, without importing it here
REFERENCE_TITLE = "TF 4.57"
SYSTEMS = ("xlagen", REFERENCE)
BANDWIDTH_DEFAULTS = {"bandwidth_mib": 2048, "bandwidth_repeats": 3}
BANDWIDTH_TINY = {"bandwidth_mib": 64, "bandwidth_repeats": 1}
COLUMNS = [*bench_report.COLUMNS[:4], ("roofline", "roofline_fraction", "{:.2f}"), *bench_report.COLUMNS[4:]]


def system(name: str) -> bench_timing.TFSystem:
    if name == REFERENCE:
        import transformers_tf

        return transformers_tf.TransformersTF()
    return bench_timing.XlagenSystem()


# ----------------------------------------------------------------------------- worker

def _emit(record: dict) -> None:
    print(RESULT_PREFIX + json.dumps(record), flush=True)


def worker_main(args: argparse.Namespace) -> int:
    """`--worker SYSTEM --scenario JSON`: one scenario as a server for the driver (`Worker`).

    Prints (prefixed JSON lines) the system's versions and threads, then, after building the model
    and the first call, "ready" with its seconds; then times one call per stdin line giving the new
    tokens, answering "run" with the seconds, until stdin closes. A failure answers "error".
    """
    under_test = system(args.worker)
    _emit({"kind": "system", "system": under_test.name, "versions": under_test.versions(),
           "threads": bench_timing.configure_threads(args.threads), "env": bench_timing.environment()})
    try:
        scenario = bench_timing.Scenario(**json.loads(args.scenario))
        model = under_test.build(scenario.model, scenario.dtype)
        function, inputs, options = bench_timing.prepare(under_test, model, scenario)
        first = bench_timing.timed(function, inputs, options, scenario.new_tokens)
        _emit({"kind": "ready", "first_call_s": first, "weight_bytes": bandwidth.weight_bytes(model)})
        for line in sys.stdin:
            _emit({"kind": "run", "seconds": bench_timing.timed(function, inputs, options, int(line))})
    except Exception as error:  # Reported to the driver, which records it.
        logger.exception("%s worker failed", under_test.name)
        _emit({"kind": "error", "error": bench_timing.one_line(error)})
        return 1
    return 0


# ----------------------------------------------------------------------------- driver

def _worker_command(name: str, scenario: bench_timing.Scenario, args: argparse.Namespace) -> tuple[list[str], dict]:
    worker = ["--worker", name, "--threads", str(args.threads), "--scenario", json.dumps(asdict(scenario))]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    if name == "xlagen":
        return [sys.executable, __file__, *worker], env
    env["TF_USE_LEGACY_KERAS"] = "1"
    return [str(args.reference_python), str(args.reference_script), *worker], env


class Worker:
    """One scenario of one system in its own process (see `worker_main`), driven call by call.

    Starting it builds the model and makes the first call (trace + compile); `run(n)` then times one
    call of n new tokens. Raises RuntimeError with the worker's error or the end of its stderr.
    """

    def __init__(self, name: str, scenario: bench_timing.Scenario, args: argparse.Namespace):
        command, env = _worker_command(name, scenario, args)
        self.system = name
        self.stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 - lives as long as the worker; see close().
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.stderr, text=True, bufsize=1)
        self.info = self._expect("system")
        self.ready = self._expect("ready")

    def _expect(self, kind: str) -> dict:
        for line in self.process.stdout:
            if line.startswith(RESULT_PREFIX):
                record = json.loads(line[len(RESULT_PREFIX):])
                if record["kind"] == "error":
                    raise RuntimeError(record["error"])
                if record["kind"] == kind:
                    return record
        code = self.process.wait()
        self.stderr.seek(0)
        tail = [line for line in self.stderr.read().strip().splitlines() if line.strip()][-15:]
        logger.error("%s worker exited (%d):\n%s", self.system, code, "\n".join(tail))
        raise RuntimeError(f"worker exit {code}: {tail[-1] if tail else 'no message'}")

    def run(self, new_tokens: int) -> float:
        self.process.stdin.write(f"{new_tokens}\n")
        self.process.stdin.flush()
        return self._expect("run")["seconds"]

    def close(self) -> None:
        try:
            self.process.stdin.close()
            self.process.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        self.stderr.close()


def _as_run_by(name: str, scenario: bench_timing.Scenario) -> bench_timing.Scenario:
    """The scenario as system `name` runs it: the reference has no packed weights and runs float32, so that
    the ratio of a packed scenario is against the reference's float32."""
    return replace(scenario, dtype="float32") if name != "xlagen" and scenario.dtype in bench_timing.PACKED_DTYPES \
        else scenario


def run_interleaved(scenario: bench_timing.Scenario, names: list[str], args: argparse.Namespace,
                    systems: dict[str, dict]) -> list[dict]:
    """Runs one scenario with a worker per system, alternating their timed calls (A B, B A, A B, ...).

    The workers start (build, first call) one after the other, so no compile overlaps a timed run;
    then every timed call of one system sits between calls of the other.
    """
    workers, results, errors = {}, {}, {}
    run_as = {name: _as_run_by(name, scenario) for name in names}
    try:
        for name in names:
            try:
                workers[name] = Worker(name, run_as[name], args)
                systems.setdefault(name, {k: v for k, v in workers[name].info.items() if k != "kind"})
            except RuntimeError as error:
                errors[name] = str(error)
        repeats, warmup = bench_timing.repeats_of(scenario, args)
        runs: dict[str, list[float]] = {name: [] for name in workers}
        short: dict[str, list[float]] = {name: [] for name in workers}

        def alternate(new_tokens: int, count: int, store: dict[str, list[float]] | None) -> None:
            for index in range(count):
                for name in list(workers)[::-1 if index % 2 else 1]:
                    if name in errors:
                        continue
                    try:
                        seconds = workers[name].run(new_tokens)
                    except RuntimeError as error:
                        errors[name] = str(error)
                        continue
                    if store is not None:
                        store[name].append(seconds)

        alternate(scenario.new_tokens, warmup, None)
        alternate(scenario.new_tokens, repeats, runs)
        if args.ttft and scenario.new_tokens > 2:
            alternate(2, 1 + warmup, None)  # The first one compiles.
            alternate(2, repeats, short)
    finally:
        for worker in workers.values():
            worker.close()
    for name in names:
        if name in errors:
            results[name] = {"system": name, **asdict(run_as[name]), "error": errors[name]}
        else:
            ready = workers[name].ready
            results[name] = bench_timing.summarise(name, run_as[name], ready["first_call_s"], runs[name], short[name])
            results[name]["weight_bytes"] = ready["weight_bytes"]
        if run_as[name] != scenario:  # Paired with xlagen's scenario of this dtype.
            results[name]["paired_dtype"] = scenario.dtype
    return [results[name] for name in names]


def ratios(results: list[dict]) -> list[dict]:
    """xlagen / reference for each scenario both systems measured (the float32 reference against any xlagen
    dtype, from the reference run interleaved with that scenario)."""
    reference = {bench_timing.label(r): r for r in results if r["system"] == REFERENCE and "error" not in r}
    paired = []
    for result in results:
        other = reference.get(bench_timing.label(result))
        if result["system"] != "xlagen" or "error" in result or other is None:
            continue
        paired.append({**{k: result[k] for k in ("model", "strategy", "batch_size", "new_tokens", "mode")},
                       "dtype": result["dtype"], "speed_ratio": result["tokens_per_s"] / other["tokens_per_s"],
                       "first_call_ratio": result["first_call_s"] / other["first_call_s"]})
    return paired


def git_commit() -> str | None:
    """This checkout's commit, with "+dirty" when tracked files changed."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, timeout=10,
                                check=False)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                               capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if commit.returncode == 0 else None


def run_comparison(args: argparse.Namespace) -> int:
    """Measures bandwidth, runs every scenario in interleaved workers, writes the reports."""
    scenarios = bench.scenarios_from(args)
    started, load_start = datetime.datetime.now(datetime.timezone.utc), bench_timing.load_average()
    bench.progress(args, f"bandwidth: reading {args.bandwidth_mib} MiB x {args.bandwidth_repeats} ...")
    measured = [bandwidth.measure_bandwidth(args.bandwidth_mib, args.bandwidth_repeats)]
    native = bandwidth.measure_native_bandwidth(args.bandwidth_mib, args.bandwidth_repeats)
    results: list[dict] = []
    systems: dict[str, dict] = {}
    for index, scenario in enumerate(scenarios):
        names = args.systems if index % 2 == 0 else args.systems[::-1]  # Alternate who compiles and runs first.
        bench.progress(args, f"[{index + 1}/{len(scenarios)}] {scenario.label()} ...")
        for result in run_interleaved(scenario, names, args, systems):
            results.append(result)
            bench.progress(args, "    " + bench_timing.describe(result))
    measured.append(bandwidth.measure_bandwidth(args.bandwidth_mib, args.bandwidth_repeats))
    machine = bench_timing.machine_info()
    machine["load_average_1min"] = {"start": load_start, "end": bench_timing.load_average()}
    machine["git_commit"] = git_commit()
    command = bench.command_line(args, ["python", "benchmarks/peer/compare.py"])
    command += ["--systems", *args.systems, "--bandwidth-mib", str(args.bandwidth_mib), "--bandwidth-repeats",
                str(args.bandwidth_repeats)]
    report = {"schema": SCHEMA, "created": started.isoformat(timespec="seconds"),
              "seconds": round((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(), 1),
              "command": command, "machine": machine, "systems": systems,
              "bandwidth": bandwidth.combine(measured, native),
              "options": {k: getattr(args, k) for k in bench.DEFAULTS} | {"threads": args.threads, "dtype": args.dtype,
                                                                           "ttft": args.ttft},
              "results": results}
    bandwidth.add_rooflines(report)
    report["ratios"] = ratios(results)
    paths = bench_report.write_reports(report, Path(args.output_dir), args.name or started.strftime("compare-%Y%m%d-%H%M%S"),
                                markdown, plot if not args.no_plot else None)
    print(markdown(report))
    bench.progress(args, "wrote " + ", ".join(str(p) for p in paths))
    return 1 if any("error" in r for r in results) else 0


# ----------------------------------------------------------------------------- reports

def markdown(report: dict) -> str:
    """The report as markdown: machine, bandwidth, one row per xlagen scenario with the reference's figures
    beside it (when measured) and the ratio of tokens/s."""
    results = report["results"]
    columns = bench_report.columns_of(results, COLUMNS)
    by_system = {(r["system"], bench_timing.label(r)): r for r in results}
    rows = [r for r in results if r["system"] != REFERENCE] or results
    has_reference = rows is not results
    header = ["model", "dtype", "strategy", "batch", "new", "mode", *(name for name, _, _ in columns)]
    if has_reference:
        header += [f"{REFERENCE_TITLE} {name}" for name, _, _ in columns] + [f"xlagen / {REFERENCE_TITLE} tokens/s"]
    legend = (bench_report.LEGEND + " roofline: steps/s over BLAS bandwidth / weight bytes. "
              f"{REFERENCE_TITLE}: transformers 4.57 TensorFlow.")
    lines = [*bench_report.header_lines(report, f"xlagen and transformers 4.57 TensorFlow ({REFERENCE_TITLE})"),
             bandwidth.describe(report["bandwidth"], report["machine"]["env"]), "", legend, "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for result in rows:
        cells = [*bench_report.scenario_cells(result), *bench_report.cells(result, columns)]
        if has_reference:
            other = by_system.get((REFERENCE, bench_timing.label(result)))
            both = other is not None and "error" not in other and "error" not in result
            cells += [*bench_report.cells(other, columns),
                      f"{result['tokens_per_s'] / other['tokens_per_s']:.2f}x" if both else ""]
        lines.append("| " + " | ".join(cells) + " |")
    lines += bench_report.derived(results)
    failed = [r for r in results if "error" in r]
    lines += ["", *(f"- FAILED {r['system']} {bench_timing.label(r)}: {r['error']}" for r in failed)]
    return "\n".join(lines).rstrip() + "\n"


def plot(report: dict, path: Path) -> bool:
    """Tokens/s (log scale, roofline marked, xlagen / reference above xlagen's bars) and first-call seconds."""
    names = list(dict.fromkeys(r["system"] for r in report["results"] if "error" not in r))
    charts = bench_report.bar_charts(report, names, {REFERENCE: "transformers 4.57 TensorFlow"})
    if charts is None:
        return False
    figure, speed, compile_, centres, labels = charts
    by = {(r["system"], bench_timing.label(r)): r for r in report["results"] if "error" not in r}
    width = 0.8 / len(names)
    for ratio in report.get("ratios", []):
        key = bench_timing.label(ratio)
        if ("xlagen", key) in by:
            speed.annotate(f"{ratio['speed_ratio']:.2f}x", (labels.index(key) + names.index("xlagen") * width,
                           by["xlagen", key]["tokens_per_s"]), ha="center", va="bottom", fontsize=8)
    speed.scatter(centres, [max(r["roofline_tokens_per_s_blas"] for (_, k), r in by.items() if k == key)
                            for key in labels], marker="_", s=600, color="black", label="roofline (BLAS bandwidth)")
    figure.suptitle(f"{report['machine'].get('cpu')}, {report['machine'].get('usable_cores')} cores, BLAS read "
                    f"{report['bandwidth']['blas_gbs']:.1f} GB/s", fontsize=10)
    bench_report.finish_plot(figure, (speed, compile_), centres, labels, path)
    return True


# ----------------------------------------------------------------------------- command line

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="compare.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    bench.add_scenario_arguments(parser, f"of {', '.join(bench_timing.ARCHITECTURES)} (random weights); default: gpt2")
    machine = parser.add_argument_group("bandwidth and systems")
    machine.add_argument("--bandwidth-mib", type=positive_int, help="array read for the bandwidth (default: 2048)")
    machine.add_argument("--bandwidth-repeats", type=positive_int,
                         help="runs over each of 3 fresh arrays, before and after the scenarios (default: 3)")
    machine.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS),
                         help="the systems to run, each scenario in interleaved workers (default: both)")
    machine.add_argument("--reference-python", type=Path, default=REPOSITORY / "benchmarks" / ".peer-venv" / "bin" /
                         "python", help="python of the reference's environment (default: benchmarks/.peer-venv/bin/"
                         "python, made by benchmarks/peer/setup_transformers_tf.sh)")
    machine.add_argument("--reference-script", type=Path, default=Path(__file__),
                         help="the worker script the reference's python runs (default: this file)")
    bench.add_output_arguments(parser, "benchmarks/results")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--scenario", help=argparse.SUPPRESS)
    return parser


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed options, unset ones filled from --tiny / --quick and the defaults."""
    args = bench.resolve_arguments(build_parser().parse_args(argv))
    for name, default in BANDWIDTH_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, (BANDWIDTH_TINY if args.tiny else BANDWIDTH_DEFAULTS)[name])
    unknown = [model for model in args.models if model not in bench_timing.ARCHITECTURES]
    if unknown:  # a checkpoint would need the reference to load it too
        build_parser().error(f"--models: unknown {' '.join(unknown)} (known: {', '.join(bench_timing.ARCHITECTURES)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.worker:
        return worker_main(args)
    if REFERENCE in args.systems and not args.reference_python.exists():
        print(f"compare.py: error: {args.reference_python} not found: run `bash benchmarks/peer/"
              "setup_transformers_tf.sh` first or give --reference-python", file=sys.stderr)
        return 2
    if REFERENCE in args.systems and not args.reference_script.is_file():
        print(f"compare.py: error: {args.reference_script} not found: give --reference-script", file=sys.stderr)
        return 2
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return run_comparison(args)


if __name__ == "__main__":
    sys.exit(main())
