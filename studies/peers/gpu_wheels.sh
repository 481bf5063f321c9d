#!/usr/bin/env bash
# Re-creates .whl/peers/ (git-ignored): the wheels that the peer drivers' CUDA path (studies/peers/*_step.py
# --device cuda) needs on the lent GPU machine (no network; Python 3.12, torch 2.11+cu130, triton 3.6,
# transformers 5.17, hub, numpy, pandas, pyarrow, xxhash, fsspec, httpx, aiohttp, ... already there).
# There: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peers-site .whl/peers/*.whl
# then:  PYTHONPATH=/tmp/peers-site python3 studies/peers/specforge_step.py --device cuda --dtype bfloat16 ...
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.whl/peers
rm -rf "$dest"
mkdir -p "$dest"
# the peers (installed --no-deps, as setup_peers.sh does) and what their imports need beyond that image.
# No transformers: SpecForge pins 5.8.1, but 5.8.1 refuses the image's tokenizers 0.23.2 at import, and both
# drivers run on the image's 5.17 (speculators allows <=5.19).
wheels=(
  specforge==0.2.0 speculators==0.9.0 hs-connectors==0.9.0
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  pydantic-settings==2.16.3 python-dotenv==1.2.4 loguru==0.7.3
  openai==3.57.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
  datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" "${wheels[@]}" 2>&1 | grep -v "is ignored: it is neither" || true
ls -1 "$dest"
du -sh "$dest"
