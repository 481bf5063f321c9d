"""Issue 67, items 1 and 2: the trackers tracker.kind names, one or several at once (wandb, TensorBoard, MLflow),
each with its real package and read back by that package's own reader; and the acceptance on held-out prompts
measured during training (eval.every_prompts), which equals what the end-of-run evaluation measures of the same
weights on the same prompts."""

from __future__ import annotations

import json

import pytest

from specforge_lite.compose import load_config
from specforge_lite.config import TrackerConfig
from specforge_lite.training.tracking import Tracker, tracker_problems


def tensorboard_scalars(run_dir, tag):
    """(step, value) of a tag as TensorBoard shows it (its own event reader, which applies the purge of a resume)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def same_series(actual, expected) -> bool:
    """(step, value) pairs: the same steps, the values within float32's rounding (TensorBoard stores float32)."""
    return [s for s, _ in actual] == [s for s, _ in expected] and \
        [v for _, v in actual] == pytest.approx([v for _, v in expected], rel=1e-6)


def mlflow_run(run_dir):
    """The MLflow client on the run's own database, and the one run the run directory logged to."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.resolve() / 'mlflow.db'}")
    [experiment] = [e for e in client.search_experiments() if e.name == "specforge_lite"]
    return client, client.search_runs([experiment.experiment_id])


def test_tensorboard_and_mlflow_at_once_and_a_resume_continues_each(tmp_path, monkeypatch):
    """Both trackers from one tracker.kind list: the steps past the checkpoint a resumed run starts from are
    shown once in TensorBoard (as metrics.jsonl keeps them), MLflow continues the same run, and the evaluation's
    summary lands at the last step in both."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = TrackerConfig(kind=["tensorboard", "mlflow"])
    settings = {"trainer": {"lr": 0.001, "max_steps": 4}, "draft": {"aux_layer_ids": [1, 2, 3]}}
    first = Tracker(cfg, tmp_path, settings)
    for step in (1, 2, 3):
        first.log({"step": step, "loss": 10.0 - step, "grad_norm": None})
    first.close()
    resumed = Tracker(cfg, tmp_path, settings, resume_step=2)  # (the checkpoint was step 2: step 3 is trained again)
    for step in (3, 4):
        resumed.log({"step": step, "loss": 1.0 / step})
    resumed.close()
    Tracker(cfg, tmp_path, settings, resume_step=4).close(summary={"eval/mean_acceptance_length": 1.5})

    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 9.0), (2, 8.0), (3, 1 / 3), (4, 0.25)]
    assert same_series(tensorboard_scalars(tmp_path, "loss"), [(1, 9.0), (2, 8.0), (3, 1 / 3), (4, 0.25)])
    assert tensorboard_scalars(tmp_path, "eval/mean_acceptance_length") == [(4, 1.5)]
    client, runs = mlflow_run(tmp_path)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    run_id = runs[0].info.run_id
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
    assert history[-1] == (4, 0.25) and {s for s, _ in history} == {1, 2, 3, 4}
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/mean_acceptance_length")] == [(4, 1.5)]
    assert runs[0].data.params["trainer.lr"] == "0.001" and runs[0].data.params["draft.aux_layer_ids"] == "[1, 2, 3]"


@pytest.mark.parametrize("kind, said", [
    ("tensorbord", "tracker.kind=tensorbord: use one of wandb, tensorboard, mlflow, none, or several"),
    (["mlflow", "wandbb"], "tracker.kind=wandbb: use one of wandb, tensorboard, mlflow, none"),
    (["none", "wandb"], "none means no tracker; leave it out of the list"),
])
def test_a_tracker_that_does_not_exist_is_refused_in_one_line_before_the_run(kind, said, tmp_path):
    from specforge_lite import job

    [problem] = tracker_problems(TrackerConfig(kind=kind))
    assert said in problem
    overrides = [f"tracker.kind={kind}" if isinstance(kind, str) else f"tracker.kind=[{','.join(kind)}]"]
    with pytest.raises(ValueError, match=said.split(":")[0].replace("[", r"\[")):
        job.run(load_config(overrides), tmp_path / "run", log=lambda m: None)
    assert not (tmp_path / "run").exists()


def test_a_tracker_whose_package_is_missing_names_the_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    assert tracker_problems(TrackerConfig(kind=["tensorboard", "mlflow"])) == [
        "tracker.kind=mlflow: the mlflow package is not installed: pip install 'specforge_lite[trackers]' "
        "(or tracker.kind=none)"]


@pytest.mark.parametrize("overrides, said", [
    (["eval.every_prompts=2"], "eval.every_prompts=2 is measured by the evaluation during training: set "
                               "eval.every_steps"),
    (["eval.every_steps=2", "trainer.keep_best=heldout_acceptance_length"], "set eval.every_prompts"),
])
def test_periodic_acceptance_settings_are_refused_in_one_line(overrides, said):
    from specforge_lite.settings import setting_problems

    assert any(said in p for p in setting_problems(load_config(overrides)))


def test_acceptance_during_training_equals_the_end_of_run_evaluation_and_reaches_every_tracker(tmp_path,
                                                                                             monkeypatch):
    """eval.every_prompts on a tiny random target: heldout/acceptance_length at each measured step, in
    metrics.jsonl, TensorBoard and MLflow, trainer.keep_best choosing by it, and the evaluation's summary in the
    trackers. (Its equality with the end-of-run evaluation where the draft accepts drafts is test_e2e's, on the
    real SmolLM2: here the few steps' draft accepts none.)"""
    from specforge_lite.job import run

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    run(load_config(["model=llama3_tiny", "recipe=none", "tracker.kind=[tensorboard,mlflow]", "data.max_length=96",
                     "data.max_samples=16", "data.heldout_samples=3", "trainer.max_steps=4", "trainer.save_every=2",
                     "trainer.progress_bar=false", "trainer.precision=fp32", "trainer.micro_batch_size=2",
                     "eval.every_steps=2", "eval.every_prompts=3", "trainer.keep_best=heldout_acceptance_length",
                     "eval.prompt_sets=[heldout]", "eval.num_prompts=3", "eval.max_new_tokens=8",
                     "eval.baseline_prompts=0", f"output_dir={out}"]), out, log=lambda m: None)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    held = {r["step"]: r["heldout/acceptance_length"] for r in rows if "heldout/acceptance_length" in r}
    assert sorted(held) == [2, 4] and all(v >= 1.0 for v in held.values())
    evaluated = json.loads((out / "eval.json").read_text())["sets"]["heldout"]
    assert evaluated["prompts"] == 3
    assert held[4] == pytest.approx(evaluated["mean_acceptance_length"], abs=1e-9)
    assert json.loads((out / "checkpoints" / "best").read_text())["value"] == max(held.values())
    assert same_series(tensorboard_scalars(out, "heldout/acceptance_length"), sorted(held.items()))
    client, [mlrun] = mlflow_run(out)
    history = client.get_metric_history(mlrun.info.run_id, "heldout/acceptance_length")
    assert same_series(sorted((m.step, m.value) for m in history), sorted(held.items()))
    assert mlrun.data.metrics["eval/mean_acceptance_length"] == pytest.approx(
        json.loads((out / "eval.json").read_text())["mean_acceptance_length"])
