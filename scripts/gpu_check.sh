#!/usr/bin/env bash
# The GPU check (rollwise/bench/gpu_check.py): on a machine with one NVIDIA GPU, torch,
# transformers and peft, and no network or vLLM, within 8 minutes, one JSON: bench gpu at
# SmolLM2-135M's and Qwen2.5-0.5B's shapes, 20 steps of the default run on the GPU (it must
# learn), FSDP2 on one GPU, and a profile of where the GPU's time goes.
#   bash scripts/gpu_check.sh [OUT.json]                      # default gpu_check.json
#   GPU_CHECK_DEVICE=cpu bash scripts/gpu_check.sh OUT.json   # the tiny CPU mode CI runs
# rollwise's other dependencies install from ./.whl when present (made where there is a
# network: pip download -d .whl <the packages this script names as missing>).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_check.json}"
device="${GPU_CHECK_DEVICE:-cuda}"
py="${PYTHON:-python3}"

missing=$("$py" - <<'PY'
import importlib.util
need = {"torch": "torch", "transformers": "transformers", "peft": "peft",
        "safetensors": "safetensors", "pydantic": "pydantic", "yaml": "pyyaml",
        "rich": "rich", "pyarrow": "pyarrow", "math_verify": "math-verify"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PY
)
if [ -n "$missing" ]; then
  if [ -d .whl ]; then  # into a folder of their own: the machine's site-packages may be read-only
    site="${WHEEL_SITE:-/tmp/rollwise-site}"
    "$py" -m pip install -q --no-index --no-deps --target "$site" .whl/*.whl ||
      { echo "gpu_check: could not install the wheels of .whl/ into $site"; exit 2; }
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu_check: missing Python packages: $missing. Install them, or put their wheels and"
    echo "  their dependencies' in .whl/ on a machine with a network (pip download"
    echo "  --only-binary=:all: --python-version X.Y -d .whl $missing) and carry it along."
    exit 2
  fi
fi
tiny=()
[ "$device" = cpu ] && tiny=(--tiny)
# 8 minutes at most: a part that hangs ends the check, and the JSON keeps the finished parts
timeout -s INT 480 "$py" -m rollwise.bench.gpu_check --device "$device" "${tiny[@]}" --out "$out"
rc=$?
echo "gpu_check: exit $rc, results in $out"
exit $rc
