"""Issue 67, item 1: held-out TTT accuracy during training (eval.every_steps / eval.every_minutes), logged with the
step to metrics.jsonl and the tracker, and the best checkpoint by a named metric (trainer.keep_best) beside
``latest``, kept across a resume and exported instead of the last one where trainer.export_best asks."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_draft, tiny_target, tiny_teacher
from specforge_lite.config import TrackerConfig, TrainerConfig
from specforge_lite.data import BatchStream
from specforge_lite.methods.eagle3.objective import TTTObjective
from specforge_lite.methods.eagle3.settings import Eagle3Settings
from specforge_lite.records import load_checkpoint
from specforge_lite.training.loop import train
from specforge_lite.training.tracking import Tracker
from test_training import synthetic_dataset


def train_with_eval(run_dir, max_steps, every_steps=2, stop_at=None, keep_best="heldout_sim_accepted_drafts",
                    export_best=False, scripted=None, keep_checkpoints=1):
    """test_training's tiny run with a periodic held-out evaluation: the real one (heldout_accuracy over a few
    synthetic held-out conversations), or ``scripted`` values of heldout/sim_accepted_drafts by step."""
    from specforge_lite.evaluate.heldout import heldout_accuracy
    from specforge_lite.training.periodic import PeriodicEval

    target = tiny_target()
    draft = tiny_draft(target, draft_vocab_size=target.vocab_size)
    cfg = TrainerConfig(max_steps=max_steps, micro_batch_size=2, grad_accum_steps=1, lr=3e-3, save_every=1,
                        stop_at_step=stop_at, progress_bar=False, precision="fp32", keep_best=keep_best,
                        export_best=export_best, keep_checkpoints=keep_checkpoints)
    objective = TTTObjective.from_config(Eagle3Settings(ttt_length=2))
    teacher = tiny_teacher(target, draft)
    heldout = synthetic_dataset(n=3, seed=1)
    measure = lambda module: heldout_accuracy(objective, teacher, module, heldout, 0, 2)  # noqa: E731 (job.py's)
    if scripted is not None:
        calls = iter(scripted)
        measure = lambda module: {"acc": [0.5, 0.5], "sim_accepted_drafts": next(calls), "tokens": 1}  # noqa: E731
    lines = []
    result = train(cfg, objective, teacher, draft, BatchStream(synthetic_dataset(), 2, pad_id=0, seed=0), run_dir,
                   lambda step: Tracker(TrackerConfig(kind="none"), run_dir, {}, resume_step=step),
                   draft.spec.to_dict(), log=lines.append, periodic=PeriodicEval(measure, every_steps=every_steps))
    return result, lines


def rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def best_pointer(run_dir):
    return json.loads((run_dir / "checkpoints" / "best").read_text())


def test_eval_every_steps_logs_heldout_accuracy_with_the_step_and_keeps_the_best_checkpoint(tmp_path):
    train_with_eval(tmp_path, max_steps=4)
    held = [r for r in rows(tmp_path) if "heldout/sim_accepted_drafts" in r]
    assert [r["step"] for r in held] == [2, 4]
    for r in held:  # the same numbers as the end-of-run evaluation's (heldout_accuracy), in a training row
        assert {"heldout/acc_0", "heldout/acc_1", "heldout/tokens", "loss"} <= set(r)
        assert r["heldout/sim_accepted_drafts"] == pytest.approx(r["heldout/acc_0"] * (1 + r["heldout/acc_1"]))
    best = best_pointer(tmp_path)
    values = {r["step"]: r["heldout/sim_accepted_drafts"] for r in held}
    assert best["metric"] == "heldout_sim_accepted_drafts" and best["value"] == max(values.values())
    assert values[best["step"]] == best["value"]
    assert (tmp_path / "checkpoints" / best["checkpoint"]).is_dir()


def test_the_best_checkpoint_outlives_pruning_and_is_exported_when_asked(tmp_path):
    result, lines = train_with_eval(tmp_path, max_steps=6, scripted=[0.3, 0.9, 0.1], export_best=True)
    best = best_pointer(tmp_path)
    assert (best["step"], best["value"], best["checkpoint"]) == (4, 0.9, "step_00000004")
    folders = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert folders == ["step_00000004", "step_00000006"]  # keep_checkpoints=1, and the best beside it
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000006"
    saved = load_checkpoint(tmp_path / "checkpoints" / "step_00000004")[0]
    assert set(result.weights) == set(saved)
    assert all(torch.equal(result.weights[k], saved[k]) for k in saved)
    assert any("trainer.export_best" in line and "step_00000004" in line for line in lines)


def test_without_export_best_the_last_weights_are_exported(tmp_path):
    result, _ = train_with_eval(tmp_path, max_steps=4, scripted=[0.9, 0.1])
    last = load_checkpoint(tmp_path / "checkpoints" / "step_00000004")[0]
    assert all(torch.equal(result.weights[k], last[k]) for k in last)
    assert best_pointer(tmp_path)["step"] == 2


def test_a_resume_keeps_the_best_so_far(tmp_path):
    """The resumed run compares against the best written before it: a worse value never replaces it."""
    train_with_eval(tmp_path, max_steps=6, stop_at=2, scripted=[0.8])
    assert best_pointer(tmp_path)["step"] == 2
    _, lines = train_with_eval(tmp_path, max_steps=6, scripted=[0.5, 0.7])
    best = best_pointer(tmp_path)
    assert (best["step"], best["value"]) == (2, 0.8)
    assert (tmp_path / "checkpoints" / "step_00000002").is_dir()
    assert any("best so far" in line and "0.8" in line for line in lines)
    train_with_eval(tmp_path, max_steps=8, scripted=[0.95])  # a better one replaces it
    assert best_pointer(tmp_path)["step"] == 8


@pytest.mark.parametrize("overrides, said", [
    (["trainer.keep_best=loss"], "trainer.keep_best='loss': use one of heldout_sim_accepted_drafts"),
    (["trainer.keep_best=heldout_sim_accepted_drafts"], "set eval.every_steps or eval.every_minutes"),
    (["trainer.export_best=true"], "trainer.export_best=true needs trainer.keep_best"),
    (["eval.every_steps=5", "eval.heldout_batches=0"], "held-out conversations"),
])
def test_bad_periodic_settings_are_refused_in_one_line(overrides, said):
    from specforge_lite.compose import load_config
    from specforge_lite.methods import METHODS
    from specforge_lite.settings import periodic_problems

    problems = periodic_problems(load_config(overrides), METHODS["eagle3"])
    assert len(problems) == 1 and said in problems[0] and "\n" not in problems[0]
    config = load_config(["eval.every_steps=5", "trainer.keep_best=heldout_acc_0"])
    assert periodic_problems(config, METHODS["eagle3"]) == []


@pytest.mark.parametrize("overrides, said", [(["eval.every_steps=0"], "eval.every_steps=0: allowed [1, inf)"),
                                             (["eval.every_minutes=0"], "eval.every_minutes=0.0: allowed (0, inf)")])
def test_periodic_numbers_have_ranges(overrides, said):
    from specforge_lite.compose import load_config
    from specforge_lite.config import out_of_range

    assert said in out_of_range(load_config(overrides))


def test_a_run_with_bad_periodic_settings_is_refused_before_anything_runs(tmp_path):
    from specforge_lite import job
    from specforge_lite.compose import load_config

    with pytest.raises(ValueError, match="trainer.export_best=true needs trainer.keep_best"):
        job.run(load_config(["trainer.export_best=true"]), tmp_path, log=lambda m: None)
    assert list(tmp_path.iterdir()) == []
