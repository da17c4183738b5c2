"""What the serving benchmarks share (imported from the scripts beside it): GPT-2 small's shapes with random
weights that never stop early, the built-in model's tokenizer, and the report's output."""

from __future__ import annotations

import json


def serving_model(threads: int | None):
    """`(model, tokenizer, threads)`: TensorFlow on `threads` threads (`xlagen bench`'s setting; None: every
    core), GPT-2 small's shapes with random weights, float32, with no EOS (every request gets all the tokens it
    asks for), and the built-in model's tokenizer (its text as a server would decode it)."""
    from xlagen import AutoTokenizer
    from xlagen.cli import bench
    from xlagen.cli.generate import default_model_path

    threads = bench.configure_threads(threads)
    model = bench.XlagenSystem().build("gpt2", "float32")
    if model.generation_config is not None:
        model.generation_config = model.generation_config.update(eos_token_id=None)
    return model, AutoTokenizer.from_pretrained(default_model_path()), threads


def write_report(report: dict, out: str | None) -> None:
    """Prints `report` as JSON, and writes it to `out` too (unless None)."""
    text = json.dumps(report, indent=1)
    print(text)
    if out:
        with open(out, "w") as file:
            file.write(text + "\n")
