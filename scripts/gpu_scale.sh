#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md in one command, for a lent machine with no network:
#   bash scripts/gpu_scale.sh --wheels  (here, with network: fill .whl/ for a machine without one)
#   bash scripts/gpu_scale.sh           (there: results in $OUT, else runs/gpu_scale/: *.json, *.log)
# 1. installs the wheels carried in .whl/ours (transformers at the tested version) and .whl/peers (SpecForge,
#    speculators and what the image lacks: studies/peers/gpu_wheels.sh makes them);
# 2. bench gpu_scale on Llama-3.1-8B's shape: ours (each TTT attention way) against both peers, then DFlash
#    and DSpark steps;
# 3. Qwen3-32B's shape online at 8k (64 GB of bf16 weights: one H200, or an H100 with ZeRO-3 offload);
# 4. the sizing command's prediction for that run (python -m specforge_lite.plan, fake tensors on the host), to
#    hold against 3's measured peak (blockwise attention: its peak was within 3% of flex's at Llama-3.1-8B's shape).
# Each part has a time limit so the whole fits one 10-minute call; a part cut short keeps its finished rows.
# GPU_SCALE_DRY=1: the same commands at tiny shapes on a CPU (tests/test_gpu_scale.py), so a lent GPU finds a
# script whose every command runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_scale}
PY=${PY:-python3}
if [ "${1:-}" = --wheels ]; then  # transformers at the version the project tests (the image has another)
  rm -rf .whl/ours && mkdir -p .whl/ours
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 -d .whl/ours "transformers==$(grep -Po '^transformers==\K.*' docker/constraints.txt)"
  exec bash studies/peers/gpu_wheels.sh
fi
mkdir -p "$OUT"
dry=() big=qwen3_32b big_len=8192 plan_model=qwen3_32b
[ -n "${GPU_SCALE_DRY:-}" ] && dry=(--dry-run) big=tiny big_len=160 plan_model=llama3_tiny
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
install() {  # wheels of folder $1 into $2, nothing resolved (no network)
  ls "$1"/*.whl >/dev/null 2>&1 &&
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" "$1"/*.whl
}
peers=()
if [ -z "${GPU_SCALE_DRY:-}" ]; then  # (a dry run uses the environment it is in)
  install .whl/ours /tmp/site && export PYTHONPATH=/tmp/site:$PWD
  install .whl/peers /tmp/peers-site && peers=(--peers specforge,speculators --peer-path /tmp/peers-site)
fi
[ -z "${GPU_SCALE_DRY:-}" ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
# (--long-from 32768: the peers run after 2k and 8k, before the long rows, so a run cut short has them)
timeout -k 10 "${GPU_SCALE_8B_S:-400}" "$PY" -m specforge_lite.bench gpu_scale "${dry[@]}" "${peers[@]}" --repeats 1 \
  --long-from 32768 --loss-chunks 4096 --budget-s "${GPU_SCALE_BUDGET_S:-300}" \
  --out "$OUT/gpu_scale_llama3_8b.json" 2>&1 |
  tee "$OUT/gpu_scale_llama3_8b.log"
timeout -k 10 "${GPU_SCALE_32B_S:-120}" "$PY" -m specforge_lite.bench gpu_scale "${dry[@]}" --target "$big" --seq-lens "$big_len" \
  --ways "${GPU_SCALE_32B_WAY:-flex}" --online-only --methods "" --out "$OUT/gpu_scale_qwen3_32b.json" 2>&1 |
  tee "$OUT/gpu_scale_qwen3_32b.log"
timeout -k 10 "${PLAN_32B_S:-60}" "$PY" -m specforge_lite.plan model="$plan_model" data.max_length="$big_len" \
  draft.ttt_attention=blockwise --gpus 1 --gpu-gib 141 --out "$OUT/plan_qwen3_32b.json" 2>&1 | tee "$OUT/plan_qwen3_32b.log"
