"""A candidate draft: the current version trained further on new traffic, with a slice of the original data.

The traffic is split once, by a hash of each conversation's opening, into training and held-out conversations
(the held-out ones judge the candidate and are never trained on, in this adaptation or a later one). The
candidate's configuration is the home's base configuration with:

* ``draft.init_from`` = the current version (the draft continues, keeping its shapes, aux ids and vocabulary);
* ``data.mix`` = the training traffic (``regenerate: false``: its answers are the target's, as served) with
  weight ``1 - replay_ratio``, and the base data's own sources sharing ``replay_ratio`` (against forgetting;
  regenerated as the base data was);
* the adaptation's trainer budget (``--steps``, ``--minutes``), no evaluation of its own (the judge
  evaluates), no tracker.

It is trained by ``python -m specforge_lite.job`` in its own process group, so a long ``adapt watch`` holds no
model between adaptations, a failed candidate cannot take the loop down with it, and a signal that stops adapt
stops all of it (stopping.py), as does the home's ``timeout_minutes``.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

from ..config import MixSource
from ..data.prepare import opening
from ..files import write_jsonl
from ..records import read_metrics
from .stopping import TimedOut, run_in_own_group

HELDOUT_FOR_DATA = 8  # the candidate's own held-out split (its data needs one; the judge does not read it)
# the candidate's training time past which it is stopped (settings.json timeout_minutes; the default of a home
# made before the setting): a hung candidate must not hold the home's lock for ever
TIMEOUT_MINUTES = 240.0


class CandidateTimedOut(RuntimeError):
    """The candidate's training ran past its timeout and was stopped."""


def is_heldout(conversation: list[dict], fraction: float) -> bool:
    """Whether the conversation is held out: fixed by its opening, so a repeated request always lands on the
    same side and a held-out prompt is never trained on."""
    digest = hashlib.sha256(opening(conversation).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_traffic(conversations: list[list[dict]], fraction: float) -> tuple[list, list]:
    train, held = [], []
    for c in conversations:
        (held if is_heldout(c, fraction) else train).append(c)
    return train, held


def as_prompts(conversations: list[list[dict]]) -> list[dict]:
    """Held-out conversations as evaluation prompts (MT-bench format: the user turns, each asked after the
    target's own answer to the ones before, as they were served)."""
    rows = []
    for c in conversations:
        turns = [m["content"] for m in c if m["role"] == "user" and m["content"].strip()]
        if turns:
            rows.append({"turns": turns})
    return rows


def replay_sources(base_data, ratio: float) -> list[MixSource]:
    """The base data's own sources, sharing ``ratio`` of the candidate's conversations by their weights."""
    if ratio <= 0:
        return []
    sources = list(base_data.mix) if base_data.source == "mix" else [MixSource(base_data.source, base_data.path)]
    total = sum(s.weight for s in sources)
    return [MixSource(s.source, s.path, ratio * s.weight / total, s.regenerate) for s in sources]


def candidate_config(home, current: Path, traffic_file: Path, n_traffic: int, run_dir: Path):
    """The base configuration, continued from ``current`` on the traffic and the replay slice."""
    from omegaconf import OmegaConf

    from ..compose import to_config

    settings = home.settings()
    config = to_config(OmegaConf.load(home.root / "base_config.yaml"))
    ratio = settings["replay_ratio"]
    replay = replay_sources(config.data, ratio)
    config.data.mix = [MixSource("path", str(traffic_file), 1.0 - ratio, regenerate=False), *replay]
    config.data.source, config.data.path = "mix", None
    # every training conversation of the traffic, with the replay slice in proportion to it
    config.data.max_samples = max(1, round(n_traffic / (1.0 - ratio)))
    config.data.heldout_samples = HELDOUT_FOR_DATA
    if config.data.regenerate and config.data.generation.max_conversations is not None:
        config.data.generation.max_conversations = max(config.data.generation.max_conversations,
                                                       config.data.max_samples)
    if not any(s.regenerate is not False for s in config.data.mix):
        config.data.regenerate = False
    config.draft.init_from = str(current)
    config.eval.enabled, config.eval.serve = False, None
    config.tracker.kind = "none"
    # the steps the home was given, never the base run's epochs (job.py would turn those into steps instead)
    config.trainer.max_steps, config.trainer.epochs = settings["steps"], None
    config.trainer.max_minutes = settings["minutes"]
    config.trainer.stop_at_step = None
    config.output_dir = str(run_dir)
    return config


def job_command(config_file: Path, run_dir: Path) -> list[str]:
    """The candidate's training, as a process of its own."""
    return [sys.executable, "-m", "specforge_lite.job", str(config_file), str(run_dir)]


def train_candidate(home, current: Path, train_convs: list, work: Path, log=print) -> Path:
    """Train the candidate into ``work/run`` (a killed attempt's folder is started over); the run folder.
    Stopped past the home's ``timeout_minutes`` (``CandidateTimedOut``)."""
    from omegaconf import OmegaConf

    traffic_file = work / "traffic_train.jsonl"
    write_jsonl(traffic_file, [{"messages": c} for c in train_convs])
    run_dir = work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    config = candidate_config(home, current, traffic_file, len(train_convs), run_dir)
    config_file = work / "candidate_config.yaml"
    OmegaConf.save(OmegaConf.structured(config), config_file)
    log(f"[adapt] training a candidate from {current.name} on {len(train_convs)} traffic conversations "
        f"(replay ratio {home.settings()['replay_ratio']}; log: {work / 'train.log'})")
    minutes = home.settings().get("timeout_minutes", TIMEOUT_MINUTES)
    with open(work / "train.log", "w") as out:
        try:
            code = run_in_own_group(job_command(config_file, run_dir), out,
                                    timeout=None if minutes is None else 60 * minutes)  # (null: none)
        except TimedOut:
            raise CandidateTimedOut(f"the candidate's training ran past its timeout of {minutes:g} min and was "
                                    f"stopped (timeout_minutes in {home.root / 'settings.json'})") from None
    if code != 0 or not (run_dir / "final" / "config.json").is_file():
        tail = (work / "train.log").read_text(errors="replace").splitlines()[-5:]
        raise RuntimeError(f"the candidate's training failed (exit {code}); its log ends:\n  "
                           + "\n  ".join(tail))
    rows = read_metrics(run_dir / "metrics.jsonl")
    log(f"[adapt] candidate trained: {rows[-1]['step'] if rows else 0} steps")
    return run_dir
