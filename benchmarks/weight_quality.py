"""What packed weights cost in quality: float32 vs `weight_dtype="bfloat16"` and `"int8"` on one checkpoint.

Loads the checkpoint in float32 and once per weight dtype (its matrix products reading bfloat16 weights,
or int8 weights with a scale per output column), then, for each against float32:

int8 weights are multiplied in float32 by few rows and in integers (activations quantized to int8 per row)
from `Kernels.int8_integer_min_rows` rows: "int8" is that default; "int8-float32-compute" multiplies in
float32 at every row count (`int8_integer_min_rows=None`), "int8-integer" in integers at every row count,
batch-1 decoding steps included (`int8_integer_min_rows=1`). "bfloat16-tiles" multiplies every product
outside a decoding step (teacher-forced logits, prompts) on AMX's bfloat16 tiles, x rounded to bfloat16
(`bfloat16_tiles=True, packed_max_rows=0`), as prompts and encoders of more than 32 rows do by default on a
CPU with AMX; it needs one.

* teacher-forced logits over some texts: max and mean |difference|, the logits' own spread (std) for
  scale, the mean KL divergence of the packed model's next-token distribution from float32's, and how
  often the top-1 token agrees;
* greedy generation from each text's start: the share of new tokens that agree position by position,
  and where the first difference is.

    python benchmarks/weight_quality.py                 # the built-in default model
    python benchmarks/weight_quality.py --model PATH    # any causal LM checkpoint folder (or Hub id)

Writes benchmarks/results/weight-quality.{json,md} unless --no-write.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

TEXTS = (
    "In the beginning God created the heaven and the earth.",
    "And it came to pass, when the king heard the words of the book of the law, that he rent his clothes.",
    "Blessed are the meek: for they shall inherit the earth.",
    "The Lord is my shepherd; I shall not want. He maketh me to lie down in green pastures.",
    "Then said Jesus unto his disciples, If any man will come after me, let him deny himself.",
    "For God so loved the world, that he gave his only begotten Son.",
    "And the LORD spake unto Moses, saying, Speak unto the children of Israel.",
    "Now the serpent was more subtil than any beast of the field which the LORD God had made.",
)


# --weight-dtypes choice -> (the model's weight_dtype, the changes to the default kernel policy)
VARIANTS = {"bfloat16": ("bfloat16", {}), "int8": ("int8", {}),
            "bfloat16-tiles": ("bfloat16", {"bfloat16_tiles": True, "packed_max_rows": 0}),
            "int8-float32-compute": ("int8", {"int8_integer_min_rows": None, "int8_many_integer_min_rows": None}),
            "int8-integer": ("int8", {"int8_integer_min_rows": 1, "int8_many_integer_min_rows": None}),
            "int8-integer-7-bit": ("int8", {"int8_many_integer_min_rows": 1})}


def outputs(model, tokenizer, new_tokens: int, prompt_words: int, kernels=None,
            same_length: bool = False) -> list[tuple]:
    """(teacher-forced logits, greedy new tokens) of `model` for each of TEXTS, traced under the kernel
    policy `kernels` (None: the default). `same_length` cuts every text and every prompt to the shortest's
    tokens: one program of each kind per model instead of one per text."""
    from xlagen import native

    with native.tracing(kernels):
        return _outputs(model, tokenizer, new_tokens, prompt_words, same_length)


def _outputs(model, tokenizer, new_tokens: int, prompt_words: int, same_length: bool) -> list[tuple]:
    import numpy as np
    import tensorflow as tf

    greedy = tf.function(lambda ids: model.generate(
        ids, attention_mask=tf.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
        repetition_penalty=1.0, eos_token_id=None, pad_token_id=0), jit_compile=True)
    forward = tf.function(lambda ids: model(ids).logits, jit_compile=True)
    texts = [tokenizer(text)["input_ids"] for text in TEXTS]
    prompts = [tokenizer(" ".join(text.split()[:prompt_words]))["input_ids"] for text in TEXTS]
    if same_length:
        texts = [ids[:min(map(len, texts))] for ids in texts]
        prompts = [ids[:min(map(len, prompts))] for ids in prompts]
    found = []
    for text_ids, prompt_ids in zip(texts, prompts):
        ids, prompt = np.asarray([text_ids], np.int32), np.asarray([prompt_ids], np.int32)
        found.append((forward(ids).numpy()[0].astype(np.float64), greedy(prompt).numpy()[0, prompt.shape[1]:]))
    return found


def logit_measures(pairs) -> dict:
    """Over (reference, other) pairs of logits `[T, V]` (float64): the max and mean |difference|, the
    reference's spread (mean std) for scale, the mean KL divergence of other's next-token distribution from
    the reference's, and how often the top-1 token agrees."""
    import numpy as np

    max_difference = difference = kl = 0.0
    count = positions = agree = 0
    spreads = []
    for a, b in pairs:
        gap = np.abs(a - b)
        max_difference = max(max_difference, float(gap.max()))
        difference += float(gap.sum())
        count += gap.size
        spreads.append(float(a.std()))
        p = np.exp(a - a.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        log_q = b - b.max(-1, keepdims=True)
        log_q -= np.log(np.exp(log_q).sum(-1, keepdims=True))
        kl += float((p * (np.log(p + 1e-300) - log_q)).sum())
        positions += a.shape[0]
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
    return {"logits_max_abs_diff": max_difference, "logits_mean_abs_diff": difference / count,
            "logits_std": float(np.mean(spreads)), "mean_kl": kl / positions, "top1_agreement": agree / positions,
            "positions": positions}


def compare(full: list[tuple], packed: list[tuple]) -> dict:
    """The measures of the module docstring, packed model against float32, from their `outputs`."""
    import numpy as np

    generation = {"agree": 0, "tokens": 0, "first_difference": []}
    for (_, x), (_, y) in zip(full, packed):
        same = x == y
        generation["agree"] += int(same.sum())
        generation["tokens"] += same.size
        generation["first_difference"].append(int(np.argmin(same)) if not same.all() else None)
    return {
        "texts": len(TEXTS),
        **logit_measures((a, b) for (a, _), (b, _) in zip(full, packed)),
        "greedy_token_agreement": generation["agree"] / generation["tokens"],
        "greedy_first_difference": generation["first_difference"],
    }


def measure(model_name: str, weight_dtypes: list[str], new_tokens: int, prompt_words: int,
            same_length: bool = False) -> list[dict]:
    """One `compare` per weight dtype, against float32 outputs computed once."""
    from xlagen import AutoTokenizer, TFAutoModelForCausalLM, native

    tokenizer = AutoTokenizer.from_pretrained(model_name)
    full = outputs(TFAutoModelForCausalLM.from_pretrained(model_name), tokenizer, new_tokens, prompt_words,
                   same_length=same_length)
    results = []
    for variant in weight_dtypes:
        weight_dtype, changes = VARIANTS[variant]
        packed = TFAutoModelForCausalLM.from_pretrained(model_name, weight_dtype=weight_dtype)
        found = outputs(packed, tokenizer, new_tokens, prompt_words, native.Kernels().replace(**changes),
                        same_length)
        results.append({"model": model_name, "weight_dtype": variant, "new_tokens": new_tokens,
                        "prompt_words": prompt_words, "kernels_isa": native.library.isa(),
                        "amx_tiles": native.amx_tiles(), **compare(full, found)})
    return results


def native_many_integer_min_rows() -> int:
    from xlagen import native

    return native.Kernels().int8_many_integer_min_rows


def markdown(results: list[dict], model: str, arguments: str) -> str:
    def row(measure: str, value) -> str:
        return f"| {measure} | " + " | ".join(value(r) for r in results) + " |"

    return "\n".join([
        f"# Packed weights vs float32: {model}", "",
        f"Command: `python benchmarks/weight_quality.py{arguments}`", "",
        f"Kernels: the {results[0]['kernels_isa']} build, AMX tiles {'in use' if results[0]['amx_tiles'] else 'not in use'} "
        f"(int8's products of {native_many_integer_min_rows()} rows or more take 7-bit activations by default)", "",
        "| measure | " + " | ".join(f"{r['weight_dtype']} vs float32" for r in results) + " |",
        "|---|" + "---|" * len(results),
        row(f"teacher-forced positions ({results[0]['texts']} texts)", lambda r: str(r["positions"])),
        row("max abs logit difference", lambda r: f"{r['logits_max_abs_diff']:.4f}"),
        row("mean abs logit difference", lambda r: f"{r['logits_mean_abs_diff']:.5f}"),
        row("logits' std (scale)", lambda r: f"{r['logits_std']:.3f}"),
        row("mean KL(float32 \\|\\| packed), nats", lambda r: f"{r['mean_kl']:.2e}"),
        row("top-1 agreement", lambda r: f"{100 * r['top1_agreement']:.2f} %"),
        row(f"greedy tokens agreeing ({results[0]['new_tokens']} new per text)",
            lambda r: f"{100 * r['greedy_token_agreement']:.2f} %"),
        row("first differing greedy token per text",
            lambda r: ", ".join("none" if i is None else str(i) for i in r["greedy_first_difference"])), ""])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder or Hub id (default: the built-in default model)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=4, help="words of each text that prompt greedy runs")
    parser.add_argument("--weight-dtypes", nargs="+", choices=list(VARIANTS), default=["bfloat16", "int8"])
    parser.add_argument("--same-length", action="store_true",
                        help="cut texts and prompts to the shortest's tokens (one compile per model and kind)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from xlagen.cli.common import default_model_path

    model = args.model or default_model_path()
    results = measure(model, args.weight_dtypes, args.new_tokens, args.prompt_words, args.same_length)
    arguments = "".join(f" {flag} {value}" for flag, value in (
        ("--model", args.model), ("--new-tokens", args.new_tokens), ("--prompt-words", args.prompt_words),
        ("--weight-dtypes", " ".join(args.weight_dtypes))) if value is not None) + (
        " --same-length" if args.same_length else "")
    name = args.model or "the built-in default model"
    for result in results:
        result["model"] = name
    text = markdown(results, name, arguments)
    print(text)
    if not args.no_write:
        out = Path(__file__).resolve().parent / "results"
        (out / "weight-quality.json").write_text(json.dumps({"arguments": arguments, "results": results}, indent=2)
                                                 + "\n")
        (out / "weight-quality.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
