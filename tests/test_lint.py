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


def test_the_gpu_check_parses_and_says_what_it_needs_without_a_gpu():
    """scripts/gpu_check.sh (the GPU path in one command) is valid bash, documented in the README, and on a
    machine without CUDA prints one FAIL line naming what is missing and exits 1, before building anything."""
    script = ROOT / "scripts" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    assert "scripts/gpu_check.sh" in (ROOT / "README.md").read_text()
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: run the check itself")
    proc = subprocess.run(["bash", str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "PY": sys.executable})
    assert proc.returncode == 1 and proc.stdout.strip() == ("FAIL cuda: torch sees no CUDA device (this script is "
                                                            "for a GPU machine; on CPU run bash scripts/test.sh)")
