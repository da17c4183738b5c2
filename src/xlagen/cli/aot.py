"""`xlagen aot`: compile a fixed-shape greedy generate into C++ (header + objects) with tfcompile."""

from __future__ import annotations

import argparse

from xlagen.cli.common import UsageError, positive_int


def add_parser(subparsers, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Registers `aot` on the `xlagen` sub-parsers."""
    parser = subparsers.add_parser(
        "aot", parents=parents, help="compile greedy generation ahead of time into C++ (x86-64 CPU)",
        description="Compile greedy generation for a fixed batch size, prompt length and number of new "
        "tokens into a C++ header and object files with TensorFlow's AOT compiler (saved_model_cli "
        "aot_compile_cpu), plus an example program, its Makefile and a README in OUT_DIR (read it for how to "
        "build and call the program).")
    parser.add_argument("model", metavar="MODEL", help="Hugging Face checkpoint folder or Hub id")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="output folder")
    parser.add_argument("--batch-size", type=positive_int, default=1, help="prompts per run (default 1)")
    parser.add_argument("--prompt-length", type=positive_int, default=8,
                        help="prompt length; shorter prompts are left-padded at run time (default 8)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=32, help="new tokens (default 32)")
    parser.add_argument("--eos-token-id", type=int, help="override the model's EOS id")
    parser.add_argument("--build", action="store_true", help="also build the example program (make, g++)")
    parser.add_argument("--jobs", "-j", type=positive_int, default=2, help="parallel jobs for --build")
    # Accepted so that asking for them gives a clear error rather than an unknown-option one.
    parser.add_argument("--do-sample", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--num-beams", type=positive_int, default=1, help=argparse.SUPPRESS)
    parser.set_defaults(run=run, prepare=prepare)
    return parser


def prepare(args: argparse.Namespace) -> None:
    """Checks, before TensorFlow is imported, that greedy decoding is asked for.

    Raises:
        UsageError: For --do-sample or --num-beams > 1.
    """
    if args.do_sample or args.num_beams != 1:
        raise UsageError("xlagen aot compiles greedy decoding only: sampling and beam search need "
                         "options the fixed program cannot take")


def run(args: argparse.Namespace) -> int:
    """Runs `xlagen aot`; prints the files written (and the program built)."""
    prepare(args)
    from xlagen.deploy.aot import aot_compile, build_example

    options = {} if args.eos_token_id is None else {"eos_token_id": args.eos_token_id}
    program = aot_compile(args.model, args.out_dir, batch_size=args.batch_size,
                          prompt_length=args.prompt_length, max_new_tokens=args.max_new_tokens, **options)
    for path in (program.header, *program.objects):
        print(path)
    print(f"tfcompile: {program.compile_seconds:.1f} s", flush=True)
    if args.build:
        print(build_example(program.out_dir, jobs=args.jobs))
    else:
        print(f"build the example program with: make -C {program.out_dir} -j{args.jobs}")
    return 0
