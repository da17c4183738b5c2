"""xlagen beside a reference (transformers 4.57 TensorFlow, or CTranslate2) on the scenarios of `xlagen bench`,
against the machine's memory-bandwidth roofline.

    bash benchmarks/peer/setup_transformers_tf.sh      # once: the reference's environment
    python benchmarks/peer/compare.py --quick          # both systems, interleaved
    python benchmarks/peer/compare.py --models gpt2 opt t5 whisper --strategies greedy beam2 \
        --batch-sizes 1 8 --new-tokens 128 --modes xla --repeats 5 --threads 2
    bash benchmarks/peer/setup_ctranslate2.sh          # once: CTranslate2's environment
    python benchmarks/peer/compare.py --reference ctranslate2 --quick --dtype float32 int8-weights

A reference is a module of this folder (`REFERENCES`) with its system class (`SYSTEM`), its titles, its
environment (`VENV`, made by `SETUP`) and the dtypes it runs beside each of xlagen's (`paired_dtypes`:
CTranslate2 runs both its int8 compute types beside xlagen's int8 weights, for instance).

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
from dataclasses import asdict, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPOSITORY = HERE.parents[1]
if importlib.util.find_spec("xlagen") is None:  # the reference's environment has no xlagen installed
    sys.path.insert(0, str(REPOSITORY / "src"))

import bandwidth  # noqa: E402 - after the path is set
import workers  # noqa: E402
from xlagen.cli import bench, bench_report, bench_timing  # noqa: E402
from xlagen.cli.common import positive_int  # noqa: E402

logger = logging.getLogger("compare")
SCHEMA = "xlagen-comparison/1"
RESULT_PREFIX = workers.RESULT_PREFIX  # marks the workers' JSON lines on stdout
# reference name -> its module in this folder (imported by the driver too: they import only the standard library)
REFERENCES = {"transformers-tf": "transformers_tf", "ctranslate2": "ctranslate2_system"}
SYSTEMS = ("xlagen", *REFERENCES)
BANDWIDTH_DEFAULTS = {"bandwidth_mib": 2048, "bandwidth_repeats": 3}
BANDWIDTH_TINY = {"bandwidth_mib": 64, "bandwidth_repeats": 1}
COLUMNS = [*bench_report.COLUMNS[:4], ("roofline", "roofline_fraction", "{:.2f}"), *bench_report.COLUMNS[4:]]


def reference_module(name: str):
    """The module of reference `name` (a key of `REFERENCES`)."""
    return importlib.import_module(REFERENCES[name])


def system(name: str) -> bench_timing.TFSystem:
    return bench_timing.XlagenSystem() if name == "xlagen" else reference_module(name).SYSTEM()


def reference_of(results: list[dict]) -> str | None:
    """The reference system of a run's results (the system that is not xlagen), or None."""
    return next((r["system"] for r in results if r["system"] != "xlagen"), None)


# ----------------------------------------------------------------------------- worker

def _emit(record: dict) -> None:
    print(RESULT_PREFIX + json.dumps(record), flush=True)


def worker_main(args: argparse.Namespace) -> int:
    """`--worker SYSTEM --scenario JSON`: one scenario as a server for the driver (`Worker`).

    Prints (prefixed JSON lines) the system's versions and threads (and stops there without --scenario),
    then, after building the model and the first call, "ready" with its seconds; then times one call per
    stdin line giving the new tokens, answering "run" with the seconds, until stdin closes. A failure
    answers "error".
    """
    under_test = system(args.worker)
    _emit({"kind": "system", "system": under_test.name, "versions": under_test.versions(),
           "threads": (under_test.configure_threads(args.threads, args.xla_threads) if args.xla_threads else
                       under_test.configure_threads(args.threads)), "env": under_test.environment()})
    if args.scenario is None:
        return 0
    try:
        scenario = bench_timing.Scenario(**json.loads(args.scenario))
        model = under_test.build(scenario.model, scenario.dtype)
        if args.build_only:
            _emit({"kind": "built"})
            return 0
        function, inputs, options = under_test.prepare(model, scenario)
        first = bench_timing.timed(function, inputs, options, scenario.new_tokens)
        weight_bytes = getattr(under_test, "weight_bytes", bandwidth.weight_bytes)(model)
        _emit({"kind": "ready", "first_call_s": first, "weight_bytes": weight_bytes})
        for line in sys.stdin:
            _emit({"kind": "run", "seconds": bench_timing.timed(function, inputs, options, int(line))})
    except Exception as error:  # Reported to the driver, which records it.
        logger.exception("%s worker failed", under_test.name)
        _emit({"kind": "error", "error": bench_timing.one_line(error)})
        return 1
    return 0


# ----------------------------------------------------------------------------- driver

def _worker_command(name: str, scenario: bench_timing.Scenario | None,
                    args: argparse.Namespace, build_only: bool = False) -> tuple[list[str], dict]:
    worker = ["--worker", name, "--threads", str(args.threads), *(["--build-only"] if build_only else [])]
    worker += ["--scenario", json.dumps(asdict(scenario))] if scenario else []
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    if name == "xlagen":
        if args.xla_threads:  # XLA's own pool apart, the kernels' pool keeps --threads
            worker += ["--xla-threads", str(args.xla_threads)]
            env["XLAGEN_NATIVE_THREADS"] = str(args.threads)
        return [sys.executable, __file__, *worker], env
    env = {**reference_module(name).WORKER_ENV, **env, **args.reference_env}
    return [str(args.reference_python), str(args.reference_script), *worker], env


def start_worker(name: str, scenario: bench_timing.Scenario | None, args: argparse.Namespace,
                 build_only: bool = False) -> workers.Worker:
    """A worker of system `name` for `scenario` (None: it only reports its system), started and waited for
    (see `workers.Worker`); with `build_only` it builds the model and exits."""
    command, env = _worker_command(name, scenario, args, build_only)
    return workers.Worker(name, command, env, None if scenario is None else "built" if build_only else "ready")


def probe(name: str, args: argparse.Namespace) -> dict:
    """System `name`'s versions, threads and environment, from a worker started without a scenario."""
    worker = start_worker(name, None, args)
    worker.close()
    return {k: v for k, v in worker.info.items() if k != "kind"}


def _as_run_by(name: str, scenario: bench_timing.Scenario, systems: dict[str, dict]) -> list[bench_timing.Scenario]:
    """The scenarios system `name` runs beside xlagen's `scenario`: its dtypes by the reference's `paired_dtypes`
    (given the compute types of its probe in `systems`, when it has any)."""
    if name == "xlagen":
        return [scenario]
    compute_types = systems.get(name, {}).get("versions", {}).get("compute_types")
    return [replace(scenario, dtype=d) for d in reference_module(name).paired_dtypes(scenario.dtype, compute_types)]


def run_interleaved(scenario: bench_timing.Scenario, names: list[str], args: argparse.Namespace,
                    systems: dict[str, dict]) -> list[dict]:
    """Runs one scenario with a worker per system and dtype it runs (`_as_run_by`), alternating their timed
    calls (A B C, C B A, A B C, ...); with --one-worker-at-a-time, alternating their workers instead.

    The workers start (build, first call) one after the other, so no compile overlaps a timed run;
    then every timed call of one worker sits between calls of the others.
    """
    run_as = [(name, run) for name in names for run in _as_run_by(name, scenario, systems)]

    def start(index: int, timing: dict) -> workers.Worker | None:
        name, run = run_as[index]
        try:
            worker = start_worker(name, run, args)
        except RuntimeError as error:
            timing[index]["error"] = str(error)
            return None
        systems.setdefault(name, {k: v for k, v in worker.info.items() if k != "kind"})
        timing[index].setdefault("ready", worker.ready)
        return worker

    schedule = workers.alternate_workers if args.one_worker_at_a_time else workers.alternate_calls
    timing = schedule(len(run_as), start, scenario.new_tokens, *bench_timing.repeats_of(scenario, args),
                      args.ttft)
    results = []
    for index, (name, run) in enumerate(run_as):
        if "error" in timing[index]:
            result = {"system": name, **asdict(run), "error": timing[index]["error"]}
        else:
            ready = timing[index]["ready"]
            result = bench_timing.summarise(name, run, ready["first_call_s"], timing[index]["runs"],
                                            timing[index]["short"])
            result["weight_bytes"] = ready["weight_bytes"]
            if name != "xlagen" and not reference_module(name).COMPILES:  # its first call is a run like the others
                del result["compile_s"]
        if run != scenario:  # Paired with xlagen's scenario of this dtype.
            result["paired_dtype"] = scenario.dtype
        results.append(result)
    return results


def build_references(scenarios: list[bench_timing.Scenario], args: argparse.Namespace,
                     systems: dict[str, dict]) -> None:
    """Builds each reference model the scenarios need once, alone (CTranslate2 converts it from a PyTorch
    model: no other worker holds memory meanwhile); a failure is left for its scenario to report."""
    built = set()
    for scenario in scenarios:
        for name in args.systems:
            for run in _as_run_by(name, scenario, systems) if name != "xlagen" else []:
                if (name, run.model, run.dtype) in built:
                    continue
                built.add((name, run.model, run.dtype))
                bench.progress(args, f"building {name} {run.model} {run.dtype} ...")
                try:
                    start_worker(name, run, args, build_only=True).close()
                except RuntimeError as error:
                    logger.warning("%s %s %s: %s", name, run.model, run.dtype, error)


def _beside(results: list[dict]) -> dict[str, list[dict]]:
    """The reference's results by the label of the xlagen scenario they ran beside."""
    reference = reference_of(results)
    beside: dict[str, list[dict]] = {}
    for result in results:
        if result["system"] == reference:
            beside.setdefault(bench_timing.label(result), []).append(result)
    return beside


def ratios(results: list[dict]) -> list[dict]:
    """xlagen / reference for each scenario both systems measured, one per reference dtype run beside it
    (`reference_best` marks the reference's fastest of them)."""
    paired = []
    for key, others in _beside(results).items():
        others = [o for o in others if "error" not in o]
        best = max(others, key=lambda o: o["tokens_per_s"], default=None)
        for result in results:
            if result["system"] != "xlagen" or "error" in result or bench_timing.label(result) != key:
                continue
            paired += [{**{k: result[k] for k in ("model", "strategy", "batch_size", "new_tokens", "mode",
                                                  "prompt_tokens")},
                        "dtype": result["dtype"], "reference_dtype": other["dtype"], "reference_best": other is best,
                        "speed_ratio": result["tokens_per_s"] / other["tokens_per_s"],
                        "first_call_ratio": result["first_call_s"] / other["first_call_s"]} for other in others]
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
    scenarios = bench.scenarios_from(args) + prefill_scenarios(args)
    started, load_start = datetime.datetime.now(datetime.timezone.utc), bench_timing.load_average()
    bench.progress(args, f"bandwidth: reading {args.bandwidth_mib} MiB x {args.bandwidth_repeats} ...")
    measured = [bandwidth.measure_bandwidth(args.bandwidth_mib, args.bandwidth_repeats)]
    native = bandwidth.measure_native_bandwidth(args.bandwidth_mib, args.bandwidth_repeats)
    results: list[dict] = []
    systems = {name: probe(name, args) for name in args.systems if name != "xlagen"}  # its compute types
    build_references(scenarios, args, systems)
    with bench_timing.busy_processes(args.load):  # the bandwidth is measured without them
        for index, scenario in enumerate(scenarios):
            names = args.systems if index % 2 == 0 else args.systems[::-1]  # Alternate who compiles and runs first.
            bench.progress(args, f"[{index + 1}/{len(scenarios)}] {scenario.label()} ...")
            for result in run_interleaved(scenario, names, args, systems):
                result["load_average_1min"] = bench_timing.load_average()
                results.append(result)
                bench.progress(args, "    " + bench_timing.describe(result))
        load_end = bench_timing.load_average()
    measured.append(bandwidth.measure_bandwidth(args.bandwidth_mib, args.bandwidth_repeats))
    machine = bench_timing.machine_info()
    machine["load_average_1min"] = {"start": load_start, "end": load_end}
    machine["busy_processes"] = args.load
    machine["git_commit"] = git_commit()
    command = bench.command_line(args, ["python", "benchmarks/peer/compare.py"])
    command += ["--reference", args.reference, "--systems", *args.systems, "--bandwidth-mib", str(args.bandwidth_mib),
                "--bandwidth-repeats", str(args.bandwidth_repeats)]
    command += ["--prefill-tokens", str(args.prefill_tokens)] if args.prefill_tokens else []
    command += ["--one-worker-at-a-time"] if args.one_worker_at_a_time else []
    command += ["--xla-threads", str(args.xla_threads)] if args.xla_threads else []
    command += ["--reference-env", *(f"{k}={v}" for k, v in args.reference_env.items())] if args.reference_env else []
    report = {"schema": SCHEMA, "created": started.isoformat(timespec="seconds"),
              "seconds": round((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(), 1),
              "command": command, "machine": machine, "systems": systems,
              "bandwidth": bandwidth.combine(measured, native),
              "options": {k: getattr(args, k) for k in bench.DEFAULTS} | {"threads": args.threads, "dtype": args.dtype,
                                                                           "ttft": args.ttft,
                                                                           "reference": args.reference,
                                                                           "prefill_tokens": args.prefill_tokens,
                                                                           "one_worker_at_a_time":
                                                                               args.one_worker_at_a_time,
                                                                           "reference_env": args.reference_env,
                                                                           "xla_threads": args.xla_threads,
                                                                           "load": args.load},
              "results": results}
    bandwidth.add_rooflines(report)
    report["ratios"] = ratios(results)
    paths = bench_report.write_reports(report, Path(args.output_dir), args.name or started.strftime("compare-%Y%m%d-%H%M%S"),
                                markdown, plot if not args.no_plot else None)
    print(markdown(report))
    bench.progress(args, "wrote " + ", ".join(str(p) for p in paths))
    return 1 if any("error" in r for r in results) else 0


def prefill_scenarios(args: argparse.Namespace) -> list[bench_timing.Scenario]:
    """With --prefill-tokens P: time to first token, one greedy call of 1 new token at batch 1 per model and
    dtype, from a P-token prompt (Whisper: from its 30 s of audio features, i.e. encoder and first step)."""
    if not args.prefill_tokens:
        return []
    return [bench_timing.Scenario(model, "greedy", 1, 1, "xla", dtype,
                                  bench_timing.PROMPT_TOKENS if model == "whisper" else args.prefill_tokens)
            for model in args.models for dtype in args.dtype]


# ----------------------------------------------------------------------------- reports

def markdown(report: dict) -> str:
    """The report as markdown: machine, bandwidth, one row per xlagen scenario and reference dtype run beside it,
    with the reference's figures (when measured) and the ratio of tokens/s."""
    results = report["results"]
    columns = bench_report.columns_of(results, COLUMNS)
    reference = reference_of(results)
    beside = _beside(results)
    rows = [r for r in results if r["system"] == "xlagen"] or results
    has_reference = reference is not None and rows is not results
    header = ["model", "dtype", "strategy", "batch", "new", "mode", *(name for name, _, _ in columns)]
    title = "xlagen bench"
    env = ""
    legend = (bench_report.LEGEND + " roofline: steps/s over BLAS bandwidth / weight bytes. new 1: the call makes "
              "the first token only, so its ms/token is the time to first token (prefill of the prompt, or Whisper's "
              "encoder, and one step).")
    if has_reference:
        module = reference_module(reference)
        header += [f"{module.TITLE} dtype", *(f"{module.TITLE} {name}" for name, _, _ in columns),
                   f"xlagen / {module.TITLE} tokens/s"]
        title = f"xlagen and {module.DESCRIPTION} ({module.TITLE})"
        legend += f" {module.TITLE}: {module.DESCRIPTION}; its dtype: the one it ran beside xlagen's."
        env = f"- {reference} environment: " + ", ".join(
            f"{k}={v}" for k, v in report["systems"].get(reference, {}).get("env", {}).items() if v is not None)
    lines = [*bench_report.header_lines(report, title), *([env] if env else []),
             bandwidth.describe(report["bandwidth"], report["machine"]["env"]), "", legend, "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for result in rows:
        mine = [*bench_report.scenario_cells(result), *bench_report.cells(result, columns)]
        if result["prompt_tokens"] != bench_timing.PROMPT_TOKENS:
            mine[4] += f" (prompt {result['prompt_tokens']})"
        for other in beside.get(bench_timing.label(result), [None]) if has_reference else [None]:
            cells = list(mine)
            if has_reference:
                both = other is not None and "error" not in other and "error" not in result
                cells += [other["dtype"] if other else "", *bench_report.cells(other, columns),
                          f"{result['tokens_per_s'] / other['tokens_per_s']:.2f}x" if both else ""]
            lines.append("| " + " | ".join(cells) + " |")
    lines += bench_report.derived(results)
    failed = [r for r in results if "error" in r]
    lines += ["", *(f"- FAILED {r['system']} {bench_timing.label(r)}: {r['error']}" for r in failed)]
    return "\n".join(lines).rstrip() + "\n"


def plot(report: dict, path: Path) -> bool:
    """Tokens/s (log scale, roofline marked, xlagen / the reference's best above xlagen's bars) and first-call
    seconds; a reference that ran several dtypes has a bar per dtype."""
    results = [r for r in report["results"] if "error" not in r]
    reference = reference_of(results)
    if len({r["dtype"] for r in results if r["system"] == reference}) > 1:
        results = [dict(r, system=f"{reference} {r['dtype']}") if r["system"] == reference else r for r in results]
    names = list(dict.fromkeys(r["system"] for r in results))
    titles = {reference: reference_module(reference).DESCRIPTION} if reference in names else {}
    charts = bench_report.bar_charts(dict(report, results=results), names, titles)
    if charts is None:
        return False
    figure, speed, compile_, centres, labels = charts
    by = {(r["system"], bench_timing.label(r)): r for r in results}
    width = 0.8 / len(names)
    for ratio in report.get("ratios", []):
        key = bench_timing.label(ratio)
        if ("xlagen", key) in by and ratio.get("reference_best", True):
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
    machine.add_argument("--reference", choices=REFERENCES, help="the system xlagen is compared with (default: "
                         "the one named in --systems, else transformers-tf)")
    machine.add_argument("--systems", nargs="+", choices=SYSTEMS,
                         help="the systems to run, each scenario in interleaved workers (default: xlagen and the "
                         "reference)")
    machine.add_argument("--reference-python", type=Path, help="python of the reference's environment (default: "
                         "benchmarks/.peer-venv/bin/python for transformers-tf, made by setup_transformers_tf.sh; "
                         "benchmarks/.ct2-venv/bin/python for ctranslate2, made by setup_ctranslate2.sh)")
    machine.add_argument("--reference-script", type=Path, default=Path(__file__),
                         help="the worker script the reference's python runs (default: this file)")
    machine.add_argument("--reference-env", nargs="+", default=[], metavar="NAME=VALUE",
                         help="environment variables of the reference's workers, e.g. CT2_FORCE_CPU_ISA=AVX2 "
                         "CT2_USE_EXPERIMENTAL_PACKED_GEMM=1 OMP_WAIT_POLICY=PASSIVE (recorded in the report)")
    machine.add_argument("--one-worker-at-a-time", action="store_true",
                         help="for models two of which do not fit in memory together: the systems' workers run "
                         "in turn (A B, then fresh B A), each half of the repeats, rather than side by side")
    machine.add_argument("--xla-threads", type=positive_int, metavar="N",
                         help="xlagen only: N threads in TensorFlow's intra-op pool, where XLA runs its own operations "
                         "(default: --threads); xlagen's kernels keep --threads (XLAGEN_NATIVE_THREADS)")
    machine.add_argument("--prefill-tokens", type=positive_int, metavar="P",
                         help="also time the first token (greedy, batch 1, 1 new token) from a P-token prompt per "
                         "model and dtype (Whisper: from its 30 s of audio)")
    bench.add_output_arguments(parser, "benchmarks/results")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--scenario", help=argparse.SUPPRESS)
    parser.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
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
    return resolve_reference(args)


def resolve_reference(args: argparse.Namespace) -> argparse.Namespace:
    """Settles --reference, --systems, --reference-python and --reference-env (a dict) with each other.

    Raises:
        SystemExit: (usage error) for two references, or a --systems reference other than --reference.
    """
    named = [name for name in args.systems or [] if name != "xlagen"]
    if len(set(named)) > 1 or (named and args.reference not in (None, named[0])):
        build_parser().error(f"--systems {' '.join(args.systems)}: one reference at a time, the one of --reference "
                             f"({args.reference or 'transformers-tf'})")
    args.reference = args.reference or (named[0] if named else "transformers-tf")
    args.systems = args.systems or ["xlagen", args.reference]
    module = reference_module(args.reference)
    args.reference_python = args.reference_python or REPOSITORY / "benchmarks" / module.VENV / "bin" / "python"
    malformed = [item for item in args.reference_env if "=" not in item or item.startswith("=")]
    if malformed:
        build_parser().error(f"--reference-env: {' '.join(malformed)}: give NAME=VALUE")
    args.reference_env = dict(item.split("=", 1) for item in args.reference_env)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.worker:
        return worker_main(args)
    if args.reference in args.systems and not args.reference_python.exists():
        print(f"compare.py: error: {args.reference_python} not found: run `bash benchmarks/peer/"
              f"{reference_module(args.reference).SETUP}` first or give --reference-python", file=sys.stderr)
        return 2
    if args.reference in args.systems and not args.reference_script.is_file():
        print(f"compare.py: error: {args.reference_script} not found: give --reference-script", file=sys.stderr)
        return 2
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return run_comparison(args)


if __name__ == "__main__":
    sys.exit(main())
