#!/usr/bin/env bash
# The path GPU users take, checked on a CUDA machine in one command (CI and the CPU tests cannot run it):
#   bash scripts/gpu_check.sh [STEPS]            (default 300 optimizer steps per method)
# 1. the bf16 path (trainer.precision=bf16: autocast over fp32 master weights, target in bf16) of every draft
#    method on the real SmolLM2-135M-Instruct: EAGLE3, EAGLE 3.1 (2 layers), P-EAGLE, DFlash, each with a
#    finite loss that fell and an export that passes `export --check`;
# 2. DeepSpeed ZeRO-2 and ZeRO-3 (DeepSpeed bf16) on every visible GPU (torchrun, also with one GPU), same checks;
# 3. vLLM's CUDA build (its own venv, .serving-gpu: vllm==0.32.0, speculators==0.9.0) serving every export
#    with speculative output equal to the target's greedy output (python -m specforge_lite.evaluate.served).
# The checks run in the order of their value (the default path first, then DeepSpeed, then each other
# method), so a run cut short has covered the most. One line per check: "PASS <check>: <figures>" (steps,
# loss, tokens/s, peak GPU memory used as nvidia-smi reads it, seconds) or "FAIL <check>: <reason> (log:
# <file>)"; exit 1 if any check failed. Logs and runs go to runs/gpu_check/. Needs the project venv (bash
# scripts/setup.sh).
# Environment (all optional):
#   PY=python3                       the Python that runs everything (default .venv/bin/python)
#   GPU_CHECK_MODEL=PRESET           the target instead of the default, e.g. smollm2_135m_shape (SmolLM2-135M's
#                                    shape with random weights: a machine that cannot fetch the real weights)
#   GPU_CHECK_ARGS="k=v ..."         more train.py overrides for every check (data.generation.max_conversations=128)
#   GPU_CHECK_ONLY="name ..."        only these checks, in this order (names as printed, e.g. "eagle3_bf16 zero2_bf16")
#   GPU_CHECK_TIMEOUT=SECONDS        a training or export command running longer fails its check (a hang ends)
#   GPU_CHECK_VLLM=skip              do not set up or run vLLM (one SKIP line says so): e.g. a machine without network
set -uo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-300}
LOGS=runs/gpu_check
PY=${PY:-.venv/bin/python}
MODEL=${GPU_CHECK_MODEL:-}
read -r -a EXTRA <<<"${GPU_CHECK_ARGS:-}"
[ -n "$MODEL" ] && EXTRA=("model=$MODEL" "${EXTRA[@]}")
TIMEOUT=()
[ -n "${GPU_CHECK_TIMEOUT:-}" ] && TIMEOUT=(timeout --kill-after 15 "$GPU_CHECK_TIMEOUT")
mkdir -p "$LOGS"
failed=0
pass() { echo "PASS $1: $2"; }
fail() { echo "FAIL $1: $2 (log: $3)"; failed=1; }
# why a command failed: its exit status, named when it is the time limit's
why() { [ "$1" -eq 124 ] || [ "$1" -eq 137 ] && echo "$2 ran past GPU_CHECK_TIMEOUT=${GPU_CHECK_TIMEOUT:-}s" ||
          echo "$2 exited with status $1"; }

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "FAIL cuda: torch sees no CUDA device (this script is for a GPU machine; on CPU run bash scripts/test.sh)"
  exit 1
fi
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
GPU=$("$PY" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'{p.name}, {p.total_memory / 2**30:.0f} GiB')")
VERSIONS=$("$PY" -c "
import importlib.metadata as m
print(', '.join(f'{n} {m.version(n)}' for n in ('torch', 'transformers', 'deepspeed', 'datasets')))" 2>&1 | tail -1)
pass cuda "$NGPU x $GPU; $VERSIONS; target ${MODEL:-the default (smollm2_135m)}"

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

# the most GPU memory any GPU had in use (MiB, every process: nvidia-smi) while it runs; stopped by its caller
sample_gpu_memory() {
  local peak=0 now
  while now=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | sort -n | tail -1) &&
        [ -n "$now" ]; do
    [ "$now" -gt "$peak" ] && { peak=$now; echo "$peak" >"$1"; }
    sleep 0.5
  done
}

# name | train.py overrides | launcher (1: one process; all: torchrun over every GPU, one GPU included)
CHECKS=(
  "eagle3_bf16||1"
  "zero2_bf16|trainer=zero2|all"
  "dflash_bf16|draft=dflash draft.ttt_length=3 eval.num_draft_tokens=3|1"
  "zero3_bf16|trainer=zero3|all"
  "peagle_bf16|draft.parallel_drafting=true|1"
  "eagle31_2layers_bf16|draft.norm_before_fc=true draft.norm_output=true draft.num_layers=2|1"
)
if [ -n "${GPU_CHECK_ONLY:-}" ]; then
  chosen=()
  for want in ${GPU_CHECK_ONLY//,/ }; do
    match=""
    for check in "${CHECKS[@]}"; do [ "${check%%|*}" = "$want" ] && match=$check; done
    if [ -z "$match" ]; then
      fail "$want" "no such check (GPU_CHECK_ONLY names: ${CHECKS[*]%%|*})" "$0"
    else
      chosen+=("$match")
    fi
  done
  CHECKS=("${chosen[@]}")
fi
RUNS=()
for check in "${CHECKS[@]}"; do
  IFS='|' read -r name overrides ranks <<<"$check"
  run="$LOGS/$name"
  rm -rf "$run" "$run.mem"
  launch=("$PY")
  [ "$ranks" = all ] && launch=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$NGPU")
  start=$SECONDS
  sample_gpu_memory "$run.mem" & sampler=$!
  # shellcheck disable=SC2086
  "${TIMEOUT[@]}" "${launch[@]}" train.py model.dtype=bfloat16 trainer.precision=bf16 trainer.max_steps="$STEPS" \
    trainer.max_minutes=null tracker=none eval.enabled=false output_dir="$run" $overrides "${EXTRA[@]}" \
    >"$run.log" 2>&1
  status=$?
  kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
  memory="peak GPU memory $(cat "$run.mem" 2>/dev/null || echo '?') MiB (nvidia-smi), $((SECONDS - start)) s"
  if [ "$status" -ne 0 ]; then fail "$name" "$(why "$status" train.py), $memory" "$run.log"; continue; fi
  if ! figures=$(summarise "$run" 2>&1); then fail "$name" "$figures" "$run.log"; continue; fi
  "${TIMEOUT[@]}" "$PY" -m specforge_lite.export --check "$run/final" >"$run.check.log" 2>&1
  status=$?
  if [ "$status" -ne 0 ]; then
    fail "$name" "its export fails the check ($(why "$status" 'export --check'))" "$run.check.log"; continue
  fi
  pass "$name" "$figures, $memory ($([ "$ranks" = all ] && echo "torchrun, $NGPU GPU(s)" || echo "1 GPU"))"
  RUNS+=("$run")
done

# vLLM (CUDA build) in its own venv, serving every export on the prompts our evaluation chose
if [ "${GPU_CHECK_VLLM:-}" = skip ]; then
  echo "SKIP vllm: not set up or run (GPU_CHECK_VLLM=skip): no export was served by vLLM"
  exit "$failed"
fi
SERVING=.serving-gpu
if [ ! -x "$SERVING/bin/python" ] || ! "$SERVING/bin/python" -c "import vllm, speculators" 2>/dev/null; then
  # one try, short network time-outs: a machine without network fails here in seconds, not after retries
  { "$PY" -m venv "$SERVING" && "$SERVING/bin/python" -m pip install -q --retries 0 --timeout 10 \
      vllm==0.32.0 speculators==0.9.0; } >"$LOGS/serving_setup.log" 2>&1 ||
    fail vllm_setup "vllm==0.32.0 could not be installed: $(grep -m1 -i 'error' "$LOGS/serving_setup.log" |
      cut -c1-200)" "$LOGS/serving_setup.log"
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
