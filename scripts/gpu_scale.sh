#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md in one command, for a lent machine with no network:
#   bash scripts/gpu_scale.sh --wheels  (here, with network: fill .whl/ for a machine without one)
#   bash scripts/gpu_scale.sh           (there: results in $OUT, else runs/gpu_scale/: *.json, *.log)
# 1. installs the wheels carried in .whl/ours (transformers at the tested version) and .whl/peers (SpecForge,
#    speculators and what the image lacks: studies/peers/gpu_wheels.sh makes them);
# 2. the draft's soft cross-entropy (eager, compiled, Triton kernel) against the HBM limit at 8k tokens x TTT 7;
# 3. the run's default step on a GPU (flex attention, compiled chains: draft/objective.py BY_DEVICE), also with
#    the lm_head frozen as speculators trains (+frozen_head), on packed rows of three lengths, checked against the
#    fp32 reference; the bundled conversations' lengths one per micro-batch against token-budget micro-batches
#    (trainer.micro_batch_tokens, the scale recipe's), each way's draft steps profiled (is the device still
#    waiting on the host?); the DFlash, DSpark and DFlash 2 steps at 2k and 8k;
# 4. studies gpu_scale on Llama-3.1-8B's shape against both peers at 2k and 32k, and 64k and 128k with
#    checkpointing (a peer out of memory or time is a row that says so);
# 5. (GPU_SCALE_32B_S > 0) Qwen3-32B's shape online at 8k (64 GB of bf16 weights: one H200, or an H100 with
#    ZeRO-3 offload), and the sizing command's prediction for it (python -m specforge_lite.plan, fake tensors on
#    the host), to hold against its measured peak.
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
dry=() big=qwen3_32b big_len=8192 plan_model=qwen3_32b short=8192 method_lens=2048,8192 lens=2048,32768,65536,131072 long=65536 mix=8192
[ -n "${GPU_SCALE_DRY:-}" ] && dry=(--dry-run) big=tiny big_len=160 plan_model=llama3_tiny short=160 method_lens=64 \
  lens=64,160 long=160 mix=160
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
# the loss of a chunk (eager chain, compiled chain, Triton kernel) against the HBM limit at 8k tokens x TTT 7
timeout -k 10 "${GPU_SCALE_LOSS_S:-45}" "$PY" -m specforge_lite.bench soft_ce --out "$OUT/soft_ce.json" 2>&1 |
  tee "$OUT/soft_ce.log"
# the default step and speculators' frozen-head recipe, packed rows, the real-length mix one conversation per
# micro-batch against token-budget micro-batches, and the block drafts
timeout -k 10 "${GPU_SCALE_DEFAULT_S:-220}" "$PY" -m studies gpu_scale "${dry[@]}" \
  --ways default,default+frozen_head --seq-lens "$short" --packed "$short" --real-mix "$mix" \
  --method-seq-lens "$method_lens" --repeats 1 \
  --out "$OUT/gpu_scale_llama3_8b_default.json" 2>&1 | tee "$OUT/gpu_scale_llama3_8b_default.log"
# (--long-from 65536: both peers' short rows come before the 64k and 128k rows, so a run cut short has them)
timeout -k 10 "${GPU_SCALE_8B_S:-300}" "$PY" -m studies gpu_scale "${dry[@]}" "${peers[@]}" --repeats 1 \
  --seq-lens "$lens" --ways default --long-from "$long" --long-ways default+ckpt --methods "" \
  --peer-seq-lens "speculators=$lens;specforge=$long,${lens##*,}" --peer-timeout 220 --budget-s "${GPU_SCALE_BUDGET_S:-250}" \
  --out "$OUT/gpu_scale_llama3_8b_peers.json" 2>&1 | tee "$OUT/gpu_scale_llama3_8b_peers.log"
[ "${GPU_SCALE_32B_S:-0}" -gt 0 ] || exit 0
timeout -k 10 "$GPU_SCALE_32B_S" "$PY" -m studies gpu_scale "${dry[@]}" --target "$big" --seq-lens "$big_len" \
  --ways "${GPU_SCALE_32B_WAY:-default}" --online-only --methods "" --out "$OUT/gpu_scale_qwen3_32b.json" 2>&1 |
  tee "$OUT/gpu_scale_qwen3_32b.log"
timeout -k 10 "${PLAN_32B_S:-60}" "$PY" -m specforge_lite.plan model="$plan_model" data.max_length="$big_len" \
  draft.ttt_attention=blockwise --gpus 1 --gpu-gib 141 --out "$OUT/plan_qwen3_32b.json" 2>&1 | tee "$OUT/plan_qwen3_32b.log"
