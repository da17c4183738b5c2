"""`xlagen bench` on a tiny random GPT-2 and on a tiny checkpoint, and the comparison harness of
benchmarks/peer/ (driven against stand-in reference workers): the reports are written with their fields
(no timing checks)."""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest

from conftest import requires_kernels
from xlagen.cli import bench, bench_report, bench_timing
from xlagen.cli.__main__ import main

PEER = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "peer"
RESULT_FIELDS = {"system", "model", "strategy", "num_beams", "batch_size", "new_tokens", "prompt_tokens", "mode",
                 "dtype", "first_call_s", "runs_s", "median_s", "ms_per_token", "tokens_per_s"}


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    """(folder, report dict) of one in-process `xlagen bench --tiny` run (XLA and eager, greedy and beam2)."""
    folder = tmp_path_factory.mktemp("bench")
    code = main(["bench", "--tiny", "--quiet", "--output-dir", str(folder), "--name", "tiny"])
    assert code == 0
    return folder, json.loads((folder / "tiny.json").read_text())


@pytest.fixture(scope="module")
def peer():
    """The modules of benchmarks/peer/ (compare, bandwidth), imported as the harness imports them."""
    sys.path.insert(0, str(PEER))
    try:
        yield importlib.import_module("compare"), importlib.import_module("bandwidth")
    finally:
        sys.path.remove(str(PEER))


@pytest.fixture(scope="module")
def measured_bandwidth(peer):
    """The harness's bandwidth over a 64 MiB array (and without the OPENBLAS overrides when they are set)."""
    _, bandwidth = peer
    return bandwidth.combine([bandwidth.measure_bandwidth(64, 1)], bandwidth.measure_native_bandwidth(64, 1))


def test_tiny_bench_writes_json_with_machine_versions_and_results(tiny_report):
    _, report = tiny_report
    assert report["schema"] == bench.SCHEMA
    machine = report["machine"]
    assert machine["cores"] >= 1 and machine["python"] and machine["numpy"] and "env" in machine
    assert "OPENBLAS_CORETYPE" in machine["env"]
    xlagen = report["systems"]["xlagen"]
    assert {"tensorflow", "keras", "xlagen", "numpy", "python"} <= set(xlagen["versions"])
    assert {"tf_intra_op", "tf_inter_op", "xla_init_s"} <= set(xlagen["threads"])
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


def test_tiny_bench_writes_markdown_and_plot(tiny_report):
    folder, _ = tiny_report
    text = (folder / "tiny.md").read_text()
    assert "| model | dtype | strategy | batch | new | mode | first call s | trace + compile s | ms/token | tokens/s |" in text
    assert text.count("| tiny-gpt2 |") == 4
    assert "beam2 / greedy ms/token" in text
    assert (folder / "tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_measures_a_checkpoint_folder(tmp_path, gpt2_checkpoint, capsys):
    # A model that is not one of the architectures is loaded with from_pretrained: the user's own model.
    folder = gpt2_checkpoint[0]
    code = main(["bench", "--quiet", "--models", folder, "--strategies", "greedy", "--batch-sizes", "2",
                 "--new-tokens", "4", "--modes", "xla", "--repeats", "1", "--warmup", "0", "--no-plot",
                 "--output-dir", str(tmp_path), "--name", "mine"])
    assert code == 0
    (result,) = json.loads((tmp_path / "mine.json").read_text())["results"]
    assert result["model"] == folder and result["tokens_per_s"] > 0 and "error" not in result
    assert not (tmp_path / "mine.png").exists()
    assert f"| {folder} | float32 | greedy | 2 | 4 | xla |" in capsys.readouterr().out


def test_bench_records_a_failing_scenario_and_exits_1(tmp_path):
    code = main(["bench", "--quiet", "--models", str(tmp_path / "no-such-model"), "--strategies", "greedy",
                 "--batch-sizes", "1", "--new-tokens", "4", "--modes", "xla", "--no-plot", "--output-dir",
                 str(tmp_path), "--name", "failed"])
    assert code == 1
    (result,) = json.loads((tmp_path / "failed.json").read_text())["results"]
    assert "no-such-model" in result["error"]
    assert "- FAILED xlagen" in (tmp_path / "failed.md").read_text()


def test_weight_bytes_count_a_tied_embedding_once(peer):
    _, bandwidth = peer
    model = bench_timing.XlagenSystem().build("tiny-gpt2", "float32")
    # Tiny GPT-2: (64 + 64 positions) x 32 embeddings, 2 blocks, final norm; the tied head counted once.
    assert bandwidth.weight_bytes(model) == 4 * (64 * 32 + 64 * 32 + 2 * (12 * 32 * 32 + 13 * 32) + 2 * 32)


def test_bandwidth_is_measured_with_and_without_openblas_overrides(measured_bandwidth):
    assert measured_bandwidth["blas_gbs"] > 0 and measured_bandwidth["sum_gbs"] > 0
    if any(name in os.environ for name in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")):  # Measured without them too.
        assert measured_bandwidth["blas_native_gbs"] > 0


def _stub_reference(peer, tmp_path, body: str, *options: str):
    """The harness's arguments with a reference worker that is `body` (plain Python, no TensorFlow)."""
    compare, _ = peer
    stub = tmp_path / "reference_stub.py"
    stub.write_text(textwrap.dedent(body))
    return compare.parse_arguments(["--tiny", "--reference-python", sys.executable, "--reference-script", str(stub),
                                    *options])


def _stub_header(compare, weight_bytes: int) -> str:
    return f"""
        import json, sys
        def emit(record):
            print({compare.RESULT_PREFIX!r} + json.dumps(record), flush=True)
        emit({{"kind": "system", "system": "transformers-tf", "versions": {{}}, "env": {{}},
              "threads": {{"tf_intra_op": 2, "tf_inter_op": 2}}}})
        emit({{"kind": "ready", "first_call_s": 10.0, "weight_bytes": {weight_bytes}}})
    """


def test_reference_worker_protocol_alternates_runs_and_pairs_results(peer, tiny_report, measured_bandwidth, tmp_path):
    """The driver's side against a stand-in reference worker that answers 2x slower than xlagen did."""
    compare, bandwidth = peer
    _, report = tiny_report
    xla = dict(next(r for r in report["results"] if r["mode"] == "xla" and r["strategy"] == "greedy"),
               weight_bytes=1000)
    args = _stub_reference(peer, tmp_path, f"""
        import json, sys
        assert sys.argv[sys.argv.index("--worker") + 1] == "transformers-tf"
        assert json.loads(sys.argv[sys.argv.index("--scenario") + 1])["model"] == "tiny-gpt2"
        print("noise that is not a record")
    """ + _stub_header(compare, 1000) + f"""
        for line in sys.stdin:
            emit({{"kind": "run", "seconds": 2 * {xla["median_s"]} * int(line) / 8}})
    """, "--repeats", "3")
    scenario = bench_timing.Scenario(**{k: xla[k] for k in bench_timing.Scenario.__dataclass_fields__})
    systems = {}
    (reference,) = compare.run_interleaved(scenario, ["transformers-tf"], args, systems)
    assert systems["transformers-tf"]["threads"]["tf_intra_op"] == 2
    assert reference["first_call_s"] == 10.0 and len(reference["runs_s"]) == 3

    paired = dict(report, results=[xla, reference], systems=dict(report["systems"], **systems),
                  bandwidth=measured_bandwidth)
    bandwidth.add_rooflines(paired)
    assert xla["roofline_fraction"] > 0 and {"roofline_tokens_per_s_blas", "roofline_fraction_sum"} <= set(xla)
    (ratio,) = compare.ratios(paired["results"])
    assert ratio["speed_ratio"] == pytest.approx(2.0) and ratio["mode"] == "xla"
    text = compare.markdown(paired)
    assert "TF 4.57 tokens/s" in text and "| 2.00x |" in text and "| roofline |" in text
    assert "BLAS matrix-vector" in text and "seed" not in text


def test_reference_runs_float32_beside_a_packed_scenario_and_pairs_with_it(peer, tiny_report, tmp_path):
    """--dtype bfloat16-weights: the reference runs float32 beside it, and each xlagen result is paired with the
    reference run of its own scenario."""
    compare, _ = peer
    _, report = tiny_report
    xla = next(r for r in report["results"] if r["mode"] == "xla" and r["strategy"] == "greedy")
    args = _stub_reference(peer, tmp_path, """
        import json, sys
        assert json.loads(sys.argv[sys.argv.index("--scenario") + 1])["dtype"] == "float32"
    """ + _stub_header(compare, 1000) + """
        for line in sys.stdin:
            emit({"kind": "run", "seconds": 0.5})
    """, "--repeats", "1")
    fields = {k: xla[k] for k in bench_timing.Scenario.__dataclass_fields__}
    packed_scenario = bench_timing.Scenario(**{**fields, "dtype": bench_timing.PACKED_BF16})
    (beside,) = compare.run_interleaved(packed_scenario, ["transformers-tf"], args, {})
    assert beside["dtype"] == "float32" and beside["paired_dtype"] == bench_timing.PACKED_BF16

    full = dict(xla, tokens_per_s=100.0)
    packed = dict(xla, dtype=bench_timing.PACKED_BF16, tokens_per_s=300.0)
    reference_full = dict(beside, tokens_per_s=50.0)
    del reference_full["paired_dtype"]
    reference_packed = dict(beside, tokens_per_s=60.0)
    results = [full, reference_full, packed, reference_packed]
    ratios = {r["dtype"]: r["speed_ratio"] for r in compare.ratios(results)}
    assert ratios == {"float32": pytest.approx(2.0), bench_timing.PACKED_BF16: pytest.approx(5.0)}
    text = compare.markdown(dict(report, results=results, ratios=[], bandwidth=_bandwidth_of(40.0)))
    assert "| 2.00x |" in text and "| 5.00x |" in text
    assert f"tokens/s {bench_timing.PACKED_BF16} / float32 = 3.00" in text


def _bandwidth_of(gbs: float) -> dict:
    return {"bytes": 2**26, "blas_gbs": gbs, "blas_range_gbs": [gbs, gbs], "sum_gbs": gbs, "sum_range_gbs": [gbs, gbs]}


def test_failing_reference_worker_is_recorded_not_raised(peer, tmp_path):
    compare, _ = peer
    args = _stub_reference(peer, tmp_path, "import sys; sys.stderr.write('no transformers here\\n'); sys.exit(3)\n")
    scenario = bench_timing.Scenario("tiny-gpt2", "greedy", 1, 8, "xla")
    (record,) = compare.run_interleaved(scenario, ["transformers-tf"], args, {})
    assert record["system"] == "transformers-tf" and "exit 3" in record["error"]
    assert "no transformers" in record["error"]


def test_xla_threads_reach_the_xlagen_worker_only(peer, tmp_path):
    # --xla-threads: xlagen's worker sets TensorFlow's intra-op pool to it, its kernels keep --threads; the
    # reference's worker is told --threads alone.
    compare, _ = peer
    args = _stub_reference(peer, tmp_path, "", "--threads", "2", "--xla-threads", "1")
    scenario = bench_timing.Scenario("tiny-gpt2", "greedy", 1, 8, "xla")
    command, env = compare._worker_command("xlagen", scenario, args)
    assert command[command.index("--xla-threads") + 1] == "1" and env["XLAGEN_NATIVE_THREADS"] == "2"
    command, env = compare._worker_command("transformers-tf", scenario, args)
    assert "--xla-threads" not in command and command[command.index("--threads") + 1] == "2"
    header = bench_report.header_lines({"machine": {}, "command": ["compare.py"], "systems": {
        "xlagen": {"versions": {}, "threads": {"tf_intra_op": 1, "tf_inter_op": 2},
                   "env": {"XLAGEN_NATIVE_THREADS": "2"}},
        "ctranslate2": {"versions": {}, "threads": {"intra_threads": 2, "inter_threads": 1}, "env": {}}}}, "t")
    assert "- Threads: xlagen: intra 1 / inter 2 / kernels 2; ctranslate2: intra 2 / inter 1" in header


def test_missing_reference_environment_is_a_usage_error(peer, tmp_path, capsys):
    compare, _ = peer
    code = compare.main(["--tiny", "--reference-python", str(tmp_path / "nope" / "python"),
                         "--output-dir", str(tmp_path)])
    assert code == 2
    assert "setup_transformers_tf.sh" in capsys.readouterr().err


def test_comparison_runs_xlagen_workers_and_writes_reports(tmp_path):
    # The whole harness with xlagen alone: bandwidth, a worker process per scenario, rooflines, reports.
    script = PEER / "compare.py"
    command = [sys.executable, str(script), "--tiny", "--quiet", "--systems", "xlagen", "--modes", "xla",
               "--strategies", "greedy", "--no-plot", "--output-dir", str(tmp_path), "--name", "alone", "--load", "1"]
    subprocess.run(command, capture_output=True, text=True, check=True)
    report = json.loads((tmp_path / "alone.json").read_text())
    (result,) = report["results"]
    assert result["system"] == "xlagen" and "error" not in result and result["roofline_fraction"] > 0
    assert result["weight_bytes"] == 4 * (64 * 32 + 64 * 32 + 2 * (12 * 32 * 32 + 13 * 32) + 2 * 32)
    assert report["command"][:2] == ["python", "benchmarks/peer/compare.py"] and report["ratios"] == []
    command = report["command"]
    assert command[command.index("--load") + 1] == "1" and report["machine"]["busy_processes"] == 1
    assert result["load_average_1min"] is not None and "autogroup" in report["machine"]
    text = (tmp_path / "alone.md").read_text()
    assert "| roofline |" in text and "1 busy processes beside the scenarios (`--load`)" in text


def test_busy_processes_spin_in_sessions_of_their_own_until_the_block_ends():
    with bench_timing.busy_processes(2) as pids:
        assert len(pids) == 2
        for pid in pids:
            assert os.getsid(pid) == pid != os.getsid(0)  # each leads a session: a scheduling group of its own
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with bench_timing.busy_processes(0) as pids:
        assert pids == []


def test_variants_script_alternates_revisions_with_their_environments(tmp_path):
    # benchmarks/variants.py on a tiny model: two variants of this working tree, one with the pool's spinning
    # off, beside a busy process; each worker imports this checkout's xlagen.
    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "variants.py"
    command = [sys.executable, str(script), "--variant", "a", ".", "--variant", "b", ".", "XLAGEN_NATIVE_SPIN_US=0",
               "--models", "tiny-gpt2", "--batch-sizes", "1", "--new-tokens", "4", "--repeats", "2", "--warmup", "0",
               "--load", "1", "--quiet", "--output-dir", str(tmp_path), "--name", "v"]
    subprocess.run(command, capture_output=True, text=True, check=True)
    report = json.loads((tmp_path / "v.json").read_text())
    assert [v["name"] for v in report["variants"]] == ["a", "b"]
    assert report["variants"][1]["env"] == {"XLAGEN_NATIVE_SPIN_US": "0"} and report["variants"][0]["commit"]
    assert report["loads"][0]["busy_processes"] == 1 and report["machine"]["cpu"]
    assert {r["variant"] for r in report["results"]} == {"a", "b"}
    for result in report["results"]:
        assert "error" not in result and len(result["runs_s"]) == 2 and result["busy_processes"] == 1
    text = (tmp_path / "v.md").read_text()
    assert "| a ms/token | b ms/token | b / a |" in text and "## Busy processes: 1" in text


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


@pytest.fixture(scope="module")
def built_library() -> str:
    """The kernel library xlagen built and loaded (a `.so` file in its cache folder)."""
    from xlagen.native import build, library

    library.load()
    return str(build.cache_folder() / build.library_name())


@requires_kernels
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8"])
def test_kernel_variants_script_checks_and_times_builds(tmp_path, weights, built_library):
    # benchmarks/kernel_variants.py loads each build (here two copies of the library xlagen loaded), checks its
    # products against numpy, and times them. The refusal of a wrong build compiles sources, once (float32),
    # since every compilation costs tens of seconds.
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "kernel_variants.py")
    source = os.path.join(os.path.dirname(__file__), "..", "src", "xlagen", "native")
    command = [sys.executable, script, "--model", "tiny", "--weights", weights, "--rows", "1", "3", "8",
               "--rounds", "2", "--repeats", "1", "--blas", "--sources", built_library, built_library]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    assert out.count("first / this") == 3 * 3 and "rows 8:" in out and "numpy:" in out, out
    if weights != "float32":
        return
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in pathlib.Path(source).iterdir():
        if path.suffix in (".cc", ".h"):
            # every kernel's multiply-add becomes a multiply-subtract (AVX-512 and AVX2): products come out wrong
            text = path.read_text().replace("_mm512_fmadd_ps(", "_mm512_fmsub_ps(")
            (broken / path.name).write_text(text.replace("_mm256_fmadd_ps(", "_mm256_fmsub_ps("))
    result = subprocess.run(command[:-2] + [str(broken)], capture_output=True, text=True)
    assert result.returncode != 0 and "wrong product" in result.stderr, result.stderr


@requires_kernels
def test_kernel_variants_script_spins_between_products_and_sets_each_builds_lookahead(built_library):
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "kernel_variants.py")
    source = built_library
    command = [sys.executable, script, "--model", "tiny", "--rows", "1", "--rounds", "2", "--repeats", "1",
               "--gap-us", "20", "--lookahead", "0", "768", "--sources", source, source]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    assert "(each step with 0.10 ms of gaps)" in out, out  # 5 products
    assert "(lookahead 0 KiB)" in out and "(lookahead 768 KiB)" in out, out
    result = subprocess.run(command[:-4] + ["1", "2", "3", "--sources", source, source], capture_output=True,
                            text=True)
    assert result.returncode != 0 and "one value or one per source" in result.stderr, result.stderr


def test_ctranslate2_runs_its_compute_types_beside_each_xlagen_dtype(peer, tmp_path):
    """--reference ctranslate2: xlagen's int8 weights run beside both of CTranslate2's int8 compute types the CPU
    supports, each in its own worker, and every one pairs with the xlagen scenario."""
    compare, _ = peer
    ct2 = compare.reference_module("ctranslate2")
    cpu = ["float32", "int8", "int8_float32"]
    assert ct2.paired_dtypes("float32", cpu) == ["float32"]
    assert ct2.paired_dtypes(bench_timing.PACKED_BF16, cpu) == ["float32"]
    assert ct2.paired_dtypes(bench_timing.PACKED_BF16, [*cpu, "bfloat16"]) == ["bfloat16", "float32"]
    assert ct2.paired_dtypes(bench_timing.PACKED_INT8, ["float32", "int8_float32"]) == ["int8_float32"]
    assert ct2.paired_dtypes(bench_timing.PACKED_INT8, None) == ["int8_float32", "int8"]
    args = _stub_reference(peer, tmp_path, """
        import json, sys
        dtype = json.loads(sys.argv[sys.argv.index("--scenario") + 1])["dtype"]
        assert dtype in ("int8_float32", "int8"), dtype
    """ + _stub_header(compare, 1000) + """
        for line in sys.stdin:
            emit({"kind": "run", "seconds": 0.5 if dtype == "int8" else 1.0})
    """, "--reference", "ctranslate2", "--repeats", "2")
    scenario = bench_timing.Scenario("tiny-gpt2", "greedy", 1, 8, "xla", bench_timing.PACKED_INT8)
    systems = {"ctranslate2": {"versions": {"compute_types": cpu}}}
    beside = compare.run_interleaved(scenario, ["ctranslate2"], args, systems)
    assert [(r["dtype"], r["paired_dtype"], r["median_s"]) for r in beside] == [
        ("int8_float32", bench_timing.PACKED_INT8, 1.0), ("int8", bench_timing.PACKED_INT8, 0.5)]
    assert "compile_s" not in beside[0]  # CTranslate2 compiles nothing: its first call is only a run

    xlagen = dict(beside[0], system="xlagen", dtype=bench_timing.PACKED_INT8, tokens_per_s=32.0, first_call_s=1.0)
    del xlagen["paired_dtype"]
    ratios = {r["reference_dtype"]: (r["speed_ratio"], r["reference_best"]) for r in compare.ratios([xlagen, *beside])}
    assert ratios == {"int8_float32": (pytest.approx(4.0), False), "int8": (pytest.approx(2.0), True)}
    report = {"machine": {"env": {}}, "command": ["compare.py"], "bandwidth": _bandwidth_of(40.0),
              "systems": {"xlagen": {"versions": {}, "threads": {"tf_intra_op": 2, "tf_inter_op": 2}},
                          "ctranslate2": {"versions": {}, "threads": {"intra_threads": 2, "inter_threads": 1},
                                          "env": {"OMP_WAIT_POLICY": "PASSIVE", "CT2_FORCE_CPU_ISA": None}}},
              "results": [xlagen, *beside]}
    text = compare.markdown(report)
    assert "| CT2 dtype |" in text and "| 4.00x |" in text and "| 2.00x |" in text, text
    assert "ctranslate2: intra 2 / inter 1" in text and "OMP_WAIT_POLICY=PASSIVE" in text


def test_one_worker_at_a_time_restarts_each_worker_and_references_build_alone_first(peer, tmp_path):
    """--one-worker-at-a-time: each worker runs half the repeats, then a fresh one the other half; the references'
    models are built (converted) once per model and dtype by a worker that only builds, before any scenario."""
    compare, _ = peer
    starts = tmp_path / "starts"
    args = _stub_reference(peer, tmp_path, f"""
        import json, sys
        with open({str(starts)!r}, "a") as file:
            file.write(("build " if "--build-only" in sys.argv else "run ") +
                       json.loads(sys.argv[sys.argv.index("--scenario") + 1])["dtype"] + "\\n")
        if "--build-only" in sys.argv:
            print({compare.RESULT_PREFIX!r} + json.dumps({{"kind": "system", "system": "ctranslate2", "versions": {{}},
                  "env": {{}}, "threads": {{}}}}), flush=True)
            print({compare.RESULT_PREFIX!r} + json.dumps({{"kind": "built"}}), flush=True)
            sys.exit(0)
    """ + _stub_header(compare, 1000) + """
        for line in sys.stdin:
            emit({"kind": "run", "seconds": 0.5})
    """, "--reference", "ctranslate2", "--repeats", "3", "--one-worker-at-a-time")
    scenario = bench_timing.Scenario("tiny-gpt2", "greedy", 1, 8, "xla", bench_timing.PACKED_INT8)
    systems = {"ctranslate2": {"versions": {"compute_types": ["float32", "int8_float32"]}}}
    args.systems = ["ctranslate2"]
    compare.build_references([scenario, replace(scenario, batch_size=8)], args, systems)
    assert starts.read_text().split("\n")[:-1] == ["build int8_float32"]
    (result,) = compare.run_interleaved(scenario, ["ctranslate2"], args, systems)
    assert starts.read_text().split("\n")[1:-1] == ["run int8_float32"] * 2
    assert len(result["runs_s"]) == 4 and result["first_call_s"] == 10.0  # (3 + 1) // 2 per worker


def test_llama_family_bench_shapes_are_those_ctranslate2_converts(peer):
    """Bench models qwen2 and llama: xlagen's configs and the transformers configs CTranslate2's models are
    converted from give the same shapes, rope and tied head (the BOS id aside: Qwen2 has none)."""
    compare, _ = peer
    ct2 = compare.reference_module("ctranslate2")
    for name in ("qwen2", "llama"):
        ours, theirs = bench_timing.llama_family_config(name).to_hf_config(), ct2.MODELS[name][2]
        keys = set(theirs) - {"bos_token_id", "rope_scaling"}
        assert {k: ours[k] for k in keys} == {k: theirs[k] for k in keys}, name
        scaling = theirs.get("rope_scaling") or {}
        assert {k: (ours["rope_scaling"] or {}).get(k) for k in scaling} == scaling, name


def test_reference_options_are_settled_together(peer):
    compare, _ = peer
    args = compare.parse_arguments(["--tiny", "--systems", "ctranslate2", "--reference-env", "CT2_FORCE_CPU_ISA=AVX2",
                                    "--prefill-tokens", "512", "--models", "gpt2", "whisper"])
    assert args.reference == "ctranslate2" and args.systems == ["ctranslate2"]
    assert args.reference_python.parts[-3:] == (".ct2-venv", "bin", "python")
    _, env = compare._worker_command("ctranslate2", None, args)
    assert env["CT2_FORCE_CPU_ISA"] == "AVX2" and "OMP_WAIT_POLICY" in env
    labels = [s.label() for s in compare.prefill_scenarios(args)]
    assert labels == ["gpt2 greedy b1 n1 p512 xla", "whisper greedy b1 n1 xla"]
    assert compare.parse_arguments(["--tiny"]).systems == ["xlagen", "transformers-tf"]
    for wrong in (["--reference", "transformers-tf", "--systems", "ctranslate2"], ["--reference-env", "CT2"]):
        with pytest.raises(SystemExit):
            compare.parse_arguments(["--tiny", *wrong])
