#!/usr/bin/env bash
# The project's venv (scripts/setup.sh) plus the benchmark peers of the `bench` extra
# (pyproject.toml): TRL 1.16.0 and accelerate for benchmarks/vs_trl.py, RLlib's extra imports
# for benchmarks/cartpole.py. They never belong in the main install.
#
# Installed with uv like setup.sh. torch stays exactly as setup.sh installed it: a constraint
# pins torch==2.13.0, so no peer can pull another (e.g. a multi-GB CUDA) build; the PyPI
# torchvision/torchaudio/torchcodec that break transformers beside the CPU torch are removed
# again afterwards.
#
# Idempotent like setup.sh: a stamp of the inputs (these scripts, pyproject.toml,
# requirements/) is kept in the venv. Same environment variables as setup.sh.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SLUICE_VENV:-$ROOT/.venv}"
STAMP="$VENV/.sluice-setup-bench-stamp"
TORCH_PIN="torch==2.13.0"

bash "$ROOT/scripts/setup.sh"

# shellcheck source=scripts/uv_install.sh
source "$ROOT/scripts/uv_install.sh"
want="$(inputs_stamp "$ROOT/scripts/setup_bench.sh")"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    echo "setup_bench: $VENV is up to date"
    exit 0
fi

uv_bootstrap
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "$TORCH_PIN" > "$constraints"
torch_before="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
uv_install -c "$constraints" -e "$ROOT[bench]"
uv_uninstall torchvision torchaudio torchcodec

"$VENV/bin/python" - "$torch_before" <<'PY'
import sys

import torch
import trl

if torch.__version__ != sys.argv[1]:
    sys.exit(f"setup_bench: torch changed from {sys.argv[1]} to {torch.__version__}")
print("setup_bench: trl", trl.__version__, "with torch", torch.__version__)
PY
echo "$want" > "$STAMP"
echo "setup_bench: done"
