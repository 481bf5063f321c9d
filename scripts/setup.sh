#!/usr/bin/env bash
# One-time set-up, safe to re-run: a virtual environment in .venv with the project installed.
# torch is installed first and pinned: on CPU-only machines an unpinned torch pulls GBs of CUDA wheels.
# Everything else installs at the versions in docker/constraints.txt, the ones CI and the image test, so
# a library released tomorrow cannot change what a clean clone runs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.specforge_lite_installed
want="$(cat pyproject.toml docker/constraints.txt | sha256sum | cut -d' ' -f1) $TORCH_SPEC"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  log=.venv/setup.log
  pins=.venv/constraints.txt  # torch comes from TORCH_SPEC, which may name another build
  grep -v '^torch==' docker/constraints.txt > "$pins"
  if ! { .venv/bin/python -m pip install -q --no-cache-dir --upgrade pip &&
         .venv/bin/python -m pip install -q --no-cache-dir "$TORCH_SPEC" &&
         .venv/bin/python -m pip install -q --no-cache-dir -c "$pins" -e ".[dev]"; } >"$log" 2>&1; then
    cat "$log"
    echo "set-up failed (log above, also in $log)" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
echo "environment ready: $(pwd)/.venv"
