#!/usr/bin/env bash
# Smoke test of the peer drivers' CUDA path on a GPU machine without network: installs .whl/peers
# (studies/peers/gpu_wheels.sh) into /tmp/peers-site, then times bf16 steps of each peer's own code on tiny
# --inputs files (H 256, 4 heads, 2 KV heads, vocab 4096, draft vocab 1024, ttt 3) at T 128 and 256, both
# lengths in one process (--seq-len 128,256, {T} in --inputs): one JSON line per length.
# Usage: [PEERS="specforge speculators"] studies/peers/gpu_check.sh [PYTHON]   (default python3)
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${1:-python3}
SITE=${PEERS_SITE:-/tmp/peers-site}
"$PY" -c "import sys, torch, triton, transformers, tokenizers; print(sys.version.split()[0], torch.__version__, \
triton.__version__, transformers.__version__, tokenizers.__version__, torch.cuda.get_device_name(0))" || exit 1
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/peers/*.whl || exit 1
export PYTHONPATH=$SITE
"$PY" -c "import specforge, speculators.models.eagle3; print('peers import')" || exit 1
IN=/tmp/peers-tiny_{T}.safetensors
"$PY" - "$IN" <<'EOF'
import sys, torch
from safetensors.torch import save_file
g = torch.Generator().manual_seed(7)
H, V = 256, 4096
for T in (128, 256):
    save_file({"aux": torch.randn(1, T, 3 * H, generator=g).bfloat16(),
               "input_ids": torch.randint(0, V, (1, T), generator=g),
               "final_hidden": torch.randn(1, T, H, generator=g).bfloat16(),
               "loss_mask": (torch.rand(1, T, generator=g) > 0.3).to(torch.uint8)}, sys.argv[1].replace("{T}", str(T)))
EOF
SHAPE='{"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}'
rc=0
for peer in ${PEERS:-specforge speculators}; do
  "$PY" studies/peers/${peer}_step.py --device cuda --dtype bfloat16 --inputs "$IN" --seq-len 128,256 \
    --shape "$SHAPE" --draft-vocab 1024 --ttt 3 --repeats 2 | tail -2 || rc=1
done
exit $rc
