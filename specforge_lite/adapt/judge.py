"""The promotion check: the current version and the candidate measured side by side on the same prompts.

Two prompt sets, each drafted with the same k: ``traffic`` (held-out traffic, the stream the draft is adapted
to) and ``regression`` (the home's frozen set, what the draft must keep doing). Our evaluation decodes both
drafts on them (the target's greedy outputs and our acceptance); with the judge ``vllm`` (the default) vLLM
then serves both exports in one process on the same prompts, and its acceptance decides, as it is what users
get (its outputs must equal the target's greedy ones, as the served check requires). The judge ``ours``
decides by our speculative decoding (no serving environment needed).

A candidate is promoted when its traffic acceptance beats the current one's by the margin (relative) and its
regression acceptance is not lower by more than the tolerance (relative) than the current version's, nor than
the first version's (as first measured): a fall within the tolerance at each promotion cannot add up.
"""

from __future__ import annotations

import shutil
from pathlib import Path

JUDGES = ("vllm", "ours")
SETS = ("traffic", "regression")


def judge_folder(run_dir: Path, draft: Path, folder: Path) -> Path:
    """A run-shaped folder for evaluating ``draft`` with the candidate run's configuration (same target,
    same cached data): config.yaml without init_from, and a copy of the draft's final/."""
    from omegaconf import OmegaConf

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    config = OmegaConf.load(run_dir / "config.yaml")
    config.draft.init_from = None
    OmegaConf.save(config, folder / "config.yaml")
    shutil.copytree(draft / "final", folder / "final")
    return folder


def measure(folders: dict[str, Path], prompt_files: dict[str, Path], settings: dict, log=print) -> dict:
    """Acceptance per set for each folder: {name: {"traffic": x, "regression": y, "measured_by": ...}}."""
    from ..evaluate.finished import evaluate_finished_run

    overrides = {"prompt_sets": list(SETS), "prompt_files": {k: str(v) for k, v in prompt_files.items()},
                 "num_prompts": settings["eval_prompts"], "max_new_tokens": settings["max_new_tokens"],
                 "num_draft_tokens": settings["k"], "baseline_prompts": 0, "heldout_batches": 2, "serve": None}
    results = {}
    for name, folder in folders.items():
        log(f"[adapt] our evaluation of the {name} draft on held-out traffic and the regression set")
        ours = evaluate_finished_run(folder, overrides, log=lambda message: None)
        results[name] = {s: ours["sets"][s]["mean_acceptance_length"] for s in SETS} | {"measured_by": "ours"}
    if settings["judge"] == "vllm":
        from ..evaluate.served import serve

        log("[adapt] vLLM serves both drafts on the same prompts")
        served = serve(list(folders.values()), k=settings["k"], log=log)
        for name, report in zip(folders, served):
            results[name] = {**{s: report["sets"][s]["mean_acceptance_length"] for s in SETS},
                             "measured_by": "vllm", "ours": {s: results[name][s] for s in SETS},
                             "outputs_equal_greedy": f"{report['outputs_equal_our_greedy']}/"
                                                     f"{report['outputs_compared']}"}
    return results


def decide(current: dict, candidate: dict, margin: float, tolerance: float,
           first: float | None = None) -> tuple[bool, str]:
    """Whether to promote, and why, in one line. ``first``: the first version's regression acceptance (None:
    the current version is the first)."""
    first = current["regression"] if first is None else first
    gain = candidate["traffic"] / current["traffic"] - 1
    drop = 1 - candidate["regression"] / current["regression"]
    drop_from_first = 1 - candidate["regression"] / first
    said = (f"held-out traffic {current['traffic']:.3f} -> {candidate['traffic']:.3f} ({gain:+.1%}, margin "
            f"{margin:+.1%}), regression {current['regression']:.3f} -> {candidate['regression']:.3f} "
            f"({-drop:+.1%}; {-drop_from_first:+.1%} from the first version's {first:.3f}; tolerance {tolerance:.1%})")
    if gain < margin:
        return False, "not enough gain on held-out traffic: " + said
    if drop > tolerance:
        return False, "the regression set fell: " + said
    if drop_from_first > tolerance:
        return False, "the regression set fell below the first version's: " + said
    return True, said
