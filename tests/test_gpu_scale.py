"""``bench gpu_scale --dry-run``: the GPU benchmark's whole path (a target built from a shape with random weights,
its capture and teacher, each TTT attention way checked against blockwise and timed, the block drafts' steps)
at tiny shapes on CPU, so a lent GPU finds a command that runs."""

from __future__ import annotations

import json

from specforge_lite.bench import gpu_scale


def test_gpu_scale_dry_run_checks_and_times_every_way_and_method(tmp_path, capsys):
    out = tmp_path / "gpu_scale.json"
    gpu_scale.main(["--dry-run", "--out", str(out)])
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert data["target"] == "tiny" and data["device"] == "cpu"
    check = next(r for r in rows if r["what"] == "check")["ways"]
    assert set(check) == {"blockwise", "dense", "sdpa"}  # (flex has no backward on CPU: checked on a GPU)
    for way, c in check.items():  # the fp32 reference's loss and gradients, up to fp32 rounding (no autocast on CPU)
        assert c["correct"] and c["grad_rel_err"] < 1e-4 and c["loss_rel_diff"] < 1e-5, (way, c)
    timed = {(r["what"], r.get("way"), r["T"]) for r in rows if r.get("tokens_per_s")}
    assert {("ours", w, T) for w in ("blockwise", "dense", "sdpa") for T in (64, 160)} <= timed
    assert {("capture", None, 64), ("dflash", None, 64), ("dspark", None, 64)} <= timed
    table = capsys.readouterr().out
    assert "| T | capture tok/s | ours blockwise | ours dense | ours sdpa | dflash | dspark |" in table


def test_the_bench_lists_its_benchmarks_on_help_and_exits_0():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "specforge_lite.bench", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "gpu_scale" in out.stdout, out.stderr
