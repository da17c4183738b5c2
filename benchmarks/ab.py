"""A/B of one tracing choice: one model, `generate` traced twice in one process (choice A, then B), timed
call by call in alternation.

    python benchmarks/ab.py --compare kernel --model gpt2 --strategy greedy --batch-size 1 --calls 9

--compare:
  kernel         XLA's dot (A) against xlagen's float32 kernel (B) for the decoding products
                 (`xlagen.native.set_float32_kernel`).
  heads          the LM head (more than 16,384 columns) on XLA's dot for one row (A) against the float32
                 kernel (B, the default; `xlagen.native.FLOAT32_MAX_COLUMNS`); everything else as by default.
  rules          the kernel's former limits (A: matrices under 2 MiB, and one-row LM heads, on XLA's dot;
                 `FLOAT32_MIN_BYTES`, `FLOAT32_MAX_COLUMNS`) against every decoding product on it (B, the
                 default).
  shared-traces  blocks traced block by block (A) against once per spec (B, the default;
                 `xlagen.layers.block.SHARE_TRACES`).
  attention      long unmasked attention (Whisper's encoder and cross-attention) with XLA's ops (A) against
                 the fused native kernel (B, the default; `xlagen.native.ATTENTION_MIN_KEYS`).
  cross-attention  Whisper's decoder cross-attention (keys given transposed) with XLA's ops (A) against the
                 fused kernel (B, the default); the encoder's attention is the kernel in both.
  step-attention a decoding step's self-attention with XLA's ops (A: two dots and the softmax's fusions per
                 layer) against the native kernel (B, the default; `xlagen.native.use_step_attention`).
  argmax         greedy's choice of token with XLA's argmax (A) against the native kernel's (B, the default;
                 `xlagen.native.use_argmax`).
  fold           Whisper's cross-attention over its projected keys and values (A: projected once before the
                 loop, read per layer) against the encoder output itself with the projections folded in (B,
                 the default for greedy and sampling; `xlagen.native.use_memory_attention`).
  lookahead      the kernel's idle workers reading nothing ahead (A) against the start of the next
                 product's weights (B, the default; `xlagen.native.set_lookahead`). One program: the choice
                 is made at run time, before each call.

--max-rows N sets `xlagen.native.FLOAT32_MAX_ROWS` for both programs: with --compare kernel at beam 2 and
batch 8 (16 rows), the kernel against XLA's dot above the library's limit.

Prints the median ms/token of each and their ratio (A / B: above 1, B is faster), and checks that both
programs generate the same tokens. Random weights of the bench's shapes (`xlagen bench` model names),
8-token prompts, TensorFlow on --threads threads.
"""

from __future__ import annotations

import argparse
import json
import statistics


RUN_TIME = {"lookahead"}  # choices made before each call rather than at the trace


def _choices(compare: str):
    """{name: function that sets the choice before a trace}, A first; the last one is left in force."""
    from xlagen import native
    from xlagen.layers import block

    cap, floor_bytes, min_keys = native.FLOAT32_MAX_COLUMNS, native.FLOAT32_MIN_BYTES, native.ATTENTION_MIN_KEYS
    use_attention, use_step, use_argmax = native.use_attention_kernel, native.use_step_attention, native.use_argmax
    use_memory = native.use_memory_attention
    former_cap, former_floor = 16384, 2 * 2**20  # the limits in force before every product went on the kernel
    lookahead = native.lookahead_kib() if compare == "lookahead" else 0  # the default in force

    def columns(value):
        native.FLOAT32_MAX_COLUMNS = value

    def floor(value):
        native.FLOAT32_MIN_BYTES = value

    def share(value):
        block.SHARE_TRACES = value

    def keys(value):
        native.ATTENTION_MIN_KEYS = value

    def cross(fused):  # the layers look the function up on the module at every trace
        native.use_attention_kernel = use_attention if fused else (
            lambda *args, key_transposed=False, **kwargs: not key_transposed and use_attention(*args, **kwargs))

    def step(native_step):  # looked up on the module at every trace, like `cross`
        native.use_step_attention = use_step if native_step else (lambda *args: False)

    def argmax(native_argmax):  # looked up on the module at every trace, like `cross`
        native.use_argmax = use_argmax if native_argmax else (lambda *args: False)

    def fold(folded):  # looked up on the module at every trace, like `cross`
        native.use_memory_attention = use_memory if folded else (lambda *args: False)

    return {
        "kernel": {"xla_dot": lambda: native.set_float32_kernel(False),
                   "kernel": lambda: native.set_float32_kernel(True)},
        "heads": {"head_on_xla_dot": lambda: columns(former_cap), "head_on_kernel": lambda: columns(None)},
        "rules": {"former_rules": lambda: (floor(former_floor), columns(former_cap)),
                  "every_product": lambda: (floor(0), columns(None))},
        "shared-traces": {"block_by_block": lambda: share(False), "shared": lambda: share(True)},
        "attention": {"xla_attention": lambda: keys(2**62), "fused_attention": lambda: keys(min_keys)},
        "cross-attention": {"xla_cross_attention": lambda: cross(False), "fused_cross_attention": lambda: cross(True)},
        "step-attention": {"xla_step_attention": lambda: step(False), "step_attention": lambda: step(True)},
        "argmax": {"xla_argmax": lambda: argmax(False), "native_argmax": lambda: argmax(True)},
        "fold": {"projected_memory": lambda: fold(False), "folded_memory": lambda: fold(True)},
        "lookahead": {"no_lookahead": lambda: native.set_lookahead(0),
                      "lookahead": lambda: native.set_lookahead(lookahead)},
    }[compare], (lambda: (columns(cap), floor(floor_bytes), share(True), native.set_float32_kernel(True),
                          keys(min_keys), cross(True), step(True), argmax(True), fold(True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", default="kernel", choices=["kernel", "heads", "rules", "shared-traces",
                                                                "attention", "cross-attention", "step-attention",
                                                                "argmax", "fold", "lookahead"])
    parser.add_argument("--model", default="gpt2", help="an `xlagen bench` model: gpt2, opt, t5, whisper")
    parser.add_argument("--strategy", default="greedy", help="greedy, beam2, beam4")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--calls", type=int, default=9, help="timed calls of each program")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-rows", type=int, default=None,
                        help="xlagen.native.FLOAT32_MAX_ROWS for both programs (default: the library's)")
    args = parser.parse_args()

    import numpy as np

    from xlagen.cli import bench

    bench.configure_threads(args.threads)
    if args.max_rows is not None:
        from xlagen import native

        native.FLOAT32_MAX_ROWS = args.max_rows
    system = bench.XlagenSystem()
    model = system.build(args.model, "float32")
    scenario = bench.Scenario(args.model, args.strategy, args.batch_size, args.new_tokens, "xla")
    choices, restore = _choices(args.compare)
    at_run_time = args.compare in RUN_TIME
    programs, tokens = {}, {}
    for name, choose in choices.items():
        choose()  # read while tracing: each program keeps its choice
        if at_run_time and programs:  # one program, run under each choice
            programs[name] = next(iter(programs.values()))
        else:
            programs[name] = bench.prepare(system, model, scenario)
        function, inputs, options = programs[name]
        bench._timed(function, inputs, options, args.new_tokens)  # trace + compile (or warm up)
        model_inputs = {k: v for k, v in inputs.items() if k != "_prefix"}
        tokens[name] = np.asarray(function(**model_inputs, **dict(options, max_new_tokens=args.new_tokens)))
    if not at_run_time:
        restore()
    times = {name: [] for name in programs}
    for index in range(args.calls):
        for name in list(programs)[::-1 if index % 2 else 1]:
            if at_run_time:
                choices[name]()
            function, inputs, options = programs[name]
            times[name].append(1000.0 * bench._timed(function, inputs, options, args.new_tokens) / args.new_tokens)
    medians = {name: statistics.median(values) for name, values in times.items()}
    a, b = list(medians)
    if at_run_time:
        restore()
    print(json.dumps({"compare": args.compare, "scenario": scenario.label(),
                      "same_tokens": bool(np.array_equal(*tokens.values())),
                      "ms_per_token": {k: round(v, 2) for k, v in medians.items()},
                      "runs_ms_per_token": {k: [round(t, 2) for t in v] for k, v in times.items()},
                      f"{a}_over_{b}": round(medians[a] / medians[b], 3)}))


if __name__ == "__main__":
    main()
