"""Runs `xlagen bench` (the logic lives in src/xlagen/cli/bench.py): `python benchmarks/xlagen_bench.py --quick`."""

import sys

from xlagen.cli.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
