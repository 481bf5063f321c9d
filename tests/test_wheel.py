"""Installed, not only checked out: a wheel built from the checkout, installed in a fresh venv, trains the tiny target
with ``specforge-lite train`` from a folder that is not the checkout (the Hydra groups travel inside the package).

The fresh venv sees the test environment's site-packages as a plain path (torch and the other dependencies, never
fetched), without running that environment's .pth files: its editable install of specforge_lite stays out, so the
package the run imports is the wheel's (asserted)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

from conftest import ROOT

# The smallest run that trains, checkpoints and exports: 2 steps on the tiny random Llama, no evaluation.
TINY_RUN = ["model=llama3_tiny", "recipe=none", "tracker=none", "data.max_length=96", "data.max_samples=16",
            "data.heldout_samples=4", "draft.draft_vocab_size=1024", "trainer.max_steps=2",
            "trainer.progress_bar=false", "eval.enabled=false"]


def build_wheel(out: Path, work: Path) -> Path:
    """The wheel of a copy of the checkout (what a wheel holds: pyproject, README, the package), so the build
    writes nothing into the checkout."""
    source = work / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "specforge_lite", source / "specforge_lite",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(out), str(source)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (wheel,) = out.glob("specforge_lite-*.whl")
    return wheel


def fresh_venv(folder: Path) -> Path:
    """A venv without pip whose sys.path ends with this environment's site-packages; its python."""
    venv.EnvBuilder(with_pip=False).create(folder)
    python = folder / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    (Path(own) / "shared_site_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def test_a_wheel_trains_the_tiny_target_in_a_fresh_venv(tmp_path):
    wheel = build_wheel(tmp_path / "dist", tmp_path)
    python = fresh_venv(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def run(cmd: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=timeout)

    before = run([str(python), "-c", "import specforge_lite"])
    assert before.returncode != 0 and "No module named 'specforge_lite'" in before.stderr, before.stderr[-2000:]
    install = run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q",
                   str(wheel)])
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-3000:]
    where = run([str(python), "-c", "import specforge_lite.config as c; print(c.CONF_DIR)"])
    conf = Path(where.stdout.strip())
    assert where.returncode == 0 and conf.is_relative_to(tmp_path / "venv"), where.stdout + where.stderr[-2000:]
    assert (conf / "config.yaml").is_file() and (conf / "model" / "llama3_tiny.yaml").is_file()

    out = elsewhere / "run"
    train = run([str(python.with_name("specforge-lite")), "train", *TINY_RUN, f"output_dir={out}"], timeout=600)
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    assert (out / "final" / "config.json").is_file() and (out / "final" / "model.safetensors").is_file()
