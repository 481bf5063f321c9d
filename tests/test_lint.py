"""The code keeps the house's lint: ruff with the rules and the 120-character lines of pyproject.toml."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT


def test_the_code_passes_ruff():
    try:
        import ruff  # noqa: F401
    except ImportError:
        pytest.skip("ruff is not installed (pip install -e '.[dev]'; scripts/setup.sh does)")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
