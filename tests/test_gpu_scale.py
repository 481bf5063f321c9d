"""``python -m studies gpu_scale --dry-run``: the GPU benchmark's whole path (a target built from a shape with
random weights, its capture and teacher, each TTT attention way checked against blockwise and timed, the block
drafts' steps) at tiny shapes on CPU, so a lent GPU finds a command that runs; and the CPU step against the peers'
(``studies step_speed``)."""

from __future__ import annotations

import json

import torch

from specforge_lite.bench.real_shape import build_draft, build_target, capture
from specforge_lite.bench.step_ways import loss_and_grads, replace_attention
from specforge_lite.bench.timing import kernel_kind, kernel_profile
from studies import gpu_scale


def test_gpu_scale_dry_run_checks_and_times_every_way_and_method(tmp_path, capsys):
    out = tmp_path / "gpu_scale.json"
    gpu_scale.main(["--dry-run", "--out", str(out)])
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert data["target"] == "tiny" and data["device"] == "cpu"
    check = next(r for r in rows if r["what"] == "check")["ways"]
    # (flex has no backward on CPU: checked on a GPU; "default" is the device's way, blockwise here)
    # (+frozen_head: speculators' recipe, checked on the weights it trains)
    assert set(check) == {"blockwise", "blockwise+compile", "dense", "sdpa", "default", "default+frozen_head"}
    for way, c in check.items():  # the fp32 reference's loss and gradients, up to fp32 rounding (no autocast on CPU)
        assert c["correct"] and c["grad_rel_err"] < 1e-4 and c["loss_rel_diff"] < 1e-5, (way, c)
    timed = {(r["what"], r.get("way"), r["T"]) for r in rows if r.get("tokens_per_s") and "T" in r}
    assert {("ours", w, T) for w in ("blockwise", "blockwise+compile", "dense", "sdpa", "default",
                                     "default+frozen_head") for T in (64, 160)} <= timed
    # the default way on packed rows (positions restarting per conversation) at three lengths, each checked
    packed = [r for r in rows if r["what"] == "packed"]
    assert [r["T"] for r in packed] == [160, 137, 115] and all(r["conversations"] > 1 for r in packed), packed
    assert all(r["correct"] and r["grad_rel_err"] < 1e-4 and r["tokens_per_s"] > 0 for r in packed), packed
    assert {("capture", None, 64), ("dflash", None, 64), ("dspark", None, 64), ("dflash2", None, 64)} <= timed
    # the bundled data's lengths, one conversation per micro-batch against token-budget micro-batches (160 tokens)
    single, budget = (next(r for r in rows if r.get("way") == way and r["what"] == "real_mix")
                      for way in ("one_per_micro_batch", "token_budget"))
    assert single["micro_batches"] == single["conversations"] == budget["conversations"] == 6
    assert 1 < budget["micro_batches"] < 6 and budget["tokens"] == single["tokens"]
    assert budget["ratio_to_one_per_micro_batch"] == budget["tokens_per_s"] / single["tokens_per_s"]
    for r in (single, budget):  # each way's draft steps alone under the profiler: does the device wait on the host?
        prof = r["steps_profile"]
        assert prof["by_kind_ms"]["matmul"] > 0 and 0 < prof["busy_ms"] <= 1.05 * prof["wall_ms"], prof
    for r in rows:  # one step of each way profiled at the first length: where its time goes
        if r["what"] == "ours" and r["T"] == 64:
            prof = r["profile"]
            assert prof["by_kind_ms"]["matmul"] > 0 and prof["top"], prof
            assert 0 < prof["busy_ms"] <= 1.05 * prof["wall_ms"], prof
    table = capsys.readouterr().out
    assert ("| T | capture tok/s | ours blockwise | ours blockwise+compile | ours default | ours default+frozen_head "
            "| ours dense | ours sdpa | dflash | dflash2 | dspark | packed default |" in table)
    assert "| step | T | wall ms | busy | attention | matmul | compiled | copy | elementwise |" in table
    assert "| token_budget | 160 | 6 |" in table and "| draft steps: device busy |" in table


def test_a_way_it_cannot_run_is_refused_before_the_target_is_built(monkeypatch):
    """A misspelt way would end the benchmark after minutes of building and capturing on a lent GPU."""
    import pytest

    monkeypatch.setattr(gpu_scale, "build_target", lambda *a: pytest.fail("built the target"))
    for ways in (["--ways", "blockwise,flexx"], ["--long-ways", "flex+ckpt+fast"]):
        with pytest.raises(SystemExit, match="an attention of blockwise, flex, dense, sdpa or default, then"):
            gpu_scale.main(["--dry-run", *ways])


def test_kernels_are_sorted_into_kinds_by_their_names():
    """Names of the kernels a step launches on an H100/H200 (cuBLAS, cuBLASLt, flash / cutlass attention, flex
    attention's Triton template, Inductor's fused kernels, ATen's own) and of aten ops on CPU."""
    kinds = {"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_kernel__5x_cublas":
             "matmul", "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN": "matmul", "aten::mm": "matmul",
             "fmha_cutlassF_bf16_aligned_64x64_rf_sm80": "attention", "flash_fwd_kernel": "attention",
             "triton_tem_fused_0": "attention", "triton_per_fused__softmax_0": "compiled",
             "void at::native::vectorized_elementwise_kernel<4, at::native::exp_kernel_cuda>": "elementwise",
             "Memcpy DtoD (Device -> Device)": "copy", "aten::exp": "elementwise"}
    assert {name: kernel_kind(name) for name in kinds} == kinds
    prof = kernel_profile(10.0, [("aten::mm", 3, 4.0), ("aten::exp", 2, 1.0), ("aten::mm_x", 1, 2.0)])
    assert prof["busy_ms"] == 7.0 and prof["by_kind_ms"] == {"matmul": 6.0, "elementwise": 1.0}
    assert [t[0] for t in prof["top"]] == ["aten::mm", "aten::mm_x", "aten::exp"]


def test_the_studies_list_the_comparisons_with_the_peers_and_the_bench_measures_the_package_alone(capsys):
    from specforge_lite.bench.__main__ import BENCHMARKS
    from studies.__main__ import main as studies

    studies(["--help"])
    out = capsys.readouterr().out
    assert "gpu_scale" in out and "step_speed" in out, out
    assert not {"gpu_scale", "step_speed"} & set(BENCHMARKS)


def test_a_peer_with_no_driver_is_refused_in_one_line_before_the_target_is_built(monkeypatch):
    import pytest

    monkeypatch.setattr(gpu_scale, "build_target", lambda *a: pytest.fail("built the target"))
    with pytest.raises(SystemExit, match=r"no peer 'specfroge': the peers with a driver in studies/peers/ are "
                                         r"specforge, speculators$"):
        gpu_scale.main(["--dry-run", "--peers", "specfroge"])


def test_the_cpu_step_is_timed_beside_each_peer_and_a_failed_peer_says_why(tmp_path, monkeypatch, capsys):
    """``python -m studies step_speed``: our step and each peer driver's JSON line at each length, our ratio to the
    faster peer, and the notes of the longest row (the real drivers need the peers' venv: stand-ins here)."""
    import sys

    from studies import step_speed

    drivers = {"specforge": "import json\n"
                            "print(json.dumps({'tokens_per_s': 1e9, 'version': '0.2.0', 'notes': 'eager'}))\n",
               "speculators": "raise SystemExit('speculators: no CUDA')\n"}
    for name, text in drivers.items():
        (tmp_path / f"{name}_step.py").write_text(text)
    monkeypatch.setattr(step_speed, "peer_driver", lambda name: tmp_path / f"{name}_step.py")
    monkeypatch.setitem(step_speed.SHAPES, "tiny", dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=8,
        vocab_size=512, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0))
    step_speed.main(["--peers", f"specforge={sys.executable}", f"speculators={sys.executable}", "--shape", "tiny",
                     "--seq-lens", "16,32", "--ttt", "2", "--draft-vocab", "64", "--repeats", "1"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| 16 |", "| 32 |"))]
    assert len(rows) == 2 and all(r.endswith("| 1000000000 | failed | 0.00x |") for r in rows), out
    assert "  specforge 0.2.0: eager" in out and "  speculators failed: speculators: no CUDA" in out, out


def test_a_peers_lines_become_rows_and_a_length_it_did_not_reach_says_why(tmp_path, monkeypatch):
    """run_peer reads the JSON lines a peer's driver prints (studies/peers/_common.py's ``report``; the drivers
    themselves need the peers' packages, which CI does not install): one row per length, its first length's
    profile summarised by kind of kernel, and a row that says why for a length with no line."""
    import argparse
    import sys

    driver = tmp_path / "specforge_step.py"
    driver.write_text(
        "import json\n"
        "print('[specforge] warm-up 1.0s')\n"
        "print(json.dumps({'peer': 'specforge', 'seq_len': 64, 'median_s': 0.5, 'tokens_per_s': 128.0,\n"
        "                  'peak_mib': 2048.0, 'oom': False, 'profile': {'wall_ms': 9.0, 'kernels': [\n"
        "                  ['aten::mm', 3, 5.0], ['aten::exp', 2, 1.0]]}}))\n"
        "raise SystemExit('specforge step failed: RuntimeError: T=160 too long')\n")
    monkeypatch.setattr(gpu_scale, "peer_driver", lambda name: driver)
    a = argparse.Namespace(peer_python=sys.executable, ttt=7, draft_vocab=256, repeats=1, device="cpu",
                           peer_path="", peer_timeout=60)
    rows = gpu_scale.run_peer("specforge", a, [64, 160], tmp_path, {"hidden_size": 64}, lambda: False)
    assert [r["T"] for r in rows] == [64, 160]
    assert rows[0]["tokens_per_s"] == 128.0 and rows[0]["peak_gib"] == 2.0
    assert rows[0]["profile"]["by_kind_ms"] == {"matmul": 5.0, "elementwise": 1.0}
    assert rows[1] == {"T": 160, "error": "specforge step failed: RuntimeError: T=160 too long"}


def test_the_gpu_script_runs_each_of_its_commands_at_tiny_shapes(tmp_path):
    """scripts/gpu_scale.sh is what a lent GPU runs first, with minutes to spare and no second try: with
    GPU_SCALE_DRY=1 its every command (the default step on packed rows and the block drafts, the 8B benchmark
    against the peers, and with GPU_SCALE_32B_S the big target's online run and the sizing command for it) runs at
    tiny shapes on CPU, and each writes its result file."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    env = {**os.environ, "GPU_SCALE_DRY": "1", "OUT": str(tmp_path), "PY": sys.executable, "GPU_SCALE_32B_S": "300"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_scale.sh")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((tmp_path / "soft_ce.json").read_text()), proc.stdout[-2000:]
    default = json.loads((tmp_path / "gpu_scale_llama3_8b_default.json").read_text())
    assert {r["what"] for r in default["rows"] if r.get("tokens_per_s")} == {"capture", "ours", "packed", "dflash",
                                                                             "dspark", "dflash2", "real_mix"}, \
        default["rows"]
    eight_b = json.loads((tmp_path / "gpu_scale_llama3_8b_peers.json").read_text())
    assert {(r["T"], r.get("way")) for r in eight_b["rows"] if r["what"] == "ours" and r.get("tokens_per_s")} == {
        (64, "default"), (160, "default+ckpt")}, eight_b["rows"]
    big = json.loads((tmp_path / "gpu_scale_qwen3_32b.json").read_text())
    assert [r["what"] for r in big["rows"] if r.get("tokens_per_s")] == ["capture", "ours"], big["rows"]
    plan = json.loads((tmp_path / "plan_qwen3_32b.json").read_text())
    assert plan, proc.stdout[-2000:]


def test_the_table_pairs_each_peer_with_the_fastest_correct_way_that_trains_what_it_trains():
    """Like for like: SpecForge (trains the lm_head) against our fastest correct way that trains it, speculators
    (freezes it) against our fastest correct "+frozen_head" way. The check names each way as timed ("flex+compile",
    not "flex"); a length skipped for the time budget has no capture figure. The H200 run of 2026-11-28 printed no
    ratio at all and a capture of 0 tok/s for the skipped length."""
    data = {"device": "NVIDIA H200", "target": "llama3_8b", "ttt": 7, "draft_vocab": 32000, "rows": [
        {"what": "capture", "T": 8192, "tokens_per_s": 30248.0},
        {"what": "check", "T": 8192, "ways": {"blockwise": {"correct": True}, "flex+compile": {"correct": True},
                                              "sdpa": {"correct": False},
                                              "flex+compile+frozen_head": {"correct": True}}},
        {"what": "ours", "T": 8192, "way": "flex+compile", "tokens_per_s": 25379.0, "peak_gib": 12.8},
        {"what": "ours", "T": 8192, "way": "sdpa", "tokens_per_s": 40000.0, "peak_gib": 20.0},
        # correct, and trains what speculators trains (not what SpecForge trains)
        {"what": "ours", "T": 8192, "way": "flex+compile+frozen_head", "tokens_per_s": 31000.0, "peak_gib": 12.0},
        {"what": "ours", "T": 8192, "way": "sdpa+frozen_head", "tokens_per_s": 50000.0},  # (not checked: incorrect)
        {"what": "specforge", "T": 8192, "tokens_per_s": 26221.0, "peak_gib": 23.4},
        {"what": "speculators", "T": 8192, "tokens_per_s": 29510.0, "peak_gib": 26.3},
        {"what": "ours", "T": 131072, "skipped": "past --budget-s"}]}
    lines = gpu_scale.table_markdown(data).splitlines()
    at_8k = next(line for line in lines if line.startswith("| 8192 |"))
    assert ("| ours / specforge (both train the head) | ours +frozen_head / speculators (both freeze it) |"
            in lines[2]), lines[2]
    # 25379 / 26221 (neither the incorrect sdpa nor a frozen head), 31000 / 29510 (a frozen head only)
    assert at_8k.endswith("| 0.97x | 1.05x |"), at_8k
    assert "| 31000 (12.0) |" in at_8k, at_8k
    at_128k = next(line for line in lines if line.startswith("| 131072 |"))
    assert at_128k.startswith("| 131072 |  |") and "past --budget-s" in at_128k, at_128k


def test_each_peer_runs_at_the_lengths_given_for_all_or_for_it():
    """A lent GPU's minutes go to what is not yet measured: one peer at some lengths, the other at fewer."""
    assert gpu_scale.peer_lengths("2048,8192", ["specforge", "speculators"]) == {
        "specforge": [2048, 8192], "speculators": [2048, 8192]}
    assert gpu_scale.peer_lengths("speculators=2048,32768;specforge=131072", ["specforge", "speculators"]) == {
        "specforge": [131072], "speculators": [2048, 32768]}
    assert gpu_scale.peer_lengths("speculators=2048", ["specforge", "speculators"])["specforge"] == []


def test_a_frozen_head_way_trains_every_weight_but_the_lm_head_as_the_default_does():
    """"+frozen_head" (speculators' recipe) leaves the lm_head without a gradient for the step and every other
    weight's gradient as the way without it computes it; the head trains again after the way."""
    cpu = torch.device("cpu")
    target = build_target("tiny", cpu, torch.float32)
    draft, cfg, teacher, build_objective = build_draft(target, "eagle3", 256, 3, cpu)
    inputs, _ = capture(target, teacher, 48, seed=0)
    objective = replace_attention(build_objective(cfg), "default")
    _, trained = loss_and_grads(draft, objective, inputs, False, "default")
    _, frozen = loss_and_grads(draft, objective, inputs, False, "default+frozen_head")
    assert "lm_head.weight" in trained and set(frozen) == set(trained) - {"lm_head.weight"}
    for name, grad in frozen.items():
        torch.testing.assert_close(grad, trained[name], rtol=1e-5, atol=1e-7, msg=name)
    assert draft.lm_head.weight.requires_grad
