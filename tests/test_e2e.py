"""The README's main job, end to end on the real SmolLM2 target (a shortened budget), and the CLIs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow

# The embedded default (recipe=cpu_20min, regeneration included) on a budget that fits CI.
OVERRIDES = ["trainer.max_steps=40", "trainer.save_every=20", "trainer.progress_bar=false", "data.max_length=256",
             "data.generation.max_conversations=40", "data.generation.max_new_tokens=32",
             "data.generation.batch_size=32",
             "eval.num_prompts=2", "eval.max_new_tokens=12", "eval.heldout_batches=12"]


def run(args, **kw):
    env = {**os.environ, "WANDB_SILENT": "true", **kw.pop("env", {})}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=env, **kw)


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("default_run")
    proc = run(["train.py", f"output_dir={out}", *OVERRIDES], timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_run_directory_contract(default_run):
    out, stdout = default_run
    from omegaconf import OmegaConf

    run_config = OmegaConf.load(out / "config.yaml")
    ttt = run_config.draft.ttt_length
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == 40
    for key in ["step", "loss", "sim_accepted_drafts"] + [f"acc_{k}" for k in range(ttt)]:
        assert key in lines[-1]
    assert f"acc_{ttt}" not in lines[-1]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000040"
    stats = json.loads((out / "data_stats.json").read_text())
    assert stats["regeneration"]["regenerated"] == 40 and stats["heldout_overlap_removed"] >= 0
    # the default mix: chit-chat openings and requests the target wrote itself, in the recipe's proportions
    weights = [m.weight for m in run_config.data.mix]
    counts = list(stats["mix"].values())
    assert [m.source for m in run_config.data.mix] == ["builtin_chitchat", "self_generated"]
    assert sum(counts) == 40 and all(abs(c - 40 * w / sum(weights)) <= 1 for c, w in zip(counts, weights)), counts
    assert stats["self_generated"]["kept"] == counts[1]
    assert stats["regeneration"]["decode_past_end_share"] == 0  # continuous batching: nothing past an answer's end
    cfg = json.loads((out / "final" / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27] and cfg["vocab_size"] == 49152
    assert (out / "final" / "model.safetensors").stat().st_size > 1_000_000
    ev = json.loads((out / "eval.json").read_text())
    assert ev["mean_acceptance_length"] >= 1.0 and len(ev["per_position_acceptance"]) == 3
    sets = ev["sets"]
    assert list(sets) == ["heldout", "assistant", "mtbench", "gsm8k", "summarization", "humaneval"]
    assert sets["mtbench"]["prompts"] == 2 * sets["mtbench"]["conversations"] == 4  # two turns each
    assert all(s["generated_tokens"] > 0 and len(s["per_position_acceptance"]) == 3 for s in sets.values())
    assert all(s["target_alone_prompts"] == 1 for s in sets.values())  # eval.baseline_prompts of the recipe
    assert ev["prompts"] == sum(s["prompts"] for s in sets.values())
    assert ev["estimated_speedup"] > 0 and ev["step_costs"]["target_verify_s"] > 0
    assert sum(b["rounds"] for b in ev["by_context_length"].values()) == ev["rounds"]  # every round in one bucket
    assert ev["by_context_length"]["<1k"]["rounds"] > 0
    cal = ev["calibration"]  # every round reaches position 1, and position i+1 only after i was accepted
    assert cal["rounds_reached_per_position"][0] == ev["rounds"]
    reached = [round(ev["rounds"] * ([1.0] + ev["per_position_acceptance"])[i]) for i in range(3)]
    assert cal["rounds_reached_per_position"] == reached
    assert all(e is None or 0 <= e <= 1 for e in cal["ece_per_position"])
    assert 0 < cal["mean_confidence_per_position"][0] <= 1
    table = (out / "eval.md").read_text()
    assert all(f"| {name} |" in table for name in [*sets, "all"])
    assert "by context length" in table
    assert (out / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "wandb").is_dir()  # offline wandb files live inside the run
    assert str(out / "final") in stdout and str(out / "eval.json") in stdout


def test_trained_draft_beats_an_untrained_one_on_heldout_acc0(default_run):
    import torch
    from omegaconf import OmegaConf

    from specforge_lite.compose import to_config
    from specforge_lite.evaluate.heldout import heldout_accuracy
    from specforge_lite.data import pad_id
    from specforge_lite.run import Run

    out, _ = default_run
    trained = json.loads((out / "eval.json").read_text())["heldout_acc"]
    run = Run.online(to_config(OmegaConf.load(out / "config.yaml")), log=lambda m: None)
    untrained = run.build_draft()
    with torch.no_grad():
        base = heldout_accuracy(run.objective, run.teacher, untrained, run.data.heldout, pad_id(run.tokenizer),
                                run.config.eval.heldout_batches)
    assert trained[0] > base["acc"][0] + 0.05, (trained, base)


def test_a_run_continues_a_trained_draft_as_it_is(default_run, tmp_path):
    """draft.init_from=RUN: the run's draft is the trained one, exactly (its weights, vocabulary and aux ids,
    whatever this run's draft settings say), so its held-out accuracy is the one the first run's evaluation
    measured. A folder with no draft, or a draft of another method, is refused with the fix."""
    import dataclasses

    import torch
    from omegaconf import OmegaConf

    from specforge_lite.compose import to_config
    from specforge_lite.evaluate.heldout import heldout_accuracy
    from specforge_lite.export import load_export
    from specforge_lite.data import pad_id
    from specforge_lite.run import Run

    out, _ = default_run
    config = to_config(OmegaConf.load(out / "config.yaml"))
    config.draft = dataclasses.replace(config.draft, init_from=str(out), draft_vocab_size=1234, aux_layer_ids=[1, 2, 3])
    run = Run.online(config, log=lambda m: None)
    draft = run.build_draft()
    spec, weights = load_export(out / "final")
    assert draft.spec == spec and torch.equal(run.vocab.draft_to_target, draft.draft_vocab_ids().cpu())
    for name, tensor in draft.trainable_state_dict().items():
        assert torch.equal(tensor.cpu(), weights[name].to(tensor.dtype)), name
    with torch.no_grad():
        held = heldout_accuracy(run.objective, run.teacher, draft, run.data.heldout, pad_id(run.tokenizer),
                                run.config.eval.heldout_batches)
    assert held["acc"] == pytest.approx(json.loads((out / "eval.json").read_text())["heldout_acc"], abs=1e-6)
    for init_from, method, message in ((str(tmp_path), "eagle3", "no draft there"),
                                       (str(out), "dflash", "use draft=eagle3")):
        config.draft = dataclasses.replace(config.draft, init_from=init_from, method=method)
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            Run.online(config, log=lambda m: None)


def test_eval_cli_reevaluates_a_run(default_run):
    from specforge_lite.evaluate.__main__ import main as cli

    out, _ = default_run
    # python -m specforge_lite.evaluate's entry point, run in this process (CI time: no interpreter start-up per mode)
    common = ["specforge_lite.evaluate", "--run-dir", str(out), "--k", "2", "--max-new-tokens", "8"]
    cli([*common[1:], "--num-prompts", "2", "--prompt-sets", "heldout", "gsm8k"])
    ev = json.loads((out / "eval.json").read_text())
    assert ev["num_draft_tokens"] == 2 and ev["prompts"] == 4 and list(ev["sets"]) == ["heldout", "gsm8k"]
    chain_outputs = json.loads((out / "eval_inputs.json").read_text())["generated"]
    # tree drafting on the real target with the trained draft: the same greedy outputs, more tokens per round
    cli([*common[1:], "--num-prompts", "2", "--prompt-sets", "heldout", "gsm8k", "--drafting", "tree",
         "--tree-topk", "3", "--tree-budget", "8"])
    tree = json.loads((out / "eval.json").read_text())
    assert tree["drafting"] == "tree" and tree["tree_budget"] == 8
    assert tree["calibration"]["rounds_reached_per_position"] == [0, 0]  # (recorded for chain decoding only)
    assert json.loads((out / "eval_inputs.json").read_text())["generated"] == chain_outputs
    assert "tree (depth 2, top-3, budget 8)" in (out / "eval.md").read_text()
    cli([*common[1:], "--num-prompts", "2", "--prompt-sets", "heldout", "--temperature", "0.8"])
    ev = json.loads((out / "eval.json").read_text())
    assert ev["temperature"] == 0.8 and ev["generated_tokens"] > 0 and ev["mean_acceptance_length"] >= 1.0


def test_help_lists_groups():
    proc = run(["train.py", "--help"])
    assert proc.returncode == 0
    for group in ["model:", "draft:", "data:", "trainer:", "tracker:"]:
        assert group in proc.stdout


def test_unknown_preset_names_the_presets_and_model_path():
    proc = run(["train.py", "model=llama9_1t"])
    assert proc.returncode != 0
    assert "smollm2_135m" in proc.stderr and "model.path=" in proc.stderr


@pytest.mark.parametrize("preset,offline", [("llama3_8b", "llama3_tiny"), ("gemma4", "gemma4_tiny")])
def test_unreachable_model_says_how_to_fix(tmp_path, preset, offline):
    proc = run(["train.py", f"model={preset}", f"output_dir={tmp_path}", "tracker=none"],
               env={"HF_HUB_OFFLINE": "1"}, timeout=300)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "not reachable" in text and "model.path=" in text and "smollm2_135m" in text
    assert f"model={offline}" in text  # the family's offline preset


def test_a_model_folder_with_a_damaged_file_is_named_in_one_line(tmp_path):
    """A model copied or downloaded only in part: the file is named, with the way out, before from_pretrained
    fails somewhere inside (a SafetensorError traceback before)."""
    import shutil

    from specforge_lite.compose import load_config
    from specforge_lite.targets.acquire import ModelUnavailableError, resolve_model_dir, tiny_model_dir

    model = load_config(["model=llama3_tiny"]).model
    folder = shutil.copytree(tiny_model_dir(model), tmp_path / "model")
    weights = next(folder.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    proc = run(["train.py", "model=llama3_tiny", "model.source=local", f"model.path={folder}",
                f"output_dir={tmp_path / 'run'}", "tracker=none"], timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"error: model folder {folder}: {weights.name} is damaged (cut short"), proc.stderr
    (folder / "config.json").write_text('{"architectures": [')
    model.source, model.path = "local", str(folder)
    with pytest.raises(ModelUnavailableError, match="config.json is not valid JSON"):
        resolve_model_dir(model)


def test_bad_aux_ids_and_unknown_key(tmp_path):
    proc = run(["train.py", "draft.aux_layer_ids=[2,15,31]", f"output_dir={tmp_path}", "tracker=none"], timeout=300)
    assert proc.returncode != 0 and "out of range" in proc.stdout + proc.stderr
    proc = run(["train.py", "draft.ttt_lenght=3"])
    assert proc.returncode != 0 and "ttt_lenght" in proc.stderr


def test_input_errors_are_one_message_said_before_the_target_is_built(tmp_path):
    """A missing data file is named before the target loads, as the message alone (no Hydra traceback);
    a malformed file's message names the file and line of its first bad row."""
    proc = run(["train.py", "model=llama3_tiny", "data.source=path", f"data.path={tmp_path / 'nope.jsonl'}",
                f"output_dir={tmp_path / 'a'}", "tracker=none"], timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.startswith("error: data.path=") and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr and "[target]" not in proc.stdout + proc.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
                   + '{"oops": 1}\n' * 3)
    proc = run(["train.py", "model=llama3_tiny", "data.source=path", f"data.path={bad}", f"output_dir={tmp_path / 'b'}",
                "tracker=none"], timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "\nerror: 3 of 4 rows" in proc.stderr and f"(first at {bad}:2)" in proc.stderr
    # a mistyped config group lists the groups and keys that exist (Hydra's own message lists neither)
    proc = run(["train.py", "modle=llama3_tiny", f"output_dir={tmp_path / 'c'}"], timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and not (tmp_path / "c").exists()
    assert proc.stderr.startswith("error: 'modle=llama3_tiny': no config group or key 'modle'. Groups: data, draft, "
                                  "model, recipe, tracker, trainer; top-level keys: model, target, draft")


def test_the_stage_tools_say_a_users_mistake_in_one_line_like_train_py(tmp_path):
    """export, export --check, evaluate, offline and the sweep report: a damaged run folder, a missing file or
    folder, an empty sweep is one `error:` line naming the path, exit 1, no traceback."""
    damaged = tmp_path / "run" / "checkpoints" / "step_00000002"
    damaged.mkdir(parents=True)
    (damaged / "draft.safetensors").write_bytes(b"not a safetensors file")
    (damaged / "trainer_state.json").write_text("{}")
    (damaged / "spec.json").write_text("{}")
    tools = {
        "export": ["-m", "specforge_lite.export", "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "x")],
        "export --check": ["-m", "specforge_lite.export", "--check", str(tmp_path / "missing")],
        "evaluate": ["-m", "specforge_lite.evaluate", "--run-dir", str(tmp_path / "missing")],
        "offline ingest": ["-m", "specforge_lite.offline", "ingest", "--from", "vllm", str(tmp_path / "missing"),
                           "model=llama3_tiny", f"store={tmp_path / 'store'}"],
        "sweep": ["-m", "specforge_lite.evaluate.sweep", str(tmp_path)],
    }
    expected = {"export": "step_00000002: trainer_state.json is damaged: it lacks step, tokens_seen, data",
                "export --check": str(tmp_path / "missing"), "evaluate": str(tmp_path / "missing"),
                "offline ingest": str(tmp_path / "missing"), "sweep": f"no runs (metrics.jsonl) under {tmp_path}"}
    for tool, args in tools.items():
        proc = run(args, timeout=300)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, (tool, proc.stdout[-2000:], proc.stderr[-3000:])
        assert proc.stderr.startswith("error: ") and expected[tool] in proc.stderr.splitlines()[0], (tool, proc.stderr)


def test_a_sweep_runs_and_reports(tmp_path):
    """python train.py --multirun over two draft options, then python -m specforge_lite.evaluate.sweep: one row per
    run with its overrides and the numbers of its own files, and a plot."""
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "train.py", "--multirun", "model=llama3_tiny", "recipe=none", "tracker=none",
           "draft.use_aux_norm=true,false", "data.max_length=96", "data.max_samples=16", "data.heldout_samples=4",
           "draft.draft_vocab_size=1024", "trainer.max_steps=2", "trainer.progress_bar=false", "eval.num_prompts=2",
           "eval.max_new_tokens=6", "eval.heldout_batches=2", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = subprocess.run([sys.executable, "-m", "specforge_lite.evaluate.sweep", str(sweep)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr[-3000:]
    rows = json.loads((sweep / "report.json").read_text())
    assert sorted(r["overrides"].lower() for r in rows) == ["draft.use_aux_norm=false", "draft.use_aux_norm=true"]
    for r in rows:
        ev = json.loads((sweep / r["run"] / "eval.json").read_text())
        assert r["mean_acceptance_length"] == ev["mean_acceptance_length"] and r["step"] == 2
        # comparable with the measured length: the bonus token + the accepted drafts of the served k steps
        k, prefix, expected = ev["num_draft_tokens"], 1.0, 1.0
        for a in ev["heldout_acc"][:k]:
            prefix *= a
            expected += prefix
        assert abs(r["heldout_sim_accept_len"] - expected) < 1e-12
    assert "| measured accept |" in (sweep / "report.md").read_text() and (sweep / "report.png").stat().st_size > 0
