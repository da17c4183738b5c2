"""A/B of two kernel policies: one model, `generate` traced under policy A, then under policy B
(`xlagen.native.Kernels`), in one process, timed call by call in alternation.

    python benchmarks/ab.py --compare kernel --model gpt2 --strategy greedy --batch-size 1 --calls 9

--compare (A against B; B is the default policy unless said otherwise):
  off              XLA's own operations only (`Kernels.OFF`: packed weights unpacked for XLA's dot) against
                   every native kernel: the whole gain of the kernels, for any --weights.
  kernel           XLA's dot for float32 weights, `Kernels(float32=False)`, against the native kernels.
  heads            the LM head (more than 16,384 columns) on XLA's dot for one row
                   (`float32_max_columns=16384`); everything else as by default.
  rules            the kernel's former limits (matrices under 2 MiB, and one-row LM heads, on XLA's dot:
                   `float32_min_bytes`, `float32_max_columns`) against every decoding product on it.
  shared-traces    blocks traced block by block (`share_traces=False`) against once per spec.
  attention        long unmasked attention (Whisper's encoder and cross-attention) with XLA's ops
                   (`attention_min_keys` out of reach) against the fused native kernel.
  cross-attention  Whisper's decoder cross-attention (keys given transposed) with XLA's ops
                   (`cross_attention=False`) against the fused kernel; the encoder's attention is the kernel
                   in both.
  step-attention   a decoding step's self-attention with XLA's ops (two dots and the softmax's fusions per
                   layer; `step_attention_min_rows` out of reach) against the native kernel.
  argmax           greedy's choice of token with XLA's argmax (`argmax=False`) against the native kernel's.
  fold             Whisper's cross-attention over its projected keys and values (projected once before the
                   loop, read per layer; `memory_attention_min_bytes` out of reach) against the encoder output
                   itself with the projections folded in (the default for greedy and sampling).
  lookahead        the kernel's idle workers reading nothing ahead (A) against the start of the next
                   product's weights (B, the default; `xlagen.native.set_lookahead`). One program: the choice
                   is made at run time, before each call.
  prefill          a generation's prompt pass on XLA's dot (`float32_prefill=False`) against the float32
                   kernel for prompts of at most `float32_max_rows` rows (prompt tokens x batch); with
                   --new-tokens 1 the time is the first token's.
  many-rows        packed weights' products of many rows (a long prompt, an encoder) unpacked for XLA's dot
                   (`many_rows=False`) against the native many-row product; --prompt-tokens 512
                   --new-tokens 1 times the first token.
  many-rows-float32  a prompt pass's float32 products of many rows on XLA's dot (`float32_many_rows=False`)
                   against the many-row product (`float32_many_rows=True`: the default with AVX-512, or
                   where XLA has one thread, see --xla-threads).
  prompt-attention a prompt's causal self-attention with XLA's ops (`prompt_attention_min_tokens=None`: two
                   dots over every cache position and the softmax's fusions per layer) against the native
                   masked attention; with --prompt-tokens 512 --new-tokens 1 the time is the first token's.
  prompt-cache     a prompt's keys and values written into the fresh cache by XLA (a transposing, padding
                   fusion per tensor on one thread; `prompt_cache_min_tokens=None`) against the native kernel on
                   the pool; with --prompt-tokens 512 --new-tokens 1 the time is the first token's.
  integer          int8 weights (with --weights int8) multiplied in float32 at every row count
                   (`int8_integer_min_rows=None`, `int8_many_integer_min_rows=None`) against int8 x int8
                   products from `int8_integer_min_rows` rows (activations quantized per row); the two
                   generate different tokens when the quantization of the activations changes a choice.
  seven-bit        int8 weights' products of many rows in integers with 8-bit activations
                   (`int8_many_integer_min_rows=None`) against 7-bit ones with a zero point from
                   `int8_many_integer_min_rows` rows; --prompt-tokens 512 --new-tokens 1 times the first token.
  bfloat16-tiles   bfloat16 weights' many-row products (with --weights bfloat16: prompts, encoders) widened and
                   multiplied in float32 against x rounded to bfloat16 on AMX's bfloat16 tiles (needs them);
                   --prompt-tokens 512 --new-tokens 1 times the first token.
  seven-bit-rows   int8 weights' products in 7-bit integers from 24 rows (8-bit from `int8_integer_min_rows`
                   below) against from 8 rows: batch 8 decoding (the default's choice where the CPU has
                   AMX's int8 tiles).

--weights bfloat16 or int8 packs the model's weights (`pack_weights`), whose products then run on the packed
kernel under any policy but `off`.

--max-rows N sets `float32_max_rows` in both policies: with --compare kernel at beam 2 and batch 8 (16 rows),
the kernel against XLA's dot above the library's limit.

Prints the median ms/token of each and their ratio (A / B: above 1, B is faster), and checks that both
programs generate the same tokens. Random weights of the bench's shapes (`xlagen bench` model names),
8-token prompts unless --prompt-tokens, TensorFlow on --threads threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

UNREACHABLE = 2**62  # a threshold no tensor reaches: that kernel never runs

POLICIES = {  # --compare: (name A, changes from the default for A), (name B, changes for B)
    "off": (("kernels_off", {"enabled": False}), ("kernels_on", {})),
    "kernel": (("xla_dot", {"float32": False}), ("kernel", {})),
    "heads": (("head_on_xla_dot", {"float32_max_columns": 16384}), ("head_on_kernel", {})),
    "rules": (("former_rules", {"float32_min_bytes": 2 * 2**20, "float32_max_columns": 16384}),
              ("every_product", {})),
    "shared-traces": (("block_by_block", {"share_traces": False}), ("shared", {})),
    "attention": (("xla_attention", {"attention_min_keys": UNREACHABLE}), ("fused_attention", {})),
    "cross-attention": (("xla_cross_attention", {"cross_attention": False}), ("fused_cross_attention", {})),
    "step-attention": (("xla_step_attention", {"step_attention_min_rows": UNREACHABLE}), ("step_attention", {})),
    "argmax": (("xla_argmax", {"argmax": False}), ("native_argmax", {})),
    "fold": (("projected_memory", {"memory_attention_min_bytes": UNREACHABLE}), ("folded_memory", {})),
    "lookahead": (("no_lookahead", {}), ("lookahead", {})),
    "integer": (("float32_compute", {"int8_integer_min_rows": None, "int8_many_integer_min_rows": None}),
                ("integer", {})),
    "seven-bit": (("eight_bit", {"int8_many_integer_min_rows": None}), ("seven_bit", {})),
    "seven-bit-rows": (("seven_bit_from_24_rows", {"int8_many_integer_min_rows": 24}),
                       ("seven_bit_from_8_rows", {"int8_many_integer_min_rows": 8})),
    "prefill": (("prefill_on_xla_dot", {"float32_prefill": False}), ("prefill_on_kernel", {})),
    "bfloat16-tiles": (("float32_compute", {"bfloat16_tiles": False}), ("bfloat16_tiles", {"bfloat16_tiles": True})),
    "many-rows": (("unpacked_for_xla_dot", {"many_rows": False}), ("many_rows", {})),
    "many-rows-float32": (("xla_dot", {"float32_many_rows": False}), ("many_rows", {"float32_many_rows": True})),
    "prompt-attention": (("xla_prompt_attention", {"prompt_attention_min_tokens": None}), ("prompt_attention", {})),
    "prompt-cache": (("xla_cache_write", {"prompt_cache_min_tokens": None}), ("native_cache_write", {})),
}
RUN_TIME = {"lookahead"}  # choices made before each call rather than at the trace


def policies(compare: str, max_rows: int | None = None) -> dict:
    """{name: Kernels} for A and B."""
    from xlagen import native

    base = native.Kernels() if max_rows is None else native.Kernels(float32_max_rows=max_rows)
    return {name: base.replace(**changes) for name, changes in POLICIES[compare]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", default="kernel", choices=list(POLICIES))
    parser.add_argument("--model", default="gpt2", help="an `xlagen bench` model: gpt2, opt, t5, whisper")
    parser.add_argument("--strategy", default="greedy", help="greedy, beam2, beam4")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (default: the bench's, 8)")
    parser.add_argument("--calls", type=int, default=9, help="timed calls of each program")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--xla-threads", type=int, default=None,
                        help="threads of TensorFlow's intra-op pool, on which XLA runs its own operations (default: "
                        "--threads); the kernels' pool keeps --threads")
    parser.add_argument("--weights", default="float32", choices=["float32", "bfloat16", "int8"],
                        help="the model's weights: float32, or packed as bfloat16 or int8")
    parser.add_argument("--max-rows", type=int, default=None,
                        help="float32_max_rows in both policies (default: the library's)")
    args = parser.parse_args()

    import numpy as np

    from xlagen import native
    from xlagen.cli import bench_timing as bench

    if args.xla_threads is not None:  # XLA's pool apart: the kernels' keeps --threads
        os.environ.setdefault("XLAGEN_NATIVE_THREADS", str(args.threads))
    bench.configure_threads(args.threads, args.xla_threads)
    system = bench.XlagenSystem()
    weights = {"float32": "float32", "bfloat16": bench.PACKED_BF16, "int8": bench.PACKED_INT8}[args.weights]
    model = system.build(args.model, weights)
    scenario = bench.Scenario(args.model, args.strategy, args.batch_size, args.new_tokens, "xla",
                              **({"prompt_tokens": args.prompt_tokens} if args.prompt_tokens else {}))
    at_run_time = args.compare in RUN_TIME
    lookahead = native.lookahead_kib() if at_run_time else 0  # the default in force
    before_call = {"no_lookahead": lambda: native.set_lookahead(0), "lookahead": lambda: native.set_lookahead(lookahead)}
    programs, tokens = {}, {}
    for name, kernels in policies(args.compare, args.max_rows).items():
        if at_run_time and programs:  # one program, run under each choice
            programs[name] = next(iter(programs.values()))
        else:
            programs[name] = bench.prepare(system, model, scenario)
        function, inputs, options = programs[name]
        if at_run_time:
            before_call[name]()
        with native.tracing(kernels):  # the trace happens at the first call; the program keeps its policy
            bench.timed(function, inputs, options, args.new_tokens)
        model_inputs = {k: v for k, v in inputs.items() if k != "_prefix"}
        tokens[name] = np.asarray(function(**model_inputs, **dict(options, max_new_tokens=args.new_tokens)))
    times = {name: [] for name in programs}
    for index in range(args.calls):
        for name in list(programs)[::-1 if index % 2 else 1]:
            if at_run_time:
                before_call[name]()
            function, inputs, options = programs[name]
            times[name].append(1000.0 * bench.timed(function, inputs, options, args.new_tokens) / args.new_tokens)
    medians = {name: statistics.median(values) for name, values in times.items()}
    a, b = list(medians)
    if at_run_time:
        native.set_lookahead(lookahead)
    print(json.dumps({"compare": args.compare, "scenario": scenario.label(), "weights": args.weights,
                      "isa": native.library.isa(),
                      "same_tokens": bool(np.array_equal(*tokens.values())),
                      "ms_per_token": {k: round(v, 2) for k, v in medians.items()},
                      "runs_ms_per_token": {k: [round(t, 2) for t in v] for k, v in times.items()},
                      f"{a}_over_{b}": round(medians[a] / medians[b], 3)}))


if __name__ == "__main__":
    main()
