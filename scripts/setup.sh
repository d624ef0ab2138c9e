#!/usr/bin/env bash
# Install rollwise and its dependencies into the current Python. torch==2.13.0 goes first where
# no torch is present: a bare `torch` requirement would download a CUDA build of several GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch" 2>/dev/null; then
  $PY -m pip install -q torch==2.13.0
fi
$PY -m pip install -q -e ".[dev]"
