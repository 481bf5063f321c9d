#!/usr/bin/env bash
# The path GPU users take, checked on a CUDA machine in one command (CI and the CPU tests cannot run it):
#   bash scripts/gpu_check.sh [STEPS]            (default 300 optimizer steps per method)
# 1. the bf16 path (trainer.precision=bf16: autocast over fp32 master weights, target in bf16) of every draft
#    method on the real SmolLM2-135M-Instruct: EAGLE3, EAGLE 3.1 (2 layers), P-EAGLE, DFlash, each with a
#    finite loss that fell and an export that passes `export --check`;
# 2. DeepSpeed ZeRO-2 and ZeRO-3 (DeepSpeed bf16) on every visible GPU (torchrun), same checks;
# 3. vLLM's CUDA build (its own venv, .serving-gpu: vllm==0.32.0, speculators==0.9.0) serving every export
#    with speculative output equal to the target's greedy output (python -m specforge_lite.evaluate.served).
# One line per check: "PASS <check>: <figures>" or "FAIL <check>: <reason> (log: <file>)"; exit 1 if any
# check failed. Logs and runs go to runs/gpu_check/. Needs the project venv (bash scripts/setup.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-300}
OUT=runs/gpu_check
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
failed=0
pass() { echo "PASS $1: $2"; }
fail() { echo "FAIL $1: $2 (log: $3)"; failed=1; }

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "FAIL cuda: torch sees no CUDA device (this script is for a GPU machine; on CPU run bash scripts/test.sh)"
  exit 1
fi
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
GPU=$("$PY" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'{p.name}, {p.total_memory / 2**30:.0f} GiB')")
pass cuda "$NGPU x $GPU, torch $("$PY" -c 'import torch; print(torch.__version__)')"

# the loss fell (mean of the last 10 logged steps below the first 10), every loss finite; figures of the run
summarise() {
  "$PY" - "$1" <<'EOF'
import json, math, sys
rows = [json.loads(x) for x in open(sys.argv[1] + "/metrics.jsonl") if x.strip()]
losses = [r["loss"] for r in rows if "loss" in r]
if not losses or not all(math.isfinite(x) for x in losses):
    sys.exit(f"a loss is not finite or none was logged ({len(losses)} rows)")
head, tail = sum(losses[:10]) / len(losses[:10]), sum(losses[-10:]) / len(losses[-10:])
if not tail < head:
    sys.exit(f"the loss did not fall: first 10 steps {head:.3f}, last 10 {tail:.3f}")
speed = sorted(r.get("tokens_per_s") or 0 for r in rows)[len(rows) // 2]
print(f"{rows[-1]['step']} steps, loss {head:.3f} -> {tail:.3f}, {speed:.0f} tok/s (median)")
EOF
}

# name | train.py overrides | launcher (one process, or torchrun over every GPU)
CHECKS=(
  "eagle3_bf16||1"
  "eagle31_2layers_bf16|draft.norm_before_fc=true draft.norm_output=true draft.num_layers=2|1"
  "peagle_bf16|draft.parallel_drafting=true|1"
  "dflash_bf16|draft.method=dflash draft.ttt_length=3 eval.num_draft_tokens=3|1"
  "zero2_bf16|trainer=zero2|$NGPU"
  "zero3_bf16|trainer=zero3|$NGPU"
)
RUNS=()
for check in "${CHECKS[@]}"; do
  IFS='|' read -r name overrides ranks <<<"$check"
  run="$OUT/$name"
  rm -rf "$run"
  launch=("$PY")
  [ "$ranks" -gt 1 ] && launch=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$ranks")
  # shellcheck disable=SC2086
  if ! "${launch[@]}" train.py model.dtype=bfloat16 trainer.precision=bf16 trainer.max_steps="$STEPS" trainer.max_minutes=null \
       tracker=none eval.enabled=false output_dir="$run" $overrides >"$run.log" 2>&1; then
    fail "$name" "train.py exited non-zero" "$run.log"; continue
  fi
  if ! figures=$(summarise "$run" 2>&1); then fail "$name" "$figures" "$run.log"; continue; fi
  if ! "$PY" -m specforge_lite.export --check "$run/final" >"$run.check.log" 2>&1; then
    fail "$name" "its export fails the check" "$run.check.log"; continue
  fi
  pass "$name" "$figures ($ranks GPU(s))"
  RUNS+=("$run")
done

# vLLM (CUDA build) in its own venv, serving every export on the prompts our evaluation chose
SERVING=.serving-gpu
if [ ! -x "$SERVING/bin/python" ] || ! "$SERVING/bin/python" -c "import vllm, speculators" 2>/dev/null; then
  "$PY" -m venv "$SERVING" >/dev/null && "$SERVING/bin/python" -m pip install -q vllm==0.32.0 speculators==0.9.0 \
      >"$OUT/serving_setup.log" 2>&1 || fail vllm_setup "vllm==0.32.0 could not be installed" "$OUT/serving_setup.log"
fi
if "$SERVING/bin/python" -c "import vllm" 2>/dev/null; then
  for run in "${RUNS[@]}"; do
    name=$(basename "$run")
    k=3  # every method above was trained for k=3 (DFlash's block: ttt_length 3)
    "$PY" -m specforge_lite.evaluate --run-dir "$run" --k "$k" --num-prompts 8 >"$run.eval.log" 2>&1 ||
      { fail "${name}_eval" "our evaluation failed" "$run.eval.log"; continue; }
    if SPECFORGE_LITE_SERVING_PYTHON="$SERVING/bin/python" "$PY" -m specforge_lite.evaluate.served "$run" --k "$k" \
         >"$run.served.log" 2>&1; then
      pass "${name}_vllm" "$(grep -m1 -o 'vLLM acceptance length.*' "$run.served.log")"
    else
      fail "${name}_vllm" "vLLM refused the export or its output differs from greedy" "$run.served.log"
    fi
  done
fi
exit "$failed"
