#!/usr/bin/env bash
# A throwaway venv with the peers' trainers, SpecForge 0.2.0 and speculators 0.9.0, for the side-by-side
# step timing of `python -m studies step_speed` and `gpu_scale` (studies/peers/*_step.py). Never
# a project dependency. Both are installed --no-deps: SpecForge pins torch 2.11 and sglang, speculators
# pulls CUDA builds of torchvision/torchaudio, and neither is needed for one draft training step.
# Prints the venv's python on its last line. Safe to re-run. (For a GPU machine without network, the drivers'
# --device cuda path runs from wheels instead: studies/peers/gpu_wheels.sh, studies/peers/gpu_check.sh.)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${PEERS_VENV:-${SPECFORGE_LITE_CACHE:-$HOME/.cache/specforge_lite}/peers-venv}
want="specforge==0.2.0 speculators==0.9.0"
if [ -f "$VENV/.ready" ] && [ "$(cat "$VENV/.ready")" = "$want" ]; then echo "$VENV/bin/python"; exit 0; fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip install -q "$@"; }
log="$VENV/setup.log"
{
  # torch pinned in every call, so that no resolver step swaps in a CUDA build
  pip torch==2.13.0 transformers==5.8.1 huggingface-hub safetensors numpy pydantic pydantic-settings loguru \
      tqdm psutil pyyaml openai triton "datasets>=4.0.0,<=5.1.0" &&
  pip --no-deps specforge==0.2.0 speculators==0.9.0 hs-connectors==0.9.0 &&
  # triton: imported (never launched) by specforge.core.loss; openai, datasets, hs-connectors: imported by speculators
  "$VENV/bin/python" -c "import specforge, speculators.models.eagle3"
} >"$log" 2>&1 || { tail -30 "$log"; echo "peer venv could not be built (log: $log)" >&2; exit 1; }
echo "$want" > "$VENV/.ready"
echo "$VENV/bin/python"
