"""The seed system (transformers 4.57 TensorFlow models, Keras 2) on the scenarios of `xlagen bench`.

Run it with the python of `benchmarks/peer/setup_seed_env.sh` (it sets TF_USE_LEGACY_KERAS=1 itself):

    benchmarks/.peer-venv/bin/python benchmarks/peer/seed_bench.py --quick

It takes the options of `xlagen bench` (without --peer) and writes the same JSON schema. The
measurement, bandwidth and report code is xlagen's own harness, src/xlagen/cli/bench.py, loaded by
file path (only the standard library at module level; xlagen itself is not imported), so both systems
are timed by the same lines. `xlagen bench --peer` runs this script with `--worker` per scenario.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import ClassVar

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # transformers' TF models need Keras 2 (tf-keras).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HARNESS = Path(__file__).resolve().parents[2] / "src" / "xlagen" / "cli" / "bench.py"


def _load_harness():
    spec = importlib.util.spec_from_file_location("xlagen_bench_harness", HARNESS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built.
    spec.loader.exec_module(module)
    return module


bench = _load_harness()


def _random_model(model_class: str, config_class: str, dtype: str, **config):
    """A transformers TF model with random weights; EOS cleared so generation never stops early.

    Args:
        model_class, config_class: transformers class names (imported here, in the peer environment).
        dtype: Only "float32": the seed system is measured in float32.
        **config: Config values; the config class's defaults are the smallest public checkpoint's shapes
            (gpt2, opt-125m, t5-small, whisper-tiny).
    """
    import transformers

    if dtype != "float32":
        raise ValueError(f"the seed system is measured in float32 only, not {dtype}")
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
    model.build_in_name_scope()
    # TF generate falls back to generation_config.eos_token_id when eos_token_id=None is passed.
    model.generation_config.eos_token_id = None
    return model


MODELS = {
    "gpt2": ("TFGPT2LMHeadModel", "GPT2Config", {}),
    "opt": ("TFOPTForCausalLM", "OPTConfig", {}),
    "t5": ("TFT5ForConditionalGeneration", "T5Config", {"decoder_start_token_id": 0}),  # as t5-small's config
    "whisper": ("TFWhisperForConditionalGeneration", "WhisperConfig", {}),
    "tiny-gpt2": ("TFGPT2LMHeadModel", "GPT2Config",
                  {"vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}),
}


class SeedSystem(bench.TFSystem):
    """transformers 4.x TF, under xlagen's benchmark model names."""

    name = "seed"
    models: ClassVar[dict] = {
        name: (lambda dtype, spec=spec: _random_model(spec[0], spec[1], dtype, **spec[2])) for name, spec in MODELS.items()}
    distributions: ClassVar[tuple[str, ...]] = ("tensorflow-cpu", "tensorflow", "tf-keras", "transformers", "numpy")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="seed_bench.py", description=__doc__.splitlines()[0])
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    bench.add_arguments(parser, sorted(SeedSystem.models))
    args = bench.resolve_arguments(parser.parse_args(argv))
    if args.worker:
        return bench.worker_main(SeedSystem(), args)
    return bench.run_benchmark(args, SeedSystem())


if __name__ == "__main__":
    sys.exit(main())
