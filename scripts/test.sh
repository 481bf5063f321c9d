#!/usr/bin/env bash
# The README's test command: set up (idempotent), then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -eq 0 ]; then
  # the whole suite: the serving environment (tests/test_serving.py) builds beside the training one, on the
  # core pip leaves idle, instead of beside the first tests (CI time); the tests wait for it if need be
  bash scripts/setup_serving.sh >/dev/null 2>&1 &
fi
bash scripts/setup.sh
if [ $# -eq 0 ]; then
  # two processes, each given a whole file at a time in the order tests/conftest.py sets (a file's module
  # fixtures, the trained runs the serving tests share among them, are then built once)
  set -- -n "${TEST_PROCESSES:-2}" --dist loadfile --no-loadscope-reorder
fi
exec .venv/bin/python -m pytest -q --durations=25 "$@"  # (the slowest tests, for CI time)
