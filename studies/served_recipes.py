"""Drafts trained side by side and judged by vLLM: what the recipe benchmarks share (levers, recipe_parity,
recipe_card).

Each candidate is a folder with ``final/`` (an export) and how long its training took. One of them (the
reference) is evaluated by our evaluation, which records the prompts and the target's greedy outputs
(``eval_inputs.json``); every candidate is then served by vLLM on exactly those prompts
(``evaluate/served.py``, one vLLM process for all of them), and the table is read from vLLM's own
counters: acceptance length per prompt set, "general" (every set but the held-out chit-chat) and "chat"
(the held-out chit-chat), pooled by drafts, and each candidate's ratio to the reference.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from specforge_lite.records import read_metrics

ROOT = Path(__file__).resolve().parents[1]  # the checkout: train.py, docs/, scripts/

# The held-out chit-chat (the training data's own held-out conversations) against prompts of kinds the
# default never trains on: the two figures the embedded default is judged by.
CHAT_SET = "heldout"
EVAL_SETS = ("heldout", "assistant", "mtbench", "gsm8k", "summarization", "humaneval")

# speculators 0.9.0's recipe, piece by piece, as train.py overrides (the levers and the recipe parity try them
# in ours): its TTT (3 steps, no decay over them), its lm_head frozen at the target's rows, its optimizer and
# learning rate, its draft layer (the first layer's residual after hidden_norm), its schedule's linear decay
SPECULATORS_TTT = ["draft.ttt_length=3", "draft.step_loss_decay=1.0"]
SPECULATORS_HEAD = ["draft.freeze_lm_head=true"]
SPECULATORS_MUON = ["trainer.optimizer=muon", "trainer.lr=1e-3", "trainer.muon_lr=null"]  # (1e-3, both groups)
# the embedded default's optimizer (speculators' with the matrices' step at 2e-3), and AdamW in its place
MUON_MATRICES_2E3 = ["trainer.optimizer=muon", "trainer.lr=1e-3", "trainer.muon_lr=2e-3"]
ADAMW_6E4 = ["trainer.optimizer=adamw", "trainer.lr=6e-4"]
SPECULATORS_RESIDUAL = ["draft.norm_before_residual=true"]
SPECULATORS_SCHEDULE = ["trainer.schedule=linear"]


@dataclass
class Candidate:
    name: str
    overrides: list[str] = field(default_factory=list)  # train.py overrides (a train.py candidate)
    note: str = ""


def train_candidate(run_dir: Path, overrides: list[str], log=print) -> float:
    """train.py in a fresh process, as a user runs it (no evaluation: the bench serves every candidate on the
    reference's prompts). Returns its wall seconds; a candidate already trained (its export and timing on
    disk) is not trained again, so an interrupted bench resumes where it stopped."""
    timing = run_dir / "bench_train.json"
    if timing.is_file() and (run_dir / "final" / "config.json").is_file():
        return json.loads(timing.read_text())["seconds"]
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(ROOT / "train.py"), *overrides, f"output_dir={run_dir}", "tracker=none",
           "eval.enabled=false", "trainer.progress_bar=false"]
    log(f"[bench] training {run_dir.name}: {' '.join(overrides) or '(the default)'}")
    t0 = time.perf_counter()
    with open(run_dir / "train.log", "a") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    seconds = time.perf_counter() - t0
    if code != 0:
        raise SystemExit(f"error: training {run_dir.name} failed (exit {code}); its log: {run_dir / 'train.log'}")
    timing.write_text(json.dumps({"seconds": seconds, "overrides": overrides}))
    return seconds


def training_time(run_dir: Path) -> dict:
    """Steps and seconds of the training loop itself (metrics.jsonl), and of the whole process."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    timing = run_dir / "bench_train.json"
    process = json.loads(timing.read_text())["seconds"] if timing.is_file() else None
    tokens = rows[-1].get("tokens_seen") if rows else None
    return {"steps": rows[-1]["step"] if rows else 0, "process_s": process, "tokens_seen": tokens,
            "loop_s": rows[-1].get("elapsed_s") if rows else None}


def evaluate_reference(run_dir: Path, k: int, num_prompts: int, max_new_tokens: int, sets=EVAL_SETS,
                       log=print) -> None:
    """Our evaluation of one candidate (python -m specforge_lite.evaluate): its eval.json, and the prompts and
    the target's greedy outputs every candidate is then served on (eval_inputs.json)."""
    if (run_dir / "eval_inputs.json").is_file():
        return
    cmd = [sys.executable, "-m", "specforge_lite.evaluate", "--run-dir", str(run_dir), "--k", str(k),
           "--num-prompts", str(num_prompts), "--max-new-tokens", str(max_new_tokens), "--prompt-sets", *sets]
    log(f"[bench] our evaluation of {run_dir.name} (the prompts every candidate is served on)")
    with open(run_dir / "eval.log", "a") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if code != 0:
        raise SystemExit(f"error: evaluating {run_dir.name} failed (exit {code}); its log: {run_dir / 'eval.log'}")


def share_prompts(reference: Path, runs: list[Path]) -> None:
    """Every candidate is served on the reference's prompts and compared with the same greedy outputs."""
    for run in runs:
        if run != reference:
            shutil.copyfile(reference / "eval_inputs.json", run / "eval_inputs.json")


def serve_candidates(runs: list[Path], k: int | None = None, log=print) -> None:
    """vLLM serves every candidate not yet served at this k (one process); a greedy mismatch fails loudly."""
    from specforge_lite.evaluate.served import serve

    def served(run: Path) -> bool:
        path = run / "vllm_eval.json"
        return path.is_file() and json.loads(path.read_text()).get("num_draft_tokens") == (k or _inputs_k(run))

    missing = [r for r in runs if not served(r)]
    if missing:
        serve(missing, k, log=log)


def _inputs_k(run: Path) -> int:
    return json.loads((run / "eval_inputs.json").read_text())["num_draft_tokens"]


def pooled(sets: dict, names) -> dict:
    """Acceptance length and per-position acceptance over several prompt sets, weighted by their drafts."""
    chosen = [sets[n] for n in names if n in sets and sets[n].get("drafts")]
    drafts = sum(s["drafts"] for s in chosen)
    if not drafts:
        return {"mean_acceptance_length": float("nan"), "per_position_acceptance": [], "drafts": 0}
    accepted = sum((s["mean_acceptance_length"] - 1) * s["drafts"] for s in chosen)
    width = max(len(s["per_position_acceptance"]) for s in chosen)
    per_pos = [sum(s["per_position_acceptance"][i] * s["drafts"] for s in chosen
                   if i < len(s["per_position_acceptance"])) / drafts for i in range(width)]
    return {"mean_acceptance_length": 1 + accepted / drafts, "per_position_acceptance": per_pos, "drafts": drafts}


def served_row(name: str, run: Path) -> dict:
    """One candidate's vLLM figures: per set, general (all but the held-out chat), chat, all pooled."""
    served = json.loads((run / "vllm_eval.json").read_text())
    if "error" in served:
        return {"name": name, "run": str(run), "error": served["error"]}
    sets = served["sets"]
    general = [n for n in sets if n != CHAT_SET]
    return {"name": name, "run": str(run), "k": served["num_draft_tokens"],
            "sets": {n: s["mean_acceptance_length"] for n, s in sets.items()},
            "general": pooled(sets, general), "chat": pooled(sets, [CHAT_SET]), "all": pooled(sets, list(sets)),
            "outputs_equal_greedy": f"{served['outputs_equal_our_greedy']}/{served['outputs_compared']}",
            **training_time(run)}


def markdown(rows: list[dict], reference: str) -> str:
    """The table: acceptance per set and pooled, first-position acceptance, and each row's ratio to the
    reference's general and chat acceptance (from the same bench run)."""
    ok = [r for r in rows if "error" not in r]
    sets = list(dict.fromkeys(n for r in ok for n in r["sets"]))
    ref = next((r for r in ok if r["name"] == reference), None)
    head = (["candidate", *sets, "general", "chat", "all", "1st pos. (general)", "general / ref", "chat / ref",
             "steps", "train s", "greedy-equal"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | vLLM could not serve it: {r['error'][:120]} |")
            continue
        g, c = r["general"]["mean_acceptance_length"], r["chat"]["mean_acceptance_length"]
        ratio = (lambda x, key: f"{x / ref[key]['mean_acceptance_length']:.3f}x") if ref else (lambda x, key: "-")
        first = r["general"]["per_position_acceptance"][:1]
        seconds = r["loop_s"] or r["process_s"]
        lines.append("| " + " | ".join([r["name"], *(f"{r['sets'].get(n, float('nan')):.3f}" for n in sets),
                                        f"{g:.3f}", f"{c:.3f}", f"{r['all']['mean_acceptance_length']:.3f}",
                                        f"{first[0]:.2f}" if first else "-", ratio(g, "general"), ratio(c, "chat"),
                                        str(r["steps"]), f"{seconds:.0f}" if seconds else "-",
                                        r["outputs_equal_greedy"]]) + " |")
    return "\n".join(lines)


def write_report(out: Path, title: str, rows: list[dict], reference: str, preamble: str) -> str:
    text = f"# {title}\n\n{preamble}\n\n{markdown(rows, reference)}\n"
    (out / "report.md").write_text(text)
    (out / "report.json").write_text(json.dumps(rows, indent=2) + "\n")
    return text
