"""The memory `from_pretrained` takes: peak resident memory of a load over the bytes of the loaded weights.

For each model (GPT-2-small's, Qwen2.5-0.5B's and Llama-3.2-1B's shapes, random weights written with
transformers' names and config.json as safetensors; Llama's in shards of 1 GB, as the Hub's) and each
`weight_dtype` (float32, bfloat16, int8), a fresh process loads the checkpoint and reports its peak resident
memory (VmHWM in /proc/self/status, which counts TensorFlow's allocations as well as numpy's) and its
resident memory after the load. A process that imported xlagen (and so TensorFlow and Keras) and the native
kernels and did nothing else is the baseline; the ratio is (peak - baseline) / the loaded weights' bytes in
the dtype they run in (the model's variables, plus the packed kernels, each counted once). `--checkpoint-dtype
bfloat16` writes the checkpoints in bfloat16, as the Hub ships Qwen2.5 and Llama-3.2.

    python benchmarks/load_memory.py --models gpt2,qwen2,llama --weight-dtypes float32,bfloat16,int8 \\
        --out benchmarks/results/load-memory

`--src DIR` loads with the xlagen of another checkout (its `src`), e.g. a `git worktree` of an older commit;
both runs' results go into one report with `--compare OLD.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# Hugging Face configs of the shapes (the bench's model names: xlagen.cli.bench_timing).
MODELS = {
    "gpt2": ("GPT-2-small", "gpt2", dict(), None),
    "qwen2": ("Qwen2.5-0.5B", "qwen2", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True), None),
    "llama": ("Llama-3.2-1B", "llama", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        1 << 30),
}


def write_checkpoint(folder: Path, model: str, dtype: str) -> int:
    """Writes a random checkpoint of `model`'s shapes into `folder` (once); returns its weight files' bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    _, model_type, overrides, shard_bytes = MODELS[model]
    if not (folder / "config.json").is_file():
        config = AutoConfig.for_model(model_type, **overrides)
        with torch.device("meta"):  # names and shapes only: nothing is allocated
            meta = AutoModelForCausalLM.from_config(config)
        tied = set(getattr(meta, "_tied_weights_keys", None) or ())
        shapes = {name: tuple(t.shape) for name, t in meta.state_dict().items() if name not in tied}
        rng = np.random.default_rng(0)
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        shards, current, size = [], {}, 0
        for name, shape in shapes.items():
            value = rng.random(shape, dtype=np.float32) * np.float32(0.04) - np.float32(0.02)
            if name.endswith("norm.weight") or "ln_" in name:
                value = np.ones(shape, np.float32)
            current[name] = torch.from_numpy(value).to(torch_dtype)
            size += current[name].numel() * current[name].element_size()
            if shard_bytes and size >= shard_bytes:
                shards.append(current)
                current, size = {}, 0
        if current:
            shards.append(current)
        folder.mkdir(parents=True, exist_ok=True)
        if len(shards) == 1:
            save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(folder / file), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, file))
            (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        config.dtype = dtype
        (folder / "config.json").write_text(config.to_json_string())
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


_CHILD = r"""
import json, sys

def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}

import numpy as np
import xlagen
from xlagen import native
from xlagen.modeling import TFAutoModelForCausalLM
native.load()
folder, weight_dtype = sys.argv[1], sys.argv[2]
imported = status()
if folder == "-":
    print(json.dumps({"imported": imported}))
    sys.exit()
model = TFAutoModelForCausalLM.from_pretrained(folder, weight_dtype=None if weight_dtype == "float32" else weight_dtype)
loaded = status()

def nbytes(tensor):
    return int(np.prod(tensor.shape)) * np.dtype(tensor.dtype.name if hasattr(tensor.dtype, "name") else tensor.dtype).itemsize

weights = sum(nbytes(v) for v in model.weights)
packed = {id(layer.packed_kernel): nbytes(layer.packed_kernel) for layer in model._flatten_layers()
          if getattr(layer, "packed_kernel", None) is not None}
print(json.dumps({"imported": imported, "loaded": loaded, "variable_bytes": weights,
                  "packed_bytes": sum(packed.values())}))
"""


def run_child(src: Path, folder: str, weight_dtype: str) -> dict:
    """One load in a fresh process (`folder` "-": import only)."""
    env = {**os.environ, "PYTHONPATH": str(src), "TF_CPP_MIN_LOG_LEVEL": "3"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _CHILD, folder, weight_dtype], env=env, capture_output=True,
                          text=True, timeout=1800)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}",
                "exit_code": done.returncode}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def machine() -> dict:
    """The CPU, its cores and the memory, for the record."""
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(memory / 2**30, 1)}


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def report(results: dict, compare: dict | None) -> str:
    """The markdown table: peak and after-load memory over the weights, and the old run's ratio beside it."""
    old = {(r["model"], r["weight_dtype"]): r for r in compare["runs"]} if compare else {}
    lines = [f"# Load memory: peak RSS of `from_pretrained` over the loaded weights", "",
             f"`{results['command']}`", "",
             f"{results['machine']['cpu']}, {results['machine']['cores']} cores, "
             f"{results['machine']['memory_gib']} GiB; load average {results['load_average']}; checkpoints in "
             f"{results['checkpoint_dtype']}; baseline (xlagen, TensorFlow and the kernels imported) "
             f"{gib(results['baseline']['imported']['VmRSS'])} GiB resident.", "",
             "| model | weight_dtype | checkpoint GiB | weights GiB | peak - baseline GiB | after load - baseline GiB | "
             "peak / weights |" + (" before: peak / these weights |" if old else ""),
             "| --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if old else "")]
    for run in results["runs"]:
        if "error" in run:
            lines.append(f"| {run['label']} | {run['weight_dtype']} | {gib(run['checkpoint_bytes'])} | "
                         f"failed: {run['error']} | | | |" + (" |" if old else ""))
            continue
        row = (f"| {run['label']} | {run['weight_dtype']} | {gib(run['checkpoint_bytes'])} | {gib(run['weight_bytes'])} | "
               f"{gib(run['peak_over_baseline'])} | {gib(run['after_over_baseline'])} | {run['ratio']:.2f} |")
        if old:
            before = old.get((run["model"], run["weight_dtype"]), {})
            # Over this run's weights: the same denominator (an older load may hold more than the weights it runs on).
            row += (f" {before['peak_over_baseline'] / run['weight_bytes']:.2f} |" if "ratio" in before
                    else f" {before.get('error', '-')} |")
        lines.append(row)
    if compare:
        lines += ["", f"Before: `{compare['command']}`, load average {compare['load_average']}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,qwen2,llama")
    parser.add_argument("--weight-dtypes", default="float32,bfloat16,int8")
    parser.add_argument("--checkpoint-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--checkpoints", type=Path, default=Path("/tmp/xlagen-load-memory"),
                        help="folder for the random checkpoints (kept between runs; delete it afterwards)")
    parser.add_argument("--src", type=Path, default=Path(__file__).resolve().parents[1] / "src",
                        help="the xlagen to load with (a checkout's src folder)")
    parser.add_argument("--compare", type=Path, help="an earlier run's JSON, shown beside this one")
    parser.add_argument("--out", type=Path, help="writes OUT.json and OUT.md")
    args = parser.parse_args()

    baseline = run_child(args.src, "-", "float32")
    runs = []
    for model in args.models.split(","):
        folder = args.checkpoints / f"{model}-{args.checkpoint_dtype}"
        checkpoint_bytes = write_checkpoint(folder, model, args.checkpoint_dtype)
        for weight_dtype in args.weight_dtypes.split(","):
            run = {"model": model, "label": MODELS[model][0], "weight_dtype": weight_dtype,
                   "checkpoint_bytes": checkpoint_bytes, **run_child(args.src, str(folder), weight_dtype)}
            if "error" not in run:
                run["weight_bytes"] = run["variable_bytes"] + run["packed_bytes"]
                run["peak_over_baseline"] = run["loaded"]["VmHWM"] - baseline["imported"]["VmRSS"]
                run["after_over_baseline"] = run["loaded"]["VmRSS"] - baseline["imported"]["VmRSS"]
                run["ratio"] = round(run["peak_over_baseline"] / run["weight_bytes"], 3)
            print(json.dumps(run), flush=True)
            runs.append(run)
    results = {"command": " ".join(["python", *sys.argv]), "src": str(args.src), "machine": machine(),
               "load_average": " ".join(f"{x:.1f}" for x in os.getloadavg()),
               "checkpoint_dtype": args.checkpoint_dtype, "baseline": baseline, "runs": runs}
    compare = json.loads(args.compare.read_text()) if args.compare else None
    text = report(results, compare)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
