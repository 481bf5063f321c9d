"""``scripts/gpu_recipe.sh``: the scale recipe on real weights for a GPU machine without network. Its dry run (a tiny
target on CPU) goes through the same train.py command, the result table, the bf16 export and the pieces it returns;
the run's second step on a machine that did not stage the weights' first half stops in one line."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_dry_run_trains_evaluates_and_returns_the_run_in_pieces(tmp_path, monkeypatch):
    env = {**os.environ, "GPU_RECIPE_DRY": "1", "OUT": str(tmp_path), "PY": sys.executable}
    proc = subprocess.run(["bash", "scripts/gpu_recipe.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_recipe.json").read_text())
    assert result["machine"].startswith("a CPU") and "recipe=scale" in result["note"]
    (row,) = result["rows"]
    cells = dict(zip(result["columns"], row))
    # every round's answers, with the rate a user multiplies by their data size
    answers = cells["answers written by the target"]
    assert " answers/s" in answers and "in 2 rounds" in answers, answers
    assert cells["training"].startswith("4 steps, 2.00 epochs"), cells  # (2 epochs: the recipe's)
    assert {"heldout", "mtbench", "humaneval"} <= set(result["columns"])
    log = (tmp_path / "gpu_recipe.log").read_text()
    assert "[recipe] scale: llama3_tiny" in log
    pieces = sorted(tmp_path.glob("run.tar.part-*"))
    joined = b"".join(p.read_bytes() for p in pieces)
    back = tmp_path / "back"
    with tarfile.open(fileobj=io.BytesIO(joined)) as tar:
        names = set(tar.getnames())
        assert {"eval.json", "eval_inputs.json", "data_stats.json", "final/config.json",
                "final/model.safetensors"} <= names
        tar.extractall(back, filter="data")
    weights = (back / "final" / "model.safetensors").read_bytes()
    header = json.loads(weights[8: 8 + int.from_bytes(weights[:8], "little")])
    assert header["fc.weight"]["dtype"] == "BF16", header["fc.weight"]  # (what comes back is what vLLM serves)
    served_check_takes(back, monkeypatch)


def served_check_takes(run_dir: Path, monkeypatch) -> None:
    """What comes back is a run folder the served check takes (python -m specforge_lite.evaluate.served DIR): all it
    checks before starting vLLM passes; with another machine's folder of the target, it says what to set."""
    import pytest

    from specforge_lite.evaluate.served import ServedMismatch, serve

    inputs = json.loads((run_dir / "eval_inputs.json").read_text())
    (run_dir / "eval_inputs.json").write_text(json.dumps({**inputs, "target": "/gpu-machine/models/smollm2_135m"}))
    with pytest.raises(ServedMismatch, match=r"/gpu-machine/models/smollm2_135m, is not on this machine: set "
                                             r"\"target\" in .*eval_inputs.json"):
        serve([run_dir])
    (run_dir / "eval_inputs.json").write_text(json.dumps(inputs))
    monkeypatch.setenv("SPECFORGE_LITE_SERVING_PYTHON", str(run_dir / "no-python"))
    with pytest.raises(FileNotFoundError, match="no serving environment"):  # (the last thing before vLLM starts)
        serve([run_dir])


def test_the_gpu_runs_settings_compose_and_pass_the_checks():
    """The GPU machine's command (not the dry run's): a renamed key or a refused setting would end its run."""
    from specforge_lite.compose import load_config
    from specforge_lite.settings import setting_problems

    proc = subprocess.run(["bash", "scripts/gpu_recipe.sh", "--args"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "GPU_RECIPE_DRY": ""})
    overrides = proc.stdout.split()
    assert proc.returncode == 0 and "recipe=scale" in overrides and "model=smollm2_135m" in overrides, proc
    config = load_config(overrides)
    assert setting_problems(config) == []
    assert config.data.generation.max_minutes == 2 and config.trainer.micro_batch_tokens == 8192
    assert config.trainer.epochs == 2 and config.data.max_length == 2048


def test_a_second_half_on_a_machine_without_the_first_says_what_to_do(tmp_path):
    env = {**os.environ, "GPU_RECIPE_STAGE": str(tmp_path / "stage"), "OUT": str(tmp_path / "out"), "PY": "false"}
    proc = subprocess.run(["bash", "scripts/gpu_recipe.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stdout.startswith("error: ") and proc.stdout.count("\n") == 1, proc.stdout
    assert "the first half was not staged" in proc.stdout and "--stage" in proc.stdout
