"""What TensorFlow's persistent XLA compilation cache saves a second process.

Runs the same first `generate` call in fresh processes: once with an empty cache folder (cold), then
with the folder the first process filled (warm), and reports for each the Python trace time
(`get_concrete_function`), the first call after tracing (TF->HLO lowering + XLA compile, or a cache
load) and their sum, as medians over --repeats pairs.

    python benchmarks/compile_cache.py --layers 12 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = """
import json, sys, time
import numpy as np, tensorflow as tf
from xlagen.modeling import TFGPT2LMHeadModel
from xlagen.models.gpt2 import GPT2Config
model = TFGPT2LMHeadModel(GPT2Config(num_layers={layers}))
ids = tf.constant(np.ones((1, 8), np.int32))
options = dict(max_new_tokens=32, eos_token_id=None, pad_token_id=0)
program = tf.function(model.generate, jit_compile=True)
started = time.perf_counter(); program.get_concrete_function(ids, **options); trace = time.perf_counter() - started
started = time.perf_counter(); program(ids, **options).numpy(); first = time.perf_counter() - started
started = time.perf_counter(); program(ids, **options).numpy(); steady = time.perf_counter() - started
print(json.dumps({{"trace": trace, "compile_or_load": first, "first_call": trace + first, "steady_call": steady}}))
"""


def run_child(layers: int, cache: str) -> dict:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
           "TF_XLA_FLAGS": f"--tf_xla_persistent_cache_directory={cache}"}
    out = subprocess.run([sys.executable, "-c", CHILD.format(layers=layers)], env=env, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12, help="GPT-2 layers (12 = GPT-2 small)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cold, warm = [], []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:
            cold.append(run_child(args.layers, cache))
            warm.append(run_child(args.layers, cache))
    summary = {}
    for name, runs in (("cold", cold), ("warm", warm)):
        summary[name] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    summary["warm_first_call_over_cold"] = summary["warm"]["first_call"] / summary["cold"]["first_call"]
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
