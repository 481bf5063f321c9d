"""An adaptation home: the draft versions side by side, the ``current`` pointer and the decisions log.

    HOME/
      v0001/ v0002/ ...   each a draft as a run folder holds it: config.yaml and final/ (what servers load)
      current -> v0002    a symbolic link, replaced atomically (a new link renamed over the old one)
      decisions.jsonl     one JSON line per event (init, promote, reject, fail, skip, rollback) with its numbers
      settings.json       what ``adapt init`` fixed: the base configuration, the rails, the judge
      base_config.yaml    the configuration every candidate starts from (target, data, draft, trainer)
      regression.jsonl    the frozen regression prompts (MT-bench format)
      heldout.jsonl       held-out traffic (never trained on), newest last
      reports/NNNN/       the judged drafts' evaluations (ours and vLLM's) behind decision NNNN (its line)
      work/               the candidate being made; removed once it is decided

The decisions log is the truth. ``current`` is the version of its last init, promote or rollback event, and
``repair`` (run by every command first, under the home's lock) makes the folder agree with it after a kill:
a version folder is published (renamed into place, complete) before its event is logged, and the link is
swapped after, so a kill at any moment leaves ``current`` at a complete version, and a folder that never
made it into the log is removed.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..files import fsync, write_then_rename

DECISIONS, CURRENT = "decisions.jsonl", "current"


class AdaptHomeError(UserError):
    """An adaptation home that is missing, not initialised, or asked for what it does not hold."""


def fsync_tree(path: Path) -> None:
    """Every file under ``path`` and the folders themselves on disk (a rename after it publishes whole files)."""
    for root, _, files in os.walk(path):
        for name in files:
            fsync(Path(root) / name)
        fsync(Path(root))


def write_json_atomic(path: Path, value: Any) -> None:
    write_then_rename(path, lambda tmp: tmp.write_text(json.dumps(value, indent=1) + "\n"))


@dataclass
class Home:
    root: Path

    def __post_init__(self):
        self.root = Path(self.root).expanduser().resolve()

    # ---- reading ---------------------------------------------------------------------------------
    def events(self) -> list[dict]:
        """The decisions log, oldest first (a line cut short by a kill is left out: its event never happened)."""
        path = self.root / DECISIONS
        if not path.is_file():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    def require(self) -> "Home":
        if not any(e["event"] == "init" for e in self.events()):
            raise AdaptHomeError(f"{self.root} is not an adaptation home: start one with python -m "
                                 "specforge_lite.adapt init --home HOME --draft RUN_OR_EXPORT")
        return self

    def settings(self) -> dict:
        return json.loads((self.root / "settings.json").read_text())

    def history(self) -> list[str]:
        """The versions that were current, in order, with rolled-back ones taken off: the last is current."""
        stack: list[str] = []
        for e in self.events():
            if e["event"] in ("init", "promote"):
                stack.append(e["version"])
            elif e["event"] == "rollback" and len(stack) > 1:
                stack.pop()
        return stack

    def current(self) -> Path:
        history = self.require().history()
        return self.root / history[-1]

    def consumed(self) -> dict[str, str]:
        """Traffic files already used (read into a decision, or skipped as unreadable): path -> fingerprint."""
        return {f["path"]: f["fingerprint"] for e in self.events() for f in e.get("files", [])}

    # ---- writing ---------------------------------------------------------------------------------
    def log(self, event: str, **fields) -> dict:
        """Append one event to the decisions log, on disk before this returns."""
        row = {"event": event, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **fields}
        with open(self.root / DECISIONS, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return row

    def publish(self, final: Path, config: Path) -> str:
        """Copy a draft (its export folder and its run's config.yaml) in as the next version; its name. The
        copy is made under a hidden name and renamed into place whole."""
        names = [p.name for p in self.root.glob("v[0-9][0-9][0-9][0-9]")]
        name = f"v{max([int(n[1:]) for n in names] + [0]) + 1:04d}"
        staging = self.root / f".staging-{name}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        shutil.copytree(final, staging / "final")
        shutil.copy2(config, staging / "config.yaml")
        fsync_tree(staging)
        os.rename(staging, self.root / name)
        fsync(self.root)
        return name

    def point_at(self, version: str) -> None:
        """Swap ``current`` to ``version``: a new link renamed over the old one (never absent, never half)."""
        tmp = self.root / f".{CURRENT}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        os.symlink(version, tmp)
        os.replace(tmp, self.root / CURRENT)
        fsync(self.root)

    def repair(self, log=print) -> None:
        """Make the folder agree with the decisions log after a kill (see the module docstring)."""
        for leftover in [*self.root.glob(".staging-*"), *self.root.glob(f".{CURRENT}.*")]:
            shutil.rmtree(leftover) if leftover.is_dir() and not leftover.is_symlink() else leftover.unlink()
        logged = {e["version"] for e in self.events() if e["event"] in ("init", "promote")}
        for folder in self.root.glob("v[0-9][0-9][0-9][0-9]"):
            if folder.name not in logged:  # published, then killed before its decision was logged
                log(f"[adapt] removing {folder.name}: killed before its promotion was logged")
                shutil.rmtree(folder)
        history = self.history()
        if history:
            link = self.root / CURRENT
            if not link.is_symlink() or os.readlink(link) != history[-1]:
                log(f"[adapt] current -> {history[-1]} (as the decisions log says)")
                self.point_at(history[-1])

    def rollback(self, log=print) -> str:
        """Point ``current`` back at the version before it, and log it; the version now current."""
        history = self.require().history()
        if len(history) < 2:
            raise AdaptHomeError(f"nothing to roll back to: {history[-1]} is the only version that was current")
        self.log("rollback", version=history[-2], rolled_back=history[-1])
        self.point_at(history[-2])
        log(f"[adapt] rolled back: current -> {history[-2]} (was {history[-1]})")
        return history[-2]
