#!/usr/bin/env bash
# Creates the environment of the CTranslate2 reference (benchmarks/peer/compare.py --reference ctranslate2):
# ctranslate2 with its converter, and transformers on PyTorch CPU to build the random-weight models it converts.
#
#   bash benchmarks/peer/setup_ctranslate2.sh [VENV_DIR]     # default: benchmarks/.ct2-venv
#
# torch is pinned to 2.13.0, the version of the project's test environment (CPU build).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${1:-$HERE/../.ct2-venv}"
# shellcheck source=venv.sh
. "$HERE/venv.sh"
make_venv "$VENV"
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0" "ctranslate2==4.8.5" "transformers" "numpy"

"$VENV/bin/python" - <<'PY'
import ctranslate2, torch, transformers
from ctranslate2.converters import TransformersConverter  # Fails here if the converter cannot load.
print(f"CTranslate2 ready: ctranslate2 {ctranslate2.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}; CPU compute types: "
      f"{sorted(ctranslate2.get_supported_compute_types('cpu'))}")
PY
echo "$VENV"
