#!/usr/bin/env bash
# Creates the environment of the comparison's reference (benchmarks/peer/compare.py):
# transformers 4.57.6 TensorFlow models on tensorflow-cpu 2.21.0 with Keras 2 (tf-keras 2.21.0).
#
#   bash benchmarks/peer/setup_transformers_tf.sh [VENV_DIR]     # default: benchmarks/.peer-venv
#
# tf-keras is installed with --no-deps: its requirement on `tensorflow` would pull the full
# tensorflow wheel over tensorflow-cpu. The reference runs with TF_USE_LEGACY_KERAS=1 (compare.py sets it).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${1:-$HERE/../.peer-venv}"
# shellcheck source=venv.sh
. "$HERE/venv.sh"
make_venv "$VENV"
"$VENV/bin/python" -m pip install --quiet "tensorflow-cpu==2.21.0" "transformers==4.57.6"
"$VENV/bin/python" -m pip install --quiet --no-deps "tf-keras==2.21.0"

TF_USE_LEGACY_KERAS=1 TF_CPP_MIN_LOG_LEVEL=2 "$VENV/bin/python" - <<'PY'
import tensorflow as tf, tf_keras, transformers
from transformers import TFGPT2LMHeadModel  # Fails here if the TF side of transformers is unusable.
print(f"transformers TensorFlow ready: tensorflow {tf.__version__}, tf-keras {tf_keras.__version__}, "
      f"transformers {transformers.__version__}")
PY
echo "$VENV"
