"""A fault corpus for the tools, by class: damaged inputs to each tool (export --check, evaluate.rank, job,
draft.init_from, the vocabulary cache), settings a resume cannot apply, checkpoints from earlier versions, and
settings no run can finish with. Each ends in one line naming the file or setting and the fix (a user error,
no traceback), in a repaired cache, or in a counted skip; never in a message proposing a setting that would be
overridden."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, tiny_draft, tiny_target
from specforge_lite.errors import USER_ERRORS
from specforge_lite.export import export_draft


def said(main, argv, capsys) -> str:
    """What a tool's ``main`` says when it ends: a non-zero status and no traceback; a user's error is one
    ``error:`` line (and the hint that sets the traceback), returned; else the report it printed."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    code, out = done.value.code, capsys.readouterr()
    assert code not in (0, None) and "Traceback" not in out.out + out.err, (code, out)
    if isinstance(code, str):
        assert code.startswith("error: ") and len(code.splitlines()) == 2 and "TRACEBACK" in code, code
        return code.splitlines()[0]
    return out.out


def cut_short(path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.fixture
def export(tmp_path):
    draft = tiny_draft(tiny_target(aux_ids=[2, 4, 6]))
    return export_draft(draft.trainable_state_dict(), draft.spec, "vllm", tmp_path / "export")


# ---- export --check ------------------------------------------------------------------------------------------
def test_check_names_cut_short_weights(export, capsys):
    from specforge_lite.export.__main__ import main

    cut_short(export / "model.safetensors")
    text = said(main, ["--check", str(export)], capsys)
    assert "model.safetensors is damaged" in text and "export" in text.split("damaged")[1]


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "vocab_size"])
def test_check_names_a_size_the_config_lacks(export, capsys, field):
    from specforge_lite.export.__main__ import main

    config = json.loads((export / "config.json").read_text())
    del config[field]
    (export / "config.json").write_text(json.dumps(config))
    text = said(main, ["--check", str(export)], capsys)
    assert f"config.json lacks {field}" in text
    config["model_type"] = "no_such_type"  # (no class whose default a server could take)
    (export / "config.json").write_text(json.dumps(config))
    assert "has no default a server could take" in said(main, ["--check", str(export)], capsys)


@pytest.mark.parametrize("content", ["{\"architectures\": [", "[1, 2]", "\x00\x01binary"])
def test_check_names_a_config_that_is_not_a_json_object(export, capsys, content):
    from specforge_lite.export.__main__ import main

    (export / "config.json").write_text(content)
    text = said(main, ["--check", str(export)], capsys)
    assert f"{export / 'config.json'}" in text and "not a JSON object" in text


@pytest.mark.parametrize("name, expected", [("d2t", "d2t is ((123,), 'I64'), expected int64 [128]"),
                                            ("t2d", "t2d has shape (251,), vocab_size 256 implies (256,)")])
def test_check_names_vocabulary_maps_of_the_wrong_length(export, capsys, name, expected):
    from safetensors.torch import load_file, save_file

    from specforge_lite.export.__main__ import main

    weights = load_file(str(export / "model.safetensors"))
    weights[name] = weights[name][:-5]
    save_file(weights, str(export / "model.safetensors"))
    assert expected in said(main, ["--check", str(export)], capsys)


def test_check_of_a_block_draft_lacking_a_size(tmp_path, capsys):
    from specforge_lite.export.__main__ import main
    from test_dflash import tiny_block_draft

    for method in ("dflash", "dspark", "dflash2"):
        draft = tiny_block_draft(tiny_target(aux_ids=[2, 4, 6]), method)
        out = export_draft(draft.trainable_state_dict(), draft.spec, "vllm", tmp_path / method)
        config = json.loads((out / "config.json").read_text())
        del config["hidden_size"]
        (out / "config.json").write_text(json.dumps(config))
        assert "config.json lacks hidden_size" in said(main, ["--check", str(out)], capsys), method


# ---- evaluate.rank -------------------------------------------------------------------------------------------
EVAL = {"num_draft_tokens": 3, "mean_acceptance_length": 1.5, "per_position_acceptance": [0.3, 0.1, 0.1],
        "speedup_vs_target_alone": 1.1, "tokens_per_s": 10.0, "best_k": 1}


@pytest.fixture
def ranked_run(tmp_path):
    """An evaluated run this machine's vLLM cannot serve (DFlash 2 on a CPU), so rank reads our eval.json."""
    from test_dflash import tiny_block_draft

    run = tmp_path / "run"
    draft = tiny_block_draft(tiny_target(aux_ids=[2, 4, 6]), "dflash2")
    export_draft(draft.trainable_state_dict(), draft.spec, "vllm", run / "final")
    (run / "eval_inputs.json").write_text(json.dumps({"target": "t", "prompt_sets": ["a"], "prompts": [[1]],
                                                      "max_new_tokens": 8, "num_draft_tokens": 3}))
    (run / "eval.json").write_text(json.dumps(EVAL))
    return run


def test_rank_reads_an_intact_run(ranked_run, capsys):
    from specforge_lite.evaluate.rank import main

    main([str(ranked_run)])
    assert "| 1 |" in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["missing key", "cut short", "not JSON", "a list"])
@pytest.mark.parametrize("name", ["eval.json", "eval_inputs.json", "final/config.json"])
def test_rank_names_a_damaged_file_of_a_run(ranked_run, capsys, damage, name):
    from specforge_lite.evaluate.rank import main

    path = ranked_run / name
    if damage == "missing key":
        data = json.loads(path.read_text())
        key = {"eval.json": "mean_acceptance_length", "eval_inputs.json": "prompts",
               "final/config.json": "specforge_lite"}[name]
        del data[key]
        path.write_text(json.dumps(data))
    elif damage == "cut short":
        cut_short(path)
    else:
        path.write_text("<html>not found</html>" if damage == "not JSON" else "[]")
    text = said(main, [str(ranked_run)], capsys)
    if (name, damage) == ("final/config.json", "missing key"):  # (a folder another trainer wrote)
        assert f"{ranked_run / 'final'} was not written by specforge_lite" in text
    else:
        assert f"{path} is damaged" in text or f"{path} is not valid JSON" in text, text
        assert damage != "missing key" or f"it lacks {key}" in text, text
    assert "python -m specforge_lite." in text, text  # the way to write it again


@pytest.mark.parametrize("damage", ["cut short", "missing key"])
def test_rank_names_a_damaged_served_report(export, capsys, damage):
    """A run vLLM served (vllm_eval.json, as the served check writes it): damaged, it is named with the way to
    serve the run again, before anything is served."""
    from specforge_lite.evaluate.rank import main

    run = export.parent
    shutil.copytree(export, run / "final")
    (run / "eval_inputs.json").write_text(json.dumps({"target": "t", "prompts": [[1]], "max_new_tokens": 8}))
    served = {"num_draft_tokens": 3, "dtype": "float32", "mean_acceptance_length": 1.5,
              "per_position_acceptance": [0.5], "speedup_vs_target_alone": 1.0, "served_tokens_per_s": 1.0,
              "outputs_equal_our_greedy": 1, "outputs_compared": 1}
    if damage == "missing key":
        del served["outputs_compared"]
    (run / "vllm_eval.json").write_text(json.dumps(served))
    if damage == "cut short":
        cut_short(run / "vllm_eval.json")
    text = said(main, [str(run)], capsys)
    path = run / "vllm_eval.json"
    assert f"{path} is damaged" in text or f"{path} is not valid JSON" in text, text
    assert "--serve-again" in text, text


# ---- job -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content, what", [("model: {name: [unclosed\n", "not YAML"),
                                           ("- a\n- b\n", "not a mapping"), ("42\n", "not a mapping"),
                                           ("just words\n", "just words"), ("", "empty"),
                                           ("draft:\n  no_such_setting: 1\n", "no_such_setting"),
                                           ("trainer:\n  max_steps: many\n", "max_steps")])
def test_job_names_a_configuration_it_cannot_read(tmp_path, capsys, content, what):
    from specforge_lite.job import main

    path = tmp_path / "config.yaml"
    path.write_text(content)
    text = said(main, [str(path), str(tmp_path / "run")], capsys)
    assert str(path) in text and what in text, text
    assert not (tmp_path / "run").exists()  # refused before anything was made


@pytest.mark.parametrize("flags, said", [(["--k", "0"], "eval.num_draft_tokens=0: allowed [1, inf)"),
                                         (["--max-new-tokens", "0"], "eval.max_new_tokens=0: allowed [1, inf)"),
                                         (["--temperature", "-1"], "eval.temperature=-1.0: allowed [0, inf)")])
def test_evaluate_refuses_a_flag_out_of_its_range_before_anything_loads_or_is_written(export, tmp_path, flags, said):
    """--k 0 crashed after the whole evaluation, having rewritten eval_inputs.json with k 0 (the served check then
    failed on it); --max-new-tokens 0 divided by zero; --temperature -1 was recorded as measured."""
    from omegaconf import OmegaConf

    from specforge_lite.compose import load_config
    from specforge_lite.evaluate.__main__ import main

    run_dir = tmp_path / "run"
    shutil.copytree(export, run_dir / "final")
    OmegaConf.save(OmegaConf.structured(load_config(["model=llama3_tiny", "tracker=none"])), run_dir / "config.yaml")
    (run_dir / "eval_inputs.json").write_text("{}")
    with pytest.raises(SystemExit) as ended:
        main(["--run-dir", str(run_dir), *flags])
    assert str(ended.value.code).startswith(f"error: {said}"), ended.value.code
    assert (run_dir / "eval_inputs.json").read_text() == "{}"


# ---- draft.init_from -----------------------------------------------------------------------------------------
def init_from(folder, *overrides):
    from specforge_lite.compose import load_config

    return load_config(["tracker=none", f"draft.init_from={folder}", *overrides])


def edit_json(path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _resize_d2t(folder) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))
    weights["d2t"] = weights["d2t"][:-5]
    save_file(weights, str(folder / "model.safetensors"))


DAMAGE = {
    "weights cut short": lambda d: cut_short(d / "model.safetensors"),
    "no weights": lambda d: (d / "model.safetensors").unlink(),
    "config cut short": lambda d: cut_short(d / "config.json"),
    "config a list": lambda d: (d / "config.json").write_text("[]"),
    "spec with an unknown field": lambda d: edit_json(d / "config.json",
                                                      lambda c: c["specforge_lite"]["spec"].update(warp_factor=9)),
    "spec lacking a field": lambda d: edit_json(d / "config.json", lambda c: c["specforge_lite"]["spec"].pop(
        "hidden_size")),
    "spec not a mapping": lambda d: edit_json(d / "config.json", lambda c: c["specforge_lite"].update(spec=[1])),
    "d2t of the wrong length": _resize_d2t,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_init_from_names_a_damaged_export(export, damage):
    """Refused before the target loads, in one line naming the folder or file and the fix."""
    from specforge_lite.run import initial_draft

    DAMAGE[damage](export)
    with pytest.raises(USER_ERRORS) as refused:
        initial_draft(init_from(export), log=lambda m: None)
    message = str(refused.value)
    assert str(export) in message and "\n" not in message, message
    assert "export" in message.split(str(export), 1)[1], message  # the fix: export (or fetch) it again


@pytest.mark.parametrize("method, trained_block", [("dflash", 3), ("dspark", 3), ("dflash2", 3)])
def test_init_from_a_block_draft_of_another_k_is_refused_with_the_setting_to_continue_it(tmp_path, method,
                                                                                         trained_block):
    """H3: a block draft's block is its input, fixed at its training: a run continuing it at another
    draft.block_size would train one block size and export the other (labelled with the old k)."""
    from specforge_lite.run import initial_draft
    from test_dflash import tiny_block_draft

    draft = tiny_block_draft(tiny_target(aux_ids=[2, 4, 6]), method, block_size=trained_block)
    out = export_draft(draft.trainable_state_dict(), draft.spec, "vllm", tmp_path / method)
    spec, _ = initial_draft(init_from(out, f"draft.method={method}", f"draft.block_size={trained_block}"),
                            log=lambda m: None)
    with pytest.raises(ValueError, match=f"draft.init_from={out} .*draft.block_size={trained_block}") as refused:
        initial_draft(init_from(out, f"draft.method={method}", f"draft.block_size={trained_block + 2}"),
                      log=lambda m: None)
    assert "\n" not in str(refused.value)


def test_init_from_with_a_shape_given_otherwise_is_refused_and_the_drafts_own_shape_is_kept(export):
    """A continued EAGLE3 draft keeps its shape: draft.num_layers=2 and draft.parallel_drafting=true trained (and
    exported) the one-layer chain draft of the folder, unsaid. Settings left at their defaults still take the
    draft's own shape, whatever it is."""
    from specforge_lite.run import initial_draft

    spec, _ = initial_draft(init_from(export), log=lambda m: None)
    assert (spec.num_layers, spec.parallel_drafting) == (1, False)
    edit_json(export / "config.json", lambda c: c["specforge_lite"]["spec"].update(norm_before_fc=False,
                                                                                   norm_output=False))
    assert not initial_draft(init_from(export), log=lambda m: None)[0].norm_before_fc  # (the defaults: EAGLE 3.1's)
    with pytest.raises(ValueError, match=rf"^draft.init_from={export} is a draft with num_layers 1 and "
                                         r"parallel_drafting false, and this run gives draft.num_layers=2 and "
                                         r"draft.parallel_drafting=true: a continued draft keeps its shape; drop "
                                         r"those settings, or train a new draft \(no draft.init_from\)$"):
        initial_draft(init_from(export, "draft.num_layers=2", "draft.parallel_drafting=true"), log=lambda m: None)


def test_init_from_with_its_aux_ids_given_otherwise_is_refused(export):
    """A continued draft reads its own aux ids: draft.aux_layer_ids=[1,3,5] trained the folder's [2,4,6], said only in
    the [draft] line. Given as the draft's own, they are taken."""
    from specforge_lite.run import initial_draft

    assert initial_draft(init_from(export, "draft.aux_layer_ids=[2,4,6]"), log=lambda m: None)[0].aux_layer_ids == \
        [2, 4, 6]
    with pytest.raises(ValueError, match=rf"^draft.init_from={export} is a draft with aux_layer_ids \[2, 4, 6\], "
                                         r"and this run gives draft.aux_layer_ids=\[1, 3, 5\]: a continued draft "
                                         r"keeps its shape; drop those settings, or train a new draft"):
        initial_draft(init_from(export, "draft.aux_layer_ids=[1,3,5]"), log=lambda m: None)


def test_init_from_with_a_shape_setting_given_at_its_default_on_the_command_line_is_refused(export):
    """draft.norm_output=true is the method's default (EAGLE 3.1), and the folder's draft has no output norm: given
    on the command line it is a request all the same, which trained the folder's layout, unsaid. Left out, the draft's
    own layout is taken."""
    from specforge_lite.run import initial_draft

    assert not initial_draft(init_from(export), log=lambda m: None)[0].norm_output
    with pytest.raises(ValueError, match=rf"^draft.init_from={export} is a draft with norm_output false, and this "
                                         r"run gives draft.norm_output=true: a continued draft keeps its shape"):
        initial_draft(init_from(export, "draft.norm_output=true"), log=lambda m: None)


def test_init_from_with_its_vocabulary_given_otherwise_on_the_command_line_is_refused(export):
    """draft.draft_vocab_size=64 given with draft.init_from of a 128-token draft trained (and exported) the 128 tokens,
    said only in the [draft] line. Given as the draft's own, or left to a recipe (every recipe sets one, so its value
    says nothing of what the user asked), the draft's own is taken."""
    from specforge_lite.run import initial_draft

    for given in [[], ["recipe=scale"], ["draft.draft_vocab_size=128"]]:
        assert initial_draft(init_from(export, *given), log=lambda m: None)[0].draft_vocab_size == 128
    with pytest.raises(ValueError, match=rf"^draft.init_from={export} is a draft with draft_vocab_size 128, and this "
                                         r"run gives draft.draft_vocab_size=64: a continued draft keeps its shape; "
                                         r"drop those settings, or train a new draft"):
        initial_draft(init_from(export, "draft.draft_vocab_size=64"), log=lambda m: None)
    # train.py composes with Hydra's own entry point: the same line, before the target or the data loads
    refused = subprocess.run([sys.executable, str(ROOT / "train.py"), "tracker=none", f"draft.init_from={export}",
                              "draft.draft_vocab_size=64", f"output_dir={export.parent / 'run'}"], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and refused.stderr.startswith(f"error: draft.init_from={export} is a draft with "
                                                                 "draft_vocab_size 128, and this run gives "
                                                                 "draft.draft_vocab_size=64"), refused.stderr


def test_init_from_a_draft_of_another_target_names_the_target_not_an_overridden_setting(tmp_path):
    """draft.init_from keeps the draft's aux ids and vocabulary: a message proposing draft.aux_layer_ids (which
    it overrides) would send the user in a circle. Refused before any data is prepared (the rows are only read
    and rendered, before the target loads)."""
    from specforge_lite.run import Run

    deep = tiny_draft(tiny_target(aux_ids=[2, 12, 21], num_layers=24))
    deeper = export_draft(deep.trainable_state_dict(), deep.spec, "vllm", tmp_path / "deep")
    with pytest.raises(ValueError) as refused:
        Run.online(init_from(deeper, "model=llama3_tiny"), log=lambda m: None)
    message = str(refused.value)
    assert f"draft.init_from={deeper}" in message and "model=" in message, message
    assert "draft.aux_layer_ids" not in message and "\n" not in message, message
    small = tiny_draft(tiny_target(aux_ids=[2, 4, 6]))  # a 256-token vocabulary; llama3_tiny's is 49152
    other = export_draft(small.trainable_state_dict(), small.spec, "vllm", tmp_path / "small")
    with pytest.raises(ValueError, match=f"draft.init_from={other} .*vocab 256.*model=") as refused:
        Run.online(init_from(other, "model=llama3_tiny"),
                   log=lambda m: m.startswith(("[draft]", "[data] read before")) or pytest.fail(f"went on: {m}"))


# ---- resume: settings that change what the optimizer steps, checkpoints from earlier versions -----------------
def train_tiny(run_dir, max_steps, stop_at=None, freeze_lm_head=False, optimizer="adamw", log=lambda m: None):
    """test_training's tiny run, with the draft's lm_head frozen or not (draft.freeze_lm_head)."""
    from specforge_lite.config import TrackerConfig, TrainerConfig
    from specforge_lite.data import BatchStream
    from specforge_lite.methods.eagle3.objective import TTTObjective
    from specforge_lite.methods.eagle3.settings import Eagle3Settings
    from specforge_lite.training.loop import train
    from specforge_lite.training.tracking import Tracker
    from test_training import synthetic_dataset

    from conftest import tiny_teacher

    target = tiny_target()
    draft = tiny_draft(target, draft_vocab_size=target.vocab_size)
    draft.lm_head.requires_grad_(not freeze_lm_head)
    cfg = TrainerConfig(max_steps=max_steps, micro_batch_size=2, grad_accum_steps=1, lr=3e-3, save_every=1,
                        stop_at_step=stop_at, progress_bar=False, precision="fp32", optimizer=optimizer)
    stream = BatchStream(synthetic_dataset(), cfg.micro_batch_size, pad_id=0, seed=0)
    return train(cfg, TTTObjective.from_config(Eagle3Settings(ttt_length=2)), tiny_teacher(target, draft), draft,
                 stream, run_dir, lambda step: Tracker(TrackerConfig(kind="none"), run_dir, {}, resume_step=step),
                 draft.spec.to_dict(), log=log)


@pytest.mark.parametrize("before", [False, True])
def test_a_resume_after_freeze_lm_head_changed_names_the_setting_to_restore(tmp_path, before):
    """A frozen lm_head has no optimizer state: a resume across the change would load moments for a weight
    that has none (or drop them), so it is refused with the exact setting, before anything is loaded."""
    from specforge_lite.training.checkpoint import CheckpointError

    train_tiny(tmp_path, max_steps=2, stop_at=1, freeze_lm_head=before)
    with pytest.raises(CheckpointError, match=f"draft.freeze_lm_head={str(before).lower()}") as refused:
        train_tiny(tmp_path, max_steps=2, freeze_lm_head=not before)
    assert "\n" not in str(refused.value)
    assert train_tiny(tmp_path, max_steps=2, freeze_lm_head=before).step == 2


@pytest.mark.parametrize("recorded", ["nothing", "settings without the optimizer"])
def test_a_checkpoint_written_before_settings_were_recorded_resumes_or_names_the_settings(tmp_path, recorded):
    """trainer_state.json without ``settings`` (an earlier version's): its optimizer state shows the optimizer
    and AdamW's peak rate, so a resume under the recipe's newer optimizer (Muon), or another rate, is refused
    with the settings that resume it, before anything is loaded (a RuntimeError traceback before); with them,
    it resumes."""
    from specforge_lite.training.checkpoint import STATE, CheckpointError

    train_tiny(tmp_path, max_steps=2, stop_at=1)
    state_file = tmp_path / "checkpoints" / "step_00000001" / STATE
    edit_json(state_file, lambda state: state.pop("settings") if recorded == "nothing" else
              state["settings"].pop("optimizer"))
    with pytest.raises(CheckpointError, match=r"trainer.optimizer adamw -> muon") as refused:
        train_tiny(tmp_path, max_steps=2, optimizer="muon")
    assert "\n" not in str(refused.value) and "(trainer.optimizer=adamw)" in str(refused.value)
    assert train_tiny(tmp_path, max_steps=2).step == 2


# ---- settings no run can finish with: refused before anything runs ---------------------------------------------
@pytest.mark.parametrize("overrides, problem", [
    (["eval.prompt_sets=[]"], "eval.prompt_sets is empty"),
    (["eval.prompt_sets=[heldout,mtbnech]"], "unknown sets ['mtbnech']"),
    (["eval.prompt_sets=[traffic]"], "eval.prompt_files.traffic=PATH"),
    (["+eval.prompt_files.gsm8kk=/x.jsonl"], "eval.prompt_files names unknown sets ['gsm8kk']")])
def test_evaluation_settings_that_cannot_be_measured_are_refused_before_the_run(overrides, problem):
    """An empty eval.prompt_sets was an IndexError after training; an unknown set, a refusal after training."""
    from specforge_lite.compose import load_config
    from specforge_lite.settings import setting_problems

    assert any(problem in p for p in setting_problems(load_config(["tracker=none", *overrides])))
    assert not any("eval.prompt" in p for p in setting_problems(load_config(["tracker=none", "eval.enabled=false",
                                                                             *overrides])))


# ---- caches --------------------------------------------------------------------------------------------------
def _replace_cached_vocab(path) -> None:
    torch.save({"draft_to_target": torch.arange(7), "coverage": 0.5}, path)


VOCAB_DAMAGE = {"cut short": lambda path: cut_short(path), "emptied": lambda path: path.write_bytes(b""),
                "not a torch file": lambda path: path.write_text("{}"),
                "another vocabulary's size": _replace_cached_vocab,
                "ids out of range": lambda path: torch.save({"draft_to_target": torch.arange(100) * 9,
                                                             "coverage": 0.5}, path)}


@pytest.mark.parametrize("damage", list(VOCAB_DAMAGE))
def test_a_damaged_vocabulary_cache_is_named_and_rebuilt(tmp_path, monkeypatch, damage):
    """The cache is derived from the data: a damaged file (a kill mid-write on a filesystem without atomic
    renames, a disk error, an edit) is said in one line and rebuilt, never a traceback nor a wrong vocabulary."""
    from specforge_lite.data.vocab import build_draft_vocab

    monkeypatch.setenv("SPECFORGE_LITE_CACHE", str(tmp_path))
    rows = {"input_ids": [[i % 256 for i in range(s, s + 30)] for s in range(0, 200, 7)],
            "loss_mask": [[1] * 30 for _ in range(0, 200, 7)]}
    built = build_draft_vocab(rows, 256, 100, "tok", log=pytest.fail)
    [path] = list((tmp_path / "vocab").glob("*.pt"))
    VOCAB_DAMAGE[damage](path)
    said_ = []
    again = build_draft_vocab(rows, 256, 100, "tok", log=said_.append)
    assert torch.equal(again.draft_to_target, built.draft_to_target) and again.coverage == built.coverage
    assert len(said_) == 1 and str(path) in said_[0] and "rebuilt" in said_[0], said_
    assert torch.equal(build_draft_vocab(rows, 256, 100, "tok", log=pytest.fail).draft_to_target,
                       built.draft_to_target)


@pytest.mark.parametrize("tool", ["export", "evaluate"])
def test_the_tools_that_read_a_runs_config_name_a_damaged_one(export, capsys, tool):
    """export --run-dir and evaluate --run-dir read the run's config.yaml: damaged, it is named in one line."""
    import importlib

    run = export.parent
    shutil.copytree(export, run / "final")
    (run / "config.yaml").write_text("model: {name: [unclosed\n")
    main = importlib.import_module(f"specforge_lite.{tool}.__main__").main
    argv = (["--run-dir", str(run), "--out", str(run / "again")] if tool == "export" else ["--run-dir", str(run)])
    text = said(main, argv, capsys)
    assert f"{run / 'config.yaml'} is not YAML" in text, text


@pytest.mark.parametrize("lost", ["optimizer.json", "optimizer.safetensors"])
def test_a_checkpoint_that_lost_its_optimizer_state_is_passed_over(tmp_path, lost):
    """A checkpoint folder missing a file of its optimizer state (deleted, a copy that left it out) is damaged
    like one missing its weights: passed over for the older intact one, and named."""
    said_ = []
    train_tiny(tmp_path, max_steps=3, stop_at=2)  # saves steps 1 and 2
    (tmp_path / "checkpoints" / "step_00000002" / lost).unlink()
    assert train_tiny(tmp_path, max_steps=3, log=said_.append).step == 3
    assert any("step_00000002" in m and lost in m and "step_00000001" in m for m in said_), said_


# ---- evaluation inputs -----------------------------------------------------------------------------------------
def test_prompts_longer_than_the_targets_positions_are_counted_and_skipped_with_a_word():
    """A prompt that leaves no room in the target's positions for eval.max_new_tokens and a round's drafts was
    decoded past them without a word (rotary positions extrapolate in silence; learned ones fail): it is
    skipped, counted in the set's results, and said."""
    from specforge_lite.config import EvalConfig
    from specforge_lite.evaluate.acceptance import _run_set
    from specforge_lite.evaluate.prompts import PromptItem, PromptSet
    from specforge_lite.evaluate.spec_decode import Generation

    target = tiny_target()  # 512 positions
    ev = EvalConfig(max_new_tokens=16, num_draft_tokens=3, baseline_prompts=0)
    decoded = []

    def decode(ids, images):
        decoded.append(len(ids))
        return Generation(tokens=[1] * 4, accepted=[2, 1], contexts=[len(ids), len(ids) + 3], confidences=[])

    items = [PromptItem(ids=[5] * n) for n in (10, 600, 500, 480)]
    said_ = []
    result = _run_set(PromptSet("heldout", "here", items), decode, target, None, ev, set(), said_.append)
    assert decoded == [10, 480] and result["prompts"] == 2 and result["too_long_prompts"] == 2
    assert any("2 prompt(s)" in m and "512 positions" in m and "eval.max_new_tokens" in m for m in said_), said_


def test_trainer_resume_naming_no_checkpoint_is_refused_before_the_target_loads(tmp_path):
    """A missing path, or a run's folder in place of one of its checkpoints, was said as "incomplete (missing
    draft.safetensors, ...)" once the target had loaded."""
    from specforge_lite.compose import load_config
    from specforge_lite.settings import setting_problems

    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    for given, said in ((tmp_path / "nowhere", "no such folder; give a run's checkpoints/step_* folder"),
                        (run, f"is a run's folder: give one of its checkpoints/step_* folders "
                              f"({run / 'checkpoints' / 'step_00000004'} is its newest), or continue that run with "
                              f"output_dir={run}"),
                        (run / "checkpoints" / "step_00000004", "cannot be read: it is incomplete")):
        problems = setting_problems(load_config(["tracker=none", f"trainer.resume={given}"]))
        assert problems == [p for p in problems if p.startswith(f"trainer.resume={given}")] and len(problems) == 1
        assert said in problems[0], problems


def test_export_of_a_checkpoint_that_is_not_there_says_so_without_proposing_a_resume(tmp_path):
    from specforge_lite.export import export_run

    with pytest.raises(FileNotFoundError, match=rf"^--checkpoint {tmp_path / 'nope'}: no such folder; give one of the "
                                                r"run's checkpoints/step_\* folders"):
        export_run(tmp_path, "vllm", tmp_path / "out", checkpoint=tmp_path / "nope")
