"""metrics.jsonl (always) and wandb (offline by default, files inside the run directory)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..config import TrackerConfig
from ..errors import UserError
from ..files import WRITE_ERRORS, write_failure
from ..records import read_metrics


class RecordWriteError(UserError):
    """A run's record (metrics.jsonl) that could not be written: a full disk, a folder that cannot be written."""


def _cannot_write(path: Path, e: BaseException) -> RecordWriteError:
    return RecordWriteError(f"{path} could not be written ({write_failure(e)}): the run stopped. Free space or make "
                            "the folder writable, then run the same command: it resumes from the newest checkpoint "
                            "(the metrics of the steps after it are written again)")


class Tracker:
    def __init__(self, cfg: TrackerConfig, run_dir: Path, config: dict[str, Any], resume_step: int = 0):
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(run_dir) / "metrics.jsonl"
        try:
            self._drop_after(resume_step)
            self._file = open(self.path, "a", encoding="utf-8")
        except WRITE_ERRORS as e:
            raise _cannot_write(self.path, e) from None
        self._failed = False
        self._wandb = None
        if cfg.kind == "wandb":
            os.environ.setdefault("WANDB_DIR", str(run_dir))
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            self._wandb = wandb.init(project=cfg.project, mode=cfg.mode, group=cfg.group, name=cfg.name,
                                     dir=str(run_dir), config=config, resume="allow",
                                     id=_run_id(run_dir))
        elif cfg.kind != "none":
            raise ValueError(f"tracker.kind={cfg.kind!r}: use wandb or none")

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
        if self._wandb is not None:
            self._wandb.log(metrics, step=metrics["step"])

    def summary(self, values: dict[str, Any]) -> None:
        if self._wandb is not None:
            for k, v in values.items():
                self._wandb.summary[k] = v

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if summary:
            self.summary(summary)
        try:
            self._file.close()
        except WRITE_ERRORS as e:
            if not self._failed:  # (else the line that failed is still buffered: said already)
                raise _cannot_write(self.path, e) from None
        if self._wandb is not None:
            self._wandb.finish()


def _run_id(run_dir: Path) -> str:
    import hashlib

    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
