"""`xlagen hlo`: write the HLO of a model's whole generate program (before and after XLA's passes)."""

from __future__ import annotations

import argparse

from xlagen.cli.common import UsageError, default_model_path, positive_int

STAGES = ("hlo", "optimized_hlo", "optimized_hlo_dot")  # xlagen.generation.introspect's (it imports TensorFlow)


def add_parser(subparsers, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Registers `hlo` on the `xlagen` sub-parsers."""
    parser = subparsers.add_parser("hlo", parents=parents, help="write the HLO of the generate program",
                                   description="Write the XLA HLO of tf.function(model.generate, "
                                   "jit_compile=True) for one input shape: as lowered, and optimized.")
    parser.add_argument("--model", "-m", metavar="PATH_OR_ID",
                        help="Hugging Face checkpoint folder or Hub id (default: the built-in model)")
    parser.add_argument("--output", "-o", metavar="DIR", required=True, help="folder for generate.<stage>.txt")
    parser.add_argument("--batch-size", type=positive_int, default=1, metavar="B",
                        help="rows of the traced input (default: 1)")
    parser.add_argument("--prompt-length", type=positive_int, default=8, metavar="P",
                        help="prompt tokens of the traced input (default: 8)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="N",
                        help="new tokens the program generates (default: 32)")
    parser.add_argument("--num-beams", type=positive_int, default=1, metavar="K",
                        help="beam search with K beams (default: 1, greedy or sampling)")
    parser.add_argument("--do-sample", action="store_true", help="the sampling program instead of greedy")
    parser.add_argument("--stages", type=_stages, default=("hlo", "optimized_hlo"), metavar="STAGES",
                        help=f"comma-separated, among {', '.join(STAGES)} (default: hlo,optimized_hlo)")
    parser.set_defaults(run=run, prepare=prepare)
    return parser


def _stages(value: str) -> tuple[str, ...]:
    """argparse type: comma-separated stage names."""
    stages = tuple(s.strip() for s in value.split(",") if s.strip())
    unknown = [s for s in stages if s not in STAGES]
    if not stages or unknown:
        raise argparse.ArgumentTypeError(f"expected comma-separated names among {', '.join(STAGES)}, got {value!r}")
    return stages


def prepare(args: argparse.Namespace) -> None:
    """Checks before TensorFlow is imported: a model to use, and options that go together.

    Raises:
        UsageError: Without a model, or for sampling with beams.
    """
    args.model_name = args.model or default_model_path()
    if args.model_name is None:
        raise UsageError("xlagen hlo needs --model PATH_OR_ID: the built-in default model is missing from this "
                         "installation")
    if args.do_sample and args.num_beams > 1:
        raise UsageError("--do-sample with --num-beams > 1 (beam sampling) is not supported: drop one of them")


def run(args: argparse.Namespace) -> int:
    """Runs `xlagen hlo`; prints the written paths."""
    from xlagen.generation.introspect import write_generate_ir
    from xlagen.modeling import TFAutoModelForGeneration

    if getattr(args, "model_name", None) is None:  # Called without `main`.
        prepare(args)
    model = TFAutoModelForGeneration.from_pretrained(args.model_name)
    paths = write_generate_ir(model, args.output, args.stages, batch_size=args.batch_size,
                              prompt_length=args.prompt_length, max_new_tokens=args.max_new_tokens,
                              num_beams=args.num_beams, do_sample=args.do_sample)
    for path in paths:
        print(path)
    return 0
