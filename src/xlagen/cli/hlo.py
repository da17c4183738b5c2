"""`xlagen hlo`: write the HLO of a model's whole generate program (before and after XLA's passes)."""

from __future__ import annotations

import argparse

from xlagen.cli.generate import UsageError, _positive_int, default_model_path


def add_parser(subparsers, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Registers `hlo` on the `xlagen` sub-parsers."""
    parser = subparsers.add_parser("hlo", parents=parents, help="write the HLO of the generate program",
                                   description="Write the XLA HLO of tf.function(model.generate, "
                                   "jit_compile=True) for one input shape: as lowered, and optimized.")
    parser.add_argument("--model", "-m", metavar="PATH_OR_ID", help="Hugging Face checkpoint folder or Hub id")
    parser.add_argument("--output", "-o", metavar="DIR", required=True, help="folder for generate.<stage>.txt")
    parser.add_argument("--batch-size", type=_positive_int, default=1)
    parser.add_argument("--prompt-length", type=_positive_int, default=8)
    parser.add_argument("--max-new-tokens", type=_positive_int, default=32)
    parser.add_argument("--num-beams", type=_positive_int, default=1)
    parser.add_argument("--do-sample", action="store_true")
    parser.add_argument("--stages", default="hlo,optimized_hlo",
                        help="comma-separated: hlo, optimized_hlo, optimized_hlo_dot")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Runs `xlagen hlo`; prints the written paths."""
    from xlagen.generation.introspect import write_generate_ir
    from xlagen.modeling import TFAutoModelForGeneration

    model_name = args.model or default_model_path()
    if model_name is None:
        raise UsageError("xlagen hlo needs --model PATH_OR_ID")
    model = TFAutoModelForGeneration.from_pretrained(model_name)
    stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())
    paths = write_generate_ir(model, args.output, stages, batch_size=args.batch_size,
                              prompt_length=args.prompt_length, max_new_tokens=args.max_new_tokens,
                              num_beams=args.num_beams, do_sample=args.do_sample)
    for path in paths:
        print(path)
    return 0
