"""Throughput of `xlagen.beam` on Beam's in-process runner against `CompiledGenerator` in one process, and
what Beam itself costs per element.

    python benchmarks/beam_scale.py --model builtin --prompts 500 --new-tokens 32
    python benchmarks/beam_scale.py --cache-dir /tmp/xla-cache --scenarios compiled beam-1 beam-1 beam-2:1 overhead
    python benchmarks/beam_scale.py --model gpt2-small --prompts 500 --new-tokens 32

Each scenario runs in a fresh process on the same prompts (mixed lengths, 3..50 words, so 8..64-token
buckets), greedy, every prompt generating exactly --new-tokens tokens (`min_new_tokens`):

- `compiled`: `CompiledGenerator` (through `PromptBatcher`: prompts sorted by length, batches of
  --batch-size) in this process; the first pass compiles, the second is timed ("steady").
- `beam-1`: `RunInference(GenerationModelHandler)` on Beam's FnApiRunner, one in-process worker; Beam
  batches of --batch-size prompts of one prompt-length bucket (`max_batch_duration_secs`, Beam's
  length buckets lined up with xlagen's), as the `compiled` scenario's.
- `beam-2`: two worker processes (`direct_num_workers=2`, `direct_running_mode=multi_processing`), each
  loading the model; `beam-2:1`: the same with one TensorFlow thread per worker (`TF_NUM_INTRAOP_THREADS`,
  `TF_NUM_INTEROP_THREADS`).
- `overhead`: a handler that returns at once, over --overhead-elements elements, against the same pipeline
  with a plain Map instead of RunInference: Beam's cost per element (BatchElements, RunInference's DoFn,
  metrics), no model; each pipeline 3 times, alternating, the fastest kept.

The Beam scenarios are timed from pipeline start to end (worker start, model load and the compile or
load of each program included). All processes share one persistent XLA cache folder: a scenario loads
the programs an earlier one compiled (Beam's batches have other sizes than `compiled`'s at the end of
each length bucket, so its first run still compiles some); list a scenario twice to time it with a warm
cache. `inference_s` is Beam's own sum of batch latencies (all workers), `load_s` its model-load time.
Models: `builtin` is xlagen's built-in model (6 layers, width 256); `gpt2-small`
is GPT-2 small's shapes with random weights and the built-in tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILTIN = ROOT / "src" / "xlagen" / "default_model"


def make_model(kind: str, folder: Path) -> str:
    """The checkpoint folder of `kind` (written into `folder` for gpt2-small)."""
    if kind == "builtin":
        return str(BUILTIN)
    import shutil

    from xlagen.modeling import TFGPT2LMHeadModel
    from xlagen.models.gpt2 import GPT2Config

    TFGPT2LMHeadModel(GPT2Config()).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(BUILTIN / name, folder / name)
    return str(folder)


def make_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` prompts of 3..50 words from the built-in tokenizer's whole-word tokens."""
    vocab = json.loads((BUILTIN / "tokenizer.json").read_text())["model"]["vocab"]
    words = sorted(token[1:] for token in vocab if token.startswith("\u0120") and token[1:].isalpha())
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 50))) for _ in range(count)]


def scenario_compiled(args, prompts: list[str]) -> dict:
    from xlagen.beam import GenerationModelHandler

    handler = GenerationModelHandler(args.checkpoint, **options(args))
    started = time.perf_counter()
    batcher = handler.load_model()
    load = time.perf_counter() - started
    prepared = sorted((handler.prepare(p) for p in prompts), key=lambda p: len(p.ids))
    batches = [prepared[i:i + args.batch_size] for i in range(0, len(prepared), args.batch_size)]
    passes = []
    for _ in range(2):
        started = time.perf_counter()
        tokens = sum(len(r["tokens"]) for batch in batches for r in batcher.generate(batch))
        passes.append(time.perf_counter() - started)
    return {"load_s": load, "first_pass_s": passes[0], "seconds": passes[1], "tokens": tokens,
            "compiles": batcher.compile_count}


def scenario_beam(args, prompts: list[str], workers: int) -> dict:
    import apache_beam as beam
    from apache_beam.metrics.metric import MetricsFilter
    from apache_beam.ml.inference.base import RunInference
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner

    from xlagen.beam import GenerationModelHandler

    handler = GenerationModelHandler(args.checkpoint, **options(args, beam=True))
    mode = "in_memory" if workers == 1 else "multi_processing"
    pipeline_options = PipelineOptions(direct_num_workers=workers, direct_running_mode=mode)
    out = Path(tempfile.mkdtemp()) / "tokens"
    started = time.perf_counter()
    pipeline = beam.Pipeline(runner=FnApiRunner(), options=pipeline_options)
    (pipeline | beam.Create(prompts) | RunInference(handler.with_preprocess_fn(handler.prepare))
     | beam.Map(lambda result: len(result.inference["tokens"])) | beam.CombineGlobally(sum)
     | beam.io.WriteToText(str(out)))
    result = pipeline.run()
    result.wait_until_finish()
    seconds = time.perf_counter() - started
    tokens = int(next(out.parent.glob("tokens*")).read_text())
    metrics = result.metrics().query(MetricsFilter())
    distributions = {m.key.metric.name: m.result for m in metrics["distributions"]}
    batches = distributions.get("inference_batch_latency_micro_secs")
    loads = distributions.get("load_model_latency_milli_secs")
    return {"seconds": seconds, "tokens": tokens, "workers": workers,
            "batches": None if batches is None else batches.count,
            "inference_s": None if batches is None else batches.sum / 1e6,
            "load_s": None if loads is None else loads.sum / 1e3}


def scenario_overhead(args) -> dict:
    import apache_beam as beam
    from apache_beam.ml.inference.base import ModelHandler, PredictionResult, RunInference
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner

    class Echo(ModelHandler):
        def load_model(self):
            return None

        def run_inference(self, batch, model, inference_args=None):
            return [PredictionResult(x, x) for x in batch]

    elements = [f"prompt {i}" for i in range(args.overhead_elements)]
    timings: dict[str, float] = {}
    for _ in range(3):  # alternating; the fastest of each, as the machine is shared
        for name, make in (("create_only", lambda: beam.Map(lambda x: x)),
                           ("run_inference", lambda: RunInference(Echo()))):
            started = time.perf_counter()
            with beam.Pipeline(runner=FnApiRunner()) as pipeline:
                _ = pipeline | beam.Create(elements) | make() | beam.combiners.Count.Globally()
            timings[name] = min(timings.get(name, float("inf")), time.perf_counter() - started)
    return {"elements": len(elements), **{f"{k}_s": v for k, v in timings.items()},
            "run_inference_us_per_element": (timings["run_inference"] - timings["create_only"]) / len(elements) * 1e6,
            "pipeline_us_per_element": timings["run_inference"] / len(elements) * 1e6}


def options(args, beam: bool = False) -> dict:
    batching = {"max_batch_duration_secs": args.max_batch_duration} if beam and args.max_batch_duration else {}
    return {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens, "do_sample": False,
            "max_batch_size": args.batch_size, **batching}


def child(args) -> None:
    prompts = make_prompts(args.prompts)
    if args.scenario == "compiled":
        record = scenario_compiled(args, prompts)
    elif args.scenario == "overhead":
        record = scenario_overhead(args)
    else:
        record = scenario_beam(args, prompts, int(args.scenario.split("-")[1]))
    print("RESULT " + json.dumps(record))


def run_scenario(args, scenario: str, cache: str, threads: int | None) -> dict:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_XLA_FLAGS": f"--tf_xla_persistent_cache_directory={cache}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    if threads:
        env.update(TF_NUM_INTRAOP_THREADS=str(threads), TF_NUM_INTEROP_THREADS=str(threads))
    command = [sys.executable, __file__, "--child", scenario, "--checkpoint", args.checkpoint,
               "--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens), "--batch-size",
               str(args.batch_size), "--overhead-elements", str(args.overhead_elements),
               "--max-batch-duration", str(args.max_batch_duration)]
    load = os.getloadavg()[0]
    out = subprocess.run(command, env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{scenario} failed:\n{out.stderr[-3000:]}")
    record = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    record.update(scenario=scenario, threads_per_worker=threads, load_average_before=load)
    if "tokens" in record:
        record["prompts_per_s"] = args.prompts / record["seconds"]
        record["tokens_per_s"] = record["tokens"] / record["seconds"]
    print(json.dumps(record), flush=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("builtin", "gpt2-small"), default="builtin")
    parser.add_argument("--prompts", type=int, default=500)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=64, help="largest batch (Beam's max_batch_size)")
    parser.add_argument("--overhead-elements", type=int, default=20000)
    parser.add_argument("--max-batch-duration", type=float, default=1.0,
                        help="Beam's max_batch_duration_secs: batches by prompt-length bucket (0: plain batching, "
                             "mixed lengths in a batch)")
    parser.add_argument("--scenarios", nargs="+", default=["compiled", "beam-1", "beam-2", "beam-2:1", "overhead"],
                        help="beam-2:1 = two workers with one TensorFlow thread each")
    parser.add_argument("--output", help="JSON file (default: benchmarks/results/beam-scale-<model>.json)")
    parser.add_argument("--cache-dir", help="persistent XLA cache folder (default: a new temporary one)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.scenario = args.child
        child(args)
        return
    with tempfile.TemporaryDirectory() as work:
        args.checkpoint = make_model(args.model, Path(work) / "model")
        cache = args.cache_dir or str(Path(work) / "xla-cache")
        records = []
        for scenario in args.scenarios:
            name, _, threads = scenario.partition(":")
            records.append(run_scenario(args, name, cache, int(threads) if threads else None))
    report = {"model": args.model, "prompts": args.prompts, "new_tokens": args.new_tokens,
              "batch_size": args.batch_size, "max_batch_duration_secs": args.max_batch_duration,
              "cores": os.cpu_count(), "python": platform.python_version(),
              "records": records}
    output = Path(args.output or ROOT / "benchmarks" / "results" / f"beam-scale-{args.model}.json")
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
