"""The reports of `xlagen bench`: markdown (a row per scenario, ratios within the run) and a PNG of
tokens/s and first-call seconds (with matplotlib, the `bench` extra)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from xlagen.cli.bench_timing import PACKED_DTYPES, label

logger = logging.getLogger("xlagen.cli.bench")

_KEY = ("model", "strategy", "batch_size", "new_tokens", "mode", "prompt_tokens")
COLUMNS = [("first call s", "first_call_s", "{:.2f}"), ("trace + compile s", "compile_s", "{:.2f}"),
           ("ms/token", "ms_per_token", "{:.2f}"), ("tokens/s", "tokens_per_s", "{:.1f}"),
           ("TTFT ms", "ttft_ms", "{:.1f}"), ("decode ms/token", "decode_ms_per_token", "{:.2f}")]


def columns_of(results: list[dict], columns: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The `columns` (name, result field, format) some result has a value for; at least the first four."""
    return [c for c in columns if any(c[1] in r for r in results)] or columns[:4]


def cells(result: dict | None, columns: list[tuple[str, str, str]]) -> list[str]:
    """A result's table cells: its formatted values, "failed", or empty cells when there is no result."""
    if result is None or "error" in result:
        return ["failed" if result else ""] + [""] * (len(columns) - 1)
    return [form.format(result[field]) if field in result else "" for _, field, form in columns]


def derived(results: list[dict]) -> list[str]:
    """Per system, XLA: beam / greedy ms/token, ms/token at N / at the shortest N, and packed / float32
    tokens/s, as markdown list lines under a heading (none when nothing pairs up)."""
    ok = [r for r in results if "error" not in r and r["mode"] == "xla"]
    index = {(r["system"], r.get("paired_dtype", r["dtype"])) + tuple(r[k] for k in _KEY): r for r in ok}
    lines = []
    for r in ok:
        where = f"{r['system']} {r['model']} {r['dtype']} b{r['batch_size']}" + (
            f" (run beside {r['paired_dtype']})" if "paired_dtype" in r else "")
        dtype = r.get("paired_dtype", r["dtype"])
        prompt = r["prompt_tokens"]
        greedy = index.get((r["system"], dtype, r["model"], "greedy", r["batch_size"], r["new_tokens"], "xla", prompt))
        if r["strategy"] != "greedy" and greedy:
            lines.append(f"- {where} n{r['new_tokens']}: {r['strategy']} / greedy ms/token = "
                         f"{r['ms_per_token'] / greedy['ms_per_token']:.2f}")
        same = (r["system"], dtype, r["model"], r["strategy"], r["batch_size"], prompt)
        shortest = min(o["new_tokens"] for o in ok if (o["system"], o.get("paired_dtype", o["dtype"]), o["model"],
                                                       o["strategy"], o["batch_size"], o["prompt_tokens"]) == same)
        base = index.get((r["system"], dtype, r["model"], r["strategy"], r["batch_size"], shortest, "xla", prompt))
        if r["new_tokens"] > shortest and base:
            lines.append(f"- {where} {r['strategy']}: ms/token n{r['new_tokens']} / n{shortest} = "
                         f"{r['ms_per_token'] / base['ms_per_token']:.2f}")
        if r["dtype"] in PACKED_DTYPES:
            full = index.get((r["system"], "float32") + tuple(r[k] for k in _KEY))
            if full:
                lines.append(f"- {where} {r['strategy']} n{r['new_tokens']}: tokens/s {r['dtype']} / float32 = "
                             f"{r['tokens_per_s'] / full['tokens_per_s']:.2f}")
    return ["", "Ratios within a system (XLA):", "", *lines] if lines else []


def header_lines(report: dict, title: str) -> list[str]:
    """The report's title and its machine, versions, threads and command lines."""
    machine = report["machine"]
    versions = "; ".join(f"{s}: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items())
                         for s, info in report["systems"].items())
    # TensorFlow's pools, or another library's; and xlagen's kernels' pool where it was set.
    pools = [(s, info["threads"], (info.get("env") or {}).get("XLAGEN_NATIVE_THREADS"))
             for s, info in report["systems"].items()]
    threads = "; ".join(f"{s}: intra {t.get('tf_intra_op', t.get('intra_threads'))} / inter "
                        f"{t.get('tf_inter_op', t.get('inter_threads'))}" + (f" / kernels {k}" if k else "")
                        for s, t, k in pools)
    return [f"# {title}", "",
            (f"- Machine: {machine.get('cpu')}, {machine.get('usable_cores')} cores, "
             f"{machine.get('memory_gib')} GiB; flags: {' '.join(machine.get('cpu_flags', []))}; load average "
             f"(1 min) at start / end: {' / '.join(map(str, machine.get('load_average_1min', {}).values()))}"
             + (f"; {machine['busy_processes']} busy processes beside the scenarios (`--load`)"
                if machine.get("busy_processes") else "")),
            f"- Versions: {versions}", f"- Threads: {threads}", f"- Command: `{' '.join(report['command'])}`"]


LEGEND = ("first call: trace + compile + one run (eager: the first run); trace + compile: the first call minus the "
           "median run. ms/token: median seconds of one generate call / new tokens, i.e. per decoding step for all "
           "rows and beams. tokens/s: all rows.")


def markdown(report: dict) -> str:
    """The report as markdown: machine, versions, one row per scenario, ratios within the run."""
    results = report["results"]
    columns = columns_of(results, COLUMNS)
    header = ["model", "dtype", "strategy", "batch", "new", "mode", *(name for name, _, _ in columns)]
    lines = [*header_lines(report, "xlagen bench"), "", LEGEND, "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for result in results:
        lines.append("| " + " | ".join([*scenario_cells(result), *cells(result, columns)]) + " |")
    lines += derived(results)
    lines += ["", *(f"- FAILED {r['system']} {label(r)}: {r['error']}" for r in results if "error" in r)]
    return "\n".join(lines).rstrip() + "\n"


def scenario_cells(result: dict) -> list[str]:
    """The model, dtype, strategy, batch, new and mode cells of a result's row."""
    return [result["model"], result["dtype"], result["strategy"], str(result["batch_size"]),
            str(result["new_tokens"]), result["mode"]]


def bar_charts(report: dict, names: list[str], titles: dict[str, str] | None = None):
    """A figure of tokens/s (log scale) and first-call seconds per scenario, one bar per system in `names`
    (labelled by `titles`, default the names); returns (figure, speed axis, first-call axis, bar centres, scenario labels), or None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        logger.warning("matplotlib is not installed (pip install 'xlagen[bench]'): no plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in report["results"] if "error" not in r]
    labels = list(dict.fromkeys(label(r) for r in results))
    by = {(r["system"], label(r)): r for r in results}
    width = 0.8 / len(names)
    centres = [i + 0.4 - width / 2 for i in range(len(labels))]
    figure, (speed, compile_) = plt.subplots(1, 2, figsize=(max(10, 1.2 * len(labels) + 6), 5.5),
                                             gridspec_kw={"width_ratios": [2, 1]})
    for offset, name in enumerate(names):
        mine = [(i + offset * width, by[name, key]) for i, key in enumerate(labels) if (name, key) in by]
        title = (titles or {}).get(name, name)
        speed.bar([x for x, _ in mine], [r["tokens_per_s"] for _, r in mine], width, label=title)
        compile_.bar([x for x, _ in mine], [r["first_call_s"] for _, r in mine], width, label=title)
    speed.set_yscale("log")
    speed.set_ylabel("tokens/s (all rows)")
    compile_.set_ylabel("first call s (trace + compile + run)")
    machine = report["machine"]
    figure.suptitle(f"{machine.get('cpu')}, {machine.get('usable_cores')} cores", fontsize=10)
    return figure, speed, compile_, centres, labels


def finish_plot(figure, axes, centres: list[float], labels: list[str], path: Path) -> None:
    """Labels the axes' scenarios, adds legends and writes the figure as a PNG."""
    import matplotlib.pyplot as plt

    for axis in axes:
        axis.set_xticks(centres, labels, rotation=60, ha="right", fontsize=8)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot(report: dict, path: Path) -> bool:
    """Tokens/s (log scale) and first-call seconds per scenario, as a PNG; False without matplotlib."""
    charts = bar_charts(report, list(dict.fromkeys(r["system"] for r in report["results"])))
    if charts is None:
        return False
    figure, speed, compile_, centres, labels = charts
    finish_plot(figure, (speed, compile_), centres, labels, path)
    return True


def write_reports(report: dict, folder: Path, name: str, render: Callable[[dict], str],
                  draw: Callable[[dict, Path], bool] | None) -> list[Path]:
    """Writes NAME.json, NAME.md (`render`) and, when `draw` is given and draws, NAME.png into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{name}.json", folder / f"{name}.md"]
    paths[0].write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    paths[1].write_text(render(report), encoding="utf-8")
    if draw is not None and any("error" not in r for r in report["results"]) and draw(report, folder / f"{name}.png"):
        paths.append(folder / f"{name}.png")
    return paths


