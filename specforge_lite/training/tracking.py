"""metrics.jsonl (always) and the trackers tracker.kind names, one or several at once: wandb (offline by default,
files inside the run directory), TensorBoard (event files under <run>/tensorboard) and MLflow (a SQLite database in
the run directory, or the server MLFLOW_TRACKING_URI names).

Each tracker is driven through its own maintained client (wandb's, torch's SummaryWriter, MLflow's MlflowClient).
accelerate's tracker adapters were the other candidate; they need accelerate's process state (its logging refuses
to run without one), which would set up a second distributed state beside the one the trainer initialises.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any

from ..config import TRACKER_KINDS, TrackerConfig, tracker_kinds
from ..errors import UserError
from ..files import WRITE_ERRORS, write_failure
from ..records import read_metrics


class RecordWriteError(UserError):
    """A run's record (metrics.jsonl) that could not be written: a full disk, a folder that cannot be written."""


def _cannot_write(path: Path, e: BaseException) -> RecordWriteError:
    return RecordWriteError(f"{path} could not be written ({write_failure(e)}): the run stopped. Free space or make "
                            "the folder writable, then run the same command: it resumes from the newest checkpoint "
                            "(the metrics of the steps after it are written again)")


def _numbers(values: dict[str, Any]) -> dict[str, float]:
    """The values a scalar tracker plots (a metric that is None at this step, or a text, is left out)."""
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and k != "step"}


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested settings dict as dotted keys (what TensorBoard's text and MLflow's params hold)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class WandbTracker:
    def __init__(self, cfg: TrackerConfig, run_dir: Path, config: dict[str, Any], resume_step: int):
        os.environ.setdefault("WANDB_DIR", str(run_dir))
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        # (the run's folder names the wandb run, so a resumed or re-opened run continues the same one)
        self.run = wandb.init(project=cfg.project, mode=cfg.mode, group=cfg.group, name=cfg.name, dir=str(run_dir),
                              config=config, resume="allow", id=_run_id(run_dir))

    def log(self, metrics: dict[str, Any]) -> None:
        self.run.log(metrics, step=metrics["step"])

    def summary(self, values: dict[str, Any], step: int) -> None:
        for k, v in values.items():
            self.run.summary[k] = v

    def close(self) -> None:
        self.run.finish()


class TensorBoardTracker:
    def __init__(self, cfg: TrackerConfig, run_dir: Path, config: dict[str, Any], resume_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard hides what an earlier process logged past the checkpoint this one starts from, so
        # each step is shown once (as metrics.jsonl keeps it)
        self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=resume_step + 1)
        if resume_step == 0:
            table = "\n".join(f"    {k}: {json.dumps(v)}" for k, v in _flat(config).items())
            self.writer.add_text("config", table, 0)

    def log(self, metrics: dict[str, Any]) -> None:
        for k, v in _numbers(metrics).items():
            self.writer.add_scalar(k, v, metrics["step"])
        self.writer.flush()

    def summary(self, values: dict[str, Any], step: int) -> None:
        self.log({**values, "step": step})

    def close(self) -> None:
        self.writer.close()


class MLflowTracker:
    """One MLflow run per run directory: its id is kept in <run>/mlflow_run.json, so a resumed run (and the
    evaluation's summary after training) logs to the same MLflow run."""

    def __init__(self, cfg: TrackerConfig, run_dir: Path, config: dict[str, Any], resume_step: int):
        from mlflow import MlflowClient
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        run_dir = Path(run_dir).resolve()
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        self.record = run_dir / "mlflow_run.json"
        self.run_id = self._earlier_run(uri)
        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
            return
        experiment = self.client.get_experiment_by_name(cfg.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
            cfg.project, artifact_location=None if "MLFLOW_TRACKING_URI" in os.environ
            else (run_dir / "mlartifacts").as_uri())
        tags = {"group": cfg.group} if cfg.group else None
        self.run_id = self.client.create_run(experiment_id, run_name=cfg.name or run_dir.name, tags=tags).info.run_id
        self.record.write_text(json.dumps({"tracking_uri": uri, "run_id": self.run_id}))
        params = [Param(k, json.dumps(v)[:MAX_PARAM_VAL_LENGTH]) for k, v in _flat(config).items()]
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + MAX_PARAMS_TAGS_PER_BATCH])

    def _earlier_run(self, uri: str) -> str | None:
        """The MLflow run this run directory logged to before, where it is on the same tracking server."""
        if not self.record.is_file():
            return None
        try:
            earlier = json.loads(self.record.read_text())
        except (OSError, ValueError):
            return None
        return earlier.get("run_id") if earlier.get("tracking_uri") == uri else None

    def log(self, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, metrics["step"])
                                                    for k, v in _numbers(metrics).items()])

    def summary(self, values: dict[str, Any], step: int) -> None:
        self.log({**values, "step": step})

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


TRACKERS = {"wandb": WandbTracker, "tensorboard": TensorBoardTracker, "mlflow": MLflowTracker}
PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow"}  # the import each one needs


def tracker_problems(cfg: TrackerConfig) -> list[str]:
    """What keeps tracker.kind from being used as given: a name that is no tracker, or one whose package is not
    installed (each with the fix)."""
    kinds = [cfg.kind] if isinstance(cfg.kind, str) else list(cfg.kind)
    unknown = [k for k in kinds if k not in TRACKER_KINDS]
    if unknown:
        return [f"tracker.kind={','.join(map(str, unknown))}: use one of {', '.join(TRACKER_KINDS)}, or several as "
                "tracker.kind=[tensorboard,mlflow]"]
    if "none" in kinds and len(kinds) > 1:
        return [f"tracker.kind={kinds}: none means no tracker; leave it out of the list"]
    missing = [k for k in tracker_kinds(cfg.kind) if importlib.util.find_spec(PACKAGES[k]) is None]
    return [f"tracker.kind={k}: the {PACKAGES[k]} package is not installed: pip install "
            f"'specforge_lite[trackers]' (or tracker.kind=none)" for k in missing]


class Tracker:
    def __init__(self, cfg: TrackerConfig, run_dir: Path, config: dict[str, Any], resume_step: int = 0):
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(run_dir) / "metrics.jsonl"
        self.step = resume_step
        try:
            self._drop_after(resume_step)
            self._file = open(self.path, "a", encoding="utf-8")
        except WRITE_ERRORS as e:
            raise _cannot_write(self.path, e) from None
        self._failed = False
        problems = tracker_problems(cfg)
        if problems:
            raise UserError(problems[0])
        self._trackers = [TRACKERS[kind](cfg, Path(run_dir), config, resume_step) for kind in tracker_kinds(cfg.kind)]

    def _drop_after(self, step: int) -> None:
        """On resume, forget lines past the checkpoint so metrics.jsonl has each step once."""
        if not self.path.is_file():
            return
        kept = [row for row in read_metrics(self.path, cut_short_last=True) if row.get("step", 0) <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
        os.replace(tmp, self.path)

    def log(self, metrics: dict[str, Any]) -> None:
        try:
            self._file.write(json.dumps(metrics) + "\n")
            self._file.flush()
        except WRITE_ERRORS as e:
            self._failed = True
            raise _cannot_write(self.path, e) from None
        self.step = metrics["step"]
        for tracker in self._trackers:
            tracker.log(metrics)

    def summary(self, values: dict[str, Any]) -> None:
        """Values of the whole run (the evaluation's), recorded at the last step."""
        for tracker in self._trackers:
            tracker.summary(values, self.step)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if summary:
            self.summary(summary)
        try:
            self._file.close()
        except WRITE_ERRORS as e:
            if not self._failed:  # (else the line that failed is still buffered: said already)
                raise _cannot_write(self.path, e) from None
        for tracker in self._trackers:
            tracker.close()


def _run_id(run_dir: Path) -> str:
    import hashlib

    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
