"""Generation speed of two revisions of xlagen, in alternating processes: did a change keep the speed?

    python benchmarks/revisions.py --base main~5 --head HEAD --models gpt2 opt t5 whisper --batch-sizes 1 8

Each revision's `src/` is extracted with `git archive` into a scratch folder; every measurement is a fresh
process that imports that revision, builds a random-weight model of the real shapes (GPT-2-small,
OPT-125m, T5-small, Whisper-tiny, float32), compiles `tf.function(model.generate, jit_compile=True)` for
8-token prompts (Whisper: 30 s of features) and times --calls greedy generations of --new-tokens tokens.
Processes alternate base, head, base, head, ... --pairs times per row, so that the machine's load falls on
both alike. Prints and writes (--output, JSON and markdown) the median ms/token of each revision per row
and their ratio head / base (below 1: head is faster). Only the public API is used, so any two revisions
of the last year compare.

With --same-program, each row instead compiles once per revision and compares the optimized HLO of the two
programs (op names, metadata and numbering left out): where they are the same, the speed is the same by
construction, whatever the machine's load (a change that only moves Python code keeps the program).
Add --kernels to compare the programs that call xlagen's native kernels on a machine whose CPU cannot run
them: both revisions then load the kernel library (built, not executed) and trace as if the CPU could, and
the comparison includes every custom call and its configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]

CHILD = """
import json, statistics, time
import numpy as np
import tensorflow as tf
import keras
tf.config.threading.set_intra_op_parallelism_threads({threads})
tf.config.threading.set_inter_op_parallelism_threads(1)
keras.utils.set_random_seed(0)
import xlagen
if {force_kernels}:
    # Trace as if this CPU could run the kernels: the library loads and registers, nothing runs.
    import xlagen.native as native
    where = getattr(native, "library", native)
    where.hardware_reason = lambda: None
from xlagen import modeling
model_name, batch, new_tokens, calls = {model!r}, {batch}, {new_tokens}, {calls}
if model_name == "gpt2":
    from xlagen.models.gpt2 import GPT2Config
    model = modeling.TFGPT2LMHeadModel(GPT2Config())
elif model_name == "opt":
    from xlagen.models.opt import OPTConfig
    model = modeling.TFOPTForCausalLM(OPTConfig())
elif model_name == "t5":
    from xlagen.models.t5 import T5Config
    model = modeling.TFT5ForConditionalGeneration(T5Config())
else:
    from xlagen.models.whisper import WhisperConfig
    model = modeling.TFWhisperForConditionalGeneration(WhisperConfig())
rng = np.random.default_rng(1)
if model_name == "whisper":
    inputs = {{"input_features": tf.constant(rng.standard_normal((batch, 80, 3000)).astype(np.float32))}}
else:
    inputs = {{"input_ids": tf.constant(rng.integers(1, 1000, (batch, 8)), tf.int32)}}
options = dict(max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0, do_sample=False)
generate = tf.function(model.generate, jit_compile=True)
if {same_program}:
    import hashlib, re
    program = tf.function(lambda inputs: model.generate(**inputs, **options), jit_compile=True)
    hlo = program.experimental_get_compiler_ir(inputs)(stage="optimized_hlo")
    hlo = re.sub(r"\\b(metadata|op_name|source_file|source_line)=\\{{[^}}]*\\}}", "", hlo)
    hlo = re.sub(r"[A-Za-z_][A-Za-z_0-9]*\\.\\d+", "x", hlo)
    print(json.dumps({{"program": hashlib.sha256(hlo.encode()).hexdigest(), "lines": len(hlo.splitlines()),
                      "custom_calls": hlo.count("custom_call_target="), "xlagen": xlagen.__file__}}))
    raise SystemExit
started = time.perf_counter()
generate(**inputs, **options).numpy()
first = time.perf_counter() - started
times = []
for _ in range(calls):
    started = time.perf_counter()
    tokens = generate(**inputs, **options).numpy()
    times.append(time.perf_counter() - started)
print(json.dumps({{"ms_per_token": 1000 * statistics.median(times) / new_tokens, "first_call_s": first,
                  "checksum": int(tokens.sum()), "xlagen": xlagen.__file__}}))
"""


def extract(revision: str, folder: Path) -> Path:
    """`src/` of `revision` in `folder`; returns the folder to put on PYTHONPATH."""
    archive = subprocess.run(["git", "-C", str(REPOSITORY), "archive", revision, "src"], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder / "src"


def measure(source: Path, model: str, batch: int, args) -> dict:
    code = CHILD.format(threads=args.threads, model=model, batch=batch, new_tokens=args.new_tokens, calls=args.calls,
                        same_program=args.same_program, force_kernels=args.kernels)
    env = {**os.environ, "PYTHONPATH": str(source), "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=source.parent).stdout
    result = json.loads(out.strip().splitlines()[-1])
    if not result["xlagen"].startswith(str(source)):
        raise RuntimeError(f"the child imported {result['xlagen']}, not the revision in {source}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="a git revision (e.g. main~3)")
    parser.add_argument("--head", default="HEAD", help="a git revision (default HEAD)")
    parser.add_argument("--models", nargs="+", default=["gpt2", "opt", "t5", "whisper"],
                        choices=["gpt2", "opt", "t5", "whisper"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--calls", type=int, default=3, help="timed calls per process (their median counts)")
    parser.add_argument("--pairs", type=int, default=2, help="processes per revision and row, alternating")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--same-program", action="store_true",
                        help="compare the compiled programs (optimized HLO) instead of timing them")
    parser.add_argument("--kernels", action="store_true",
                        help="with --same-program: trace both revisions with the native kernels, even on a CPU "
                             "that cannot run them")
    parser.add_argument("--output", type=Path, help="write OUTPUT.json and OUTPUT.md")
    args = parser.parse_args()
    if args.kernels and not args.same_program:
        parser.error("--kernels compares programs only: add --same-program")

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        sources = {}
        for name, revision in (("base", args.base), ("head", args.head)):
            (Path(scratch) / name).mkdir()
            sources[name] = extract(revision, Path(scratch) / name)
        for model in args.models:
            for batch in args.batch_sizes:
                if args.same_program:
                    programs = {name: measure(sources[name], model, batch, args) for name in sources}
                    row = {"model": model, "batch_size": batch, "hlo_lines": programs["head"]["lines"],
                           "custom_calls": {name: programs[name]["custom_calls"] for name in programs},
                           "same_program": programs["base"]["program"] == programs["head"]["program"]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    continue
                runs = {"base": [], "head": []}
                checksums = {"base": set(), "head": set()}
                for pair in range(args.pairs):
                    for name in (("base", "head") if pair % 2 == 0 else ("head", "base")):
                        result = measure(sources[name], model, batch, args)
                        runs[name].append(result["ms_per_token"])
                        checksums[name].add(result["checksum"])
                base, head = statistics.median(runs["base"]), statistics.median(runs["head"])
                row = {"model": model, "batch_size": batch, "base_ms_per_token": round(base, 2),
                       "head_ms_per_token": round(head, 2), "head_over_base": round(head / base, 3),
                       "base_runs": [round(r, 2) for r in runs["base"]], "head_runs": [round(r, 2) for r in runs["head"]],
                       "same_tokens": checksums["base"] == checksums["head"]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    report = {"base": args.base, "head": args.head, "kernels_forced": args.kernels, "new_tokens": args.new_tokens, "calls": args.calls,
              "pairs": args.pairs, "threads": args.threads, "rows": rows}
    if args.same_program:
        if args.output:
            args.output.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        return 0 if all(r["same_program"] for r in rows) else 1
    if args.output:
        args.output.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        lines = [f"Greedy generation, {args.new_tokens} new tokens, float32, random weights, {args.threads} threads; "
                 f"median ms/token of {args.pairs} processes per revision, alternating.", "",
                 "| model | batch | base ms/token | head ms/token | head / base | same tokens |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['batch_size']} | {r['base_ms_per_token']} | {r['head_ms_per_token']} | "
                  f"{r['head_over_base']} | {'yes' if r['same_tokens'] else 'no'} |" for r in rows]
        args.output.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
