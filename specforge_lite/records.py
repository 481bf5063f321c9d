"""What a training run leaves in its folder, read back: its metrics (metrics.jsonl) and its checkpoints.

training/ writes them (tracking.py, checkpoint.py); the export, the evaluation's tables and a resume read
them here, below all of them. A checkpoint is read from safetensors and JSON only, so reading a folder someone
else made runs no code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors.torch import load_file

from .errors import UserError
from .files import safetensors_problem

if TYPE_CHECKING:
    import torch

# a checkpoint folder's files (checkpoints/step_XXXXXXXX): the draft's weights, the trainer's state, the spec,
# the optimizer's step and schedule (training/optimizer_state.py writes it) and each rank's RNG
WEIGHTS = "draft.safetensors"
STATE = "trainer_state.json"
SPEC = "spec.json"
OPTIMIZER_META = "optimizer.json"
OPTIMIZER_TENSORS = "optimizer.safetensors"
# files of checkpoints written by earlier versions: Python pickles, never read (they could run code)
PICKLED = ("trainer_state.pt", "optimizer.pt", "rng_rank0.pt")
REPLACED = ".replaced-"  # a step's previous folder, kept until its re-save is in place
# the keys a resume reads from each JSON file of a checkpoint
REQUIRED_KEYS = {STATE: ("step", "tokens_seen", "data"), OPTIMIZER_META: ("step", "lrs", "scheduler"),
                 "rng_rank*.json": ("python", "numpy", "torch")}
# what every spec a checkpoint has recorded holds (a field added since is filled by its default on resume)
SPEC_KEYS = ("hidden_size", "vocab_size", "draft_vocab_size")
# the keys of a file's object that a resume reads in turn (the batch stream's position: data/loader.py)
REQUIRED_INNER = {STATE: {"data": ("size", "epoch", "cursor", "seed")}}


class CheckpointError(UserError):
    """A checkpoint folder that cannot be resumed or exported, with the reason and the way out."""


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.json"


def is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in (WEIGHTS, STATE, SPEC))


def checkpoint_problem(path: Path) -> str | None:
    """What keeps a checkpoint folder from being resumed, in words (which file, what is wrong); None when it
    reads: its files are all there, every JSON file parses and holds the keys a resume reads, and every
    safetensors file's header covers the file (a truncated or overwritten one fails here, before a resume
    has changed anything)."""
    path = Path(path)
    pickled = [name for name in PICKLED if (path / name).exists()]
    if pickled and not is_complete(path):
        return (f"it holds Python pickles ({', '.join(pickled)}) instead of {STATE}: it was written by an earlier "
                "specforge_lite, or by someone else, and loading a pickle can run any code, so it is not read")
    missing = [name for name in (WEIGHTS, STATE, SPEC, OPTIMIZER_META, OPTIMIZER_TENSORS)
               if not (path / name).is_file()]
    if missing:
        return f"it is incomplete (missing {', '.join(missing)})"
    for pattern, keys in {**REQUIRED_KEYS, SPEC: SPEC_KEYS}.items():
        for f in sorted(path.glob(pattern)):
            try:
                data = json.loads(f.read_text())
            except (ValueError, UnicodeDecodeError, OSError) as e:
                return f"{f.name} is damaged: not valid JSON ({e})"
            lacking = [k for k in keys if not isinstance(data, dict) or k not in data]
            if lacking or not isinstance(data, dict):
                return f"{f.name} is damaged: it lacks {', '.join(lacking) or 'its fields'}"
            lacking = [f"{outer}.{k}" for outer, inner in REQUIRED_INNER.get(pattern, {}).items() for k in inner
                       if not isinstance(data[outer], dict) or k not in data[outer]]
            if lacking:
                return f"{f.name} is damaged: it lacks {', '.join(lacking)}"
    return next(filter(None, map(safetensors_problem, sorted(path.glob("*.safetensors")))), None)


def checkpoint_folders(root: Path) -> dict[str, Path]:
    """Every checkpoint folder in ``root`` (a run's checkpoints/) by step name, resumable or not; a step's
    previous folder stands in where a kill during its re-save left that step without its published folder."""
    found = {p.name.removeprefix(REPLACED): p for p in root.glob(f"{REPLACED}step_*") if p.is_dir()}
    found.update({p.name: p for p in root.glob("step_*") if p.is_dir() and
                  (is_complete(p) or p.name not in found)})
    return found


def latest_checkpoint(run_dir: Path, log=None) -> Path | None:
    """The newest checkpoint that reads (``checkpoint_problem``). A newer damaged one is passed over, and
    ``log`` says which and why; None when no folder reads (``unusable_checkpoints`` then says why)."""
    found = checkpoint_folders(checkpoint_root(run_dir))
    damaged = []
    for name in sorted(found, reverse=True):
        problem = checkpoint_problem(found[name])
        if problem is None:
            if damaged and log is not None:
                log(f"[train] passing over damaged checkpoint(s) {'; '.join(damaged)}: resuming from the older "
                    f"{found[name]}")
            return found[name]
        damaged.append(f"{found[name]} ({problem})")
    return None


def unusable_checkpoints(run_dir: Path) -> list[str]:
    """Each checkpoint folder of the run with what keeps it from being resumed (all of them, when
    ``latest_checkpoint`` found none)."""
    problems = {name: checkpoint_problem(p) for name, p in sorted(checkpoint_folders(checkpoint_root(run_dir)).items())}
    return [f"{name}: {problem}" for name, problem in problems.items() if problem is not None]


def unreadable(path: Path, problem: str) -> str:
    """Checkpoint ``path`` cannot be read for ``problem``: what to use instead (the newest older one that reads)."""
    older = [p for name, p in sorted(checkpoint_folders(path.parent).items())
             if name < path.name.removeprefix(REPLACED) and checkpoint_problem(p) is None]
    way_out = (f"resume from {older[-1]} (trainer.resume={older[-1]})" if older else
               "point trainer.resume at another checkpoints/step_* folder")
    return (f"checkpoint {path} cannot be read: {problem}. Use another: {way_out}, or start anew (a new output_dir, "
            "or trainer.resume=never)")


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict]:
    """(weights, trainer state, spec): safetensors and JSON only; nothing is unpickled."""
    path = Path(path)
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(unreadable(path, problem))
    state, spec = json.loads((path / STATE).read_text()), json.loads((path / SPEC).read_text())
    return load_file(str(path / WEIGHTS)), state, spec


class DamagedRecord(UserError):
    """A run's record (metrics.jsonl) holding a line that is not a JSON object."""


def read_metrics(path: Path, cut_short_last: bool = False) -> list[dict[str, Any]]:
    """Each line of a metrics.jsonl as a dict. A line that does not parse is named by path and line;
    ``cut_short_last``: a last line that does not parse is dropped instead (a kill in the middle of its write)."""
    lines = [(n, line) for n, line in enumerate(Path(path).read_text(errors="replace").splitlines(), 1) if line.strip()]
    rows = []
    for i, (n, line) in enumerate(lines):
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not an object")
        except ValueError as e:
            if cut_short_last and i == len(lines) - 1:
                break
            raise DamagedRecord(f"{path}:{n} is not a JSON object ({e}): the file was edited or damaged; delete "
                                "that line (metrics of one step) and run again") from None
        rows.append(row)
    return rows
