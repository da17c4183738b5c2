"""`xlagen bench` on a tiny random GPT-2: the reports are written with their fields (no timing checks)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from conftest import requires_kernels
from xlagen.cli import bench
from xlagen.cli.__main__ import build_parser, main

RESULT_FIELDS = {"system", "model", "strategy", "num_beams", "batch_size", "new_tokens", "prompt_tokens", "mode",
                 "dtype", "weight_bytes", "first_call_s", "runs_s", "median_s", "ms_per_token", "tokens_per_s",
                 "roofline_fraction", "roofline_tokens_per_s_blas", "roofline_fraction_sum", "isolated"}


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    """(folder, report dict) of one in-process `xlagen bench --tiny` run (XLA and eager, greedy and beam2)."""
    folder = tmp_path_factory.mktemp("bench")
    code = main(["bench", "--tiny", "--quiet", "--output-dir", str(folder), "--name", "tiny"])
    assert code == 0
    return folder, json.loads((folder / "tiny.json").read_text())


def test_tiny_bench_writes_json_with_machine_versions_bandwidth_and_results(tiny_report):
    _, report = tiny_report
    assert report["schema"] == bench.SCHEMA
    machine = report["machine"]
    assert machine["cores"] >= 1 and machine["python"] and machine["numpy"] and "env" in machine
    assert "OPENBLAS_CORETYPE" in machine["env"]
    xlagen = report["systems"]["xlagen"]
    assert {"tensorflow", "keras", "xlagen", "numpy", "python"} <= set(xlagen["versions"])
    assert {"tf_intra_op", "tf_inter_op", "xla_init_s"} <= set(xlagen["threads"])
    assert report["bandwidth"]["blas_gbs"] > 0 and report["bandwidth"]["sum_gbs"] > 0
    if any(name in os.environ for name in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")):  # Measured without them too.
        assert report["bandwidth"]["blas_native_gbs"] > 0
    assert report["command"][:2] == ["xlagen", "bench"] and "--tiny" not in report["command"]

    results = report["results"]
    assert {(r["strategy"], r["mode"]) for r in results} == {(s, m) for s in ("greedy", "beam2")
                                                             for m in ("xla", "eager")}
    for result in results:
        assert "error" not in result, result
        assert RESULT_FIELDS <= set(result)
        assert result["model"] == "tiny-gpt2" and result["batch_size"] == 1 and len(result["runs_s"]) == 1
        assert result["new_tokens"] == (8 if result["mode"] == "xla" else 4)
        assert ("compile_s" in result) == (result["mode"] == "xla")
        if result["mode"] == "xla":
            assert result["compile_s"] == pytest.approx(result["first_call_s"] - result["median_s"])
        # Tiny GPT-2: (64 + 64 positions) x 32 embeddings, 2 blocks, final norm; the tied head counted once.
        assert result["weight_bytes"] == 4 * (64 * 32 + 64 * 32 + 2 * (12 * 32 * 32 + 13 * 32) + 2 * 32)
    assert report["ratios"] == []


def test_tiny_bench_writes_markdown_and_plot(tiny_report):
    folder, _ = tiny_report
    text = (folder / "tiny.md").read_text()
    assert ("| model | dtype | strategy | batch | new | mode | first call s | trace + compile s | ms/token | tokens/s "
            "| roofline |") in text
    assert text.count("| tiny-gpt2 |") == 4 and "BLAS matrix-vector" in text
    assert "beam2 / greedy ms/token" in text
    assert (folder / "tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _stub_seed(tmp_path, body: str) -> list[str]:
    """`xlagen bench --tiny --peer` arguments whose seed worker is `body` (plain Python, no TensorFlow)."""
    stub = tmp_path / "seed_stub.py"
    stub.write_text(textwrap.dedent(body))
    return ["bench", "--tiny", "--peer", "--peer-python", sys.executable, "--seed-script", str(stub)]


def test_seed_worker_protocol_alternates_runs_and_pairs_results(tiny_report, tmp_path):
    """The driver's side of --peer against a stand-in seed worker that answers 2x slower than xlagen did."""
    _, report = tiny_report
    xla = next(r for r in report["results"] if r["mode"] == "xla" and r["strategy"] == "greedy")
    argv = _stub_seed(tmp_path, f"""
        import json, sys
        assert sys.argv[-2] == "--worker" and json.loads(sys.argv[-1])["model"] == "tiny-gpt2"
        def emit(record):
            print({bench.RESULT_PREFIX!r} + json.dumps(record), flush=True)
        print("noise that is not a record")
        emit({{"kind": "system", "system": "seed", "versions": {{}}, "env": {{}},
              "threads": {{"tf_intra_op": 2, "tf_inter_op": 2}}}})
        emit({{"kind": "ready", "first_call_s": 10.0, "weight_bytes": {xla["weight_bytes"]}}})
        for line in sys.stdin:
            emit({{"kind": "run", "seconds": 2 * {xla["median_s"]} * int(line) / 8}})
    """)
    args = bench.resolve_arguments(build_parser().parse_args([*argv, "--repeats", "3"]))
    scenario = bench.Scenario(**{k: xla[k] for k in bench.Scenario.__dataclass_fields__})
    systems = {}
    (seed,) = bench.run_interleaved(scenario, ["seed"], args, systems)
    assert systems["seed"]["threads"]["tf_intra_op"] == 2
    assert seed["first_call_s"] == 10.0 and len(seed["runs_s"]) == 3 and seed["isolated"]

    paired = dict(report, results=[xla, seed], systems=dict(report["systems"], **systems))
    bench.add_rooflines(paired)
    (ratio,) = bench.ratios(paired["results"])
    assert ratio["speed_ratio"] == pytest.approx(2.0) and ratio["mode"] == "xla"
    text = bench.markdown(paired)
    assert "seed tokens/s" in text and "| 2.00x |" in text


def test_seed_runs_float32_beside_a_packed_scenario_and_pairs_with_it(tiny_report, tmp_path):
    """--dtype bfloat16-weights with --peer: the seed system runs float32 beside it, and each xlagen result is
    paired with the seed run of its own scenario."""
    _, report = tiny_report
    xla = next(r for r in report["results"] if r["mode"] == "xla" and r["strategy"] == "greedy")
    argv = _stub_seed(tmp_path, f"""
        import json, sys
        assert json.loads(sys.argv[-1])["dtype"] == "float32"
        def emit(record):
            print({bench.RESULT_PREFIX!r} + json.dumps(record), flush=True)
        emit({{"kind": "system", "system": "seed", "versions": {{}}, "env": {{}},
              "threads": {{"tf_intra_op": 2, "tf_inter_op": 2}}}})
        emit({{"kind": "ready", "first_call_s": 10.0, "weight_bytes": {xla["weight_bytes"]}}})
        for line in sys.stdin:
            emit({{"kind": "run", "seconds": 0.5}})
    """)
    args = bench.resolve_arguments(build_parser().parse_args([*argv, "--repeats", "1"]))
    fields = {k: xla[k] for k in bench.Scenario.__dataclass_fields__}
    (beside,) = bench.run_interleaved(bench.Scenario(**{**fields, "dtype": bench.PACKED_BF16}), ["seed"], args, {})
    assert beside["dtype"] == "float32" and beside["paired_dtype"] == bench.PACKED_BF16

    full = dict(xla, tokens_per_s=100.0)
    packed = dict(xla, dtype=bench.PACKED_BF16, tokens_per_s=300.0)
    seed_full = dict(beside, tokens_per_s=50.0)
    del seed_full["paired_dtype"]
    seed_packed = dict(beside, tokens_per_s=60.0)
    results = [full, seed_full, packed, seed_packed]
    ratios = {r["dtype"]: r["speed_ratio"] for r in bench.ratios(results)}
    assert ratios == {"float32": pytest.approx(2.0), bench.PACKED_BF16: pytest.approx(5.0)}
    text = bench.markdown(dict(report, results=results, ratios=[]))
    assert "| 2.00x |" in text and "| 5.00x |" in text
    assert f"tokens/s {bench.PACKED_BF16} / float32 = 3.00" in text


def test_failing_seed_worker_is_recorded_not_raised(tmp_path):
    argv = _stub_seed(tmp_path, "import sys; sys.stderr.write('no transformers here\\n'); sys.exit(3)\n")
    args = bench.resolve_arguments(build_parser().parse_args(argv))
    (record,) = bench.run_interleaved(bench.Scenario("tiny-gpt2", "greedy", 1, 8, "xla"), ["seed"], args, {})
    assert record["system"] == "seed" and "exit 3" in record["error"] and "no transformers" in record["error"]


def test_missing_peer_environment_is_a_usage_error(tmp_path, capsys):
    code = main(["bench", "--tiny", "--peer", "--peer-python", str(tmp_path / "nope" / "python"),
                 "--output-dir", str(tmp_path)])
    assert code == 2
    assert "setup_seed_env.sh" in capsys.readouterr().err


def test_profile_step_script_sums_xla_instructions_per_step():
    # benchmarks/profile_step.py on a tiny model: the profiler's XLA thunk events are found and summed.
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "profile_step.py")
    out = subprocess.run([sys.executable, script, "--model", "tiny-gpt2", "--strategy", "beam2", "--new-tokens", "4",
                          "--top", "40", "--timeline", "0.5"], capture_output=True, text=True, check=True).stdout
    table = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| instruction")]
    assert "tiny-gpt2 beam2 b1 n4 xla" in out and len(table) >= 5, out
    assert any(line.startswith("| dot |") for line in table), table  # the attention / projection products
    assert any("dynamic-update-slice" in line for line in table), table  # the cache writes
    assert "thread" in out.split("share of the call")[-1], "the --timeline window printed no events"


@requires_kernels
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8"])
def test_kernel_variants_script_checks_and_times_builds(tmp_path, weights):
    # benchmarks/kernel_variants.py compiles each source, checks its products against numpy, and times them;
    # a build whose products are wrong is refused.
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "kernel_variants.py")
    source = os.path.join(os.path.dirname(__file__), "..", "src", "xlagen", "native")
    command = [sys.executable, script, "--model", "tiny", "--weights", weights, "--rows", "1", "3", "8",
               "--rounds", "2", "--repeats", "1", "--blas", "--sources", source, source]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    assert out.count("first / this") == 3 * 3 and "rows 8:" in out and "numpy:" in out, out
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in pathlib.Path(source).iterdir():
        if path.suffix in (".cc", ".h"):
            # every kernel's multiply-add becomes a multiply-subtract: products come out wrong
            (broken / path.name).write_text(path.read_text().replace("_mm512_fmadd_ps(", "_mm512_fmsub_ps("))
    result = subprocess.run(command[:-2] + [str(broken)], capture_output=True, text=True)
    assert result.returncode != 0 and "wrong product" in result.stderr, result.stderr


@requires_kernels
def test_kernel_variants_script_spins_between_products_and_sets_each_builds_lookahead():
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "kernel_variants.py")
    source = os.path.join(os.path.dirname(__file__), "..", "src", "xlagen", "native")
    command = [sys.executable, script, "--model", "tiny", "--rows", "1", "--rounds", "2", "--repeats", "1",
               "--gap-us", "20", "--lookahead", "0", "768", "--sources", source, source]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    assert "(each step with 0.10 ms of gaps)" in out, out  # 5 products
    assert "(lookahead 0 KiB)" in out and "(lookahead 768 KiB)" in out, out
    result = subprocess.run(command[:-4] + ["1", "2", "3", "--sources", source, source], capture_output=True,
                            text=True)
    assert result.returncode != 0 and "one value or one per source" in result.stderr, result.stderr
