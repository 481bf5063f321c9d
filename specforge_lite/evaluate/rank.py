"""Rank drafts by what a server measures: python -m specforge_lite.evaluate.rank RUN [RUN ...] [--out DIR]

The runs are drafts for one target evaluated on the same prompts: typically several draft kinds trained
from one capture (``python -m specforge_lite.offline dump`` once, then ``train.py data.source=offline``
per kind). Each is served by vLLM (``evaluate/served.py``, with ``--speed``: a timed pass after the
acceptance pass, and the target served alone on the same prompts), and the table ranks them by vLLM's
acceptance length, beside vLLM's speed-up over the target alone and the training tokens per second of
the run. Runs whose vllm_eval.json already holds the timed figures at the same k are not served again
(``--serve-again`` serves them anyway). A draft this machine's vLLM cannot serve (DSpark, DFlash 2 on its CPU build)
is ranked by our own evaluation's figures, and the table says which measured each row. Writes rank.md and
rank.json to ``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from ..methods import DEFAULT, draft_method
from ..errors import said_in_one_line
from ..formats import PROVENANCE_KEY
from ..files import read_json
from ..records import read_metrics
from .served import eval_inputs, serve, unservable_here


# what the table reads of each file, and how each is written again
OURS_KEYS = ("num_draft_tokens", "mean_acceptance_length", "per_position_acceptance", "speedup_vs_target_alone",
             "tokens_per_s")
SERVED_KEYS = ("num_draft_tokens", "mean_acceptance_length", "per_position_acceptance", "speedup_vs_target_alone",
               "served_tokens_per_s", "outputs_equal_our_greedy", "outputs_compared")


def how_to_evaluate_again(run: Path) -> str:
    return f"evaluate the run again (python -m specforge_lite.evaluate --run-dir {run})"


def how_to_serve_again(run: Path) -> str:
    return f"serve it again (python -m specforge_lite.evaluate.rank --serve-again {run} ...)"


def method(run: Path) -> str:
    """The draft's kind (its method's label, from the spec its export records): what distinguishes it."""
    config = read_json(run / "final" / "config.json", f"export the run again (python -m specforge_lite.export "
                       f"--run-dir {run} --out {run / 'final'}), then {how_to_evaluate_again(run)}")
    if PROVENANCE_KEY not in config:
        raise ValueError(f"{run / 'final'} was not written by specforge_lite (no {PROVENANCE_KEY!r} block): rank "
                         "runs trained here, or export the run again (python -m specforge_lite.export)")
    spec = config[PROVENANCE_KEY]["spec"]
    return draft_method(spec.get("method") or DEFAULT).label(spec)


def training_tokens_per_s(run: Path) -> float | None:
    """The median training tokens/s logged by the run (metrics.jsonl)."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return None
    speeds = [row.get("tokens_per_s") for row in read_metrics(path)]
    speeds = [s for s in speeds if s]
    return statistics.median(speeds) if speeds else None


def check_comparable(runs: list[Path]) -> None:
    """Ranked drafts must have been evaluated for one target on the same prompt sets and prompts."""
    fields = ("target", "prompt_sets", "prompts", "max_new_tokens")
    seen = {run: {f: eval_inputs(run, ("target", "prompts")).get(f) for f in fields} for run in runs}
    first = runs[0]
    for run in runs[1:]:
        differ = [f for f in fields if seen[run][f] != seen[first][f]]
        if differ:
            raise ValueError(f"{run} was evaluated with another {' and '.join(differ)} than {first}: a ranking "
                             "compares drafts on the same prompts (evaluate both with the same data and eval settings)")


def check_same_measure(rows: list[dict]) -> None:
    """Acceptance at one k and in one dtype only: a longer chain or other rounding is another measure."""
    for key in ("k", "dtype"):
        values = {r["run"]: r[key] for r in rows}
        if len(set(values.values())) > 1:
            raise ValueError(f"the runs were served at different {key} ({values}): acceptance lengths measured at "
                             f"different {key} cannot be ranked together; rank them with one --k (and evaluate them "
                             "in one model.dtype)")


def our_measure(run: Path, ours: dict) -> dict:
    """A run this machine's vLLM cannot serve (served.unservable_here), in the served report's terms from our own
    evaluation (eval.json): our speculative decoding's acceptance, per position, and measured speed-up over
    the target alone (no server's outputs to compare with the target's greedy ones: that column says n/a)."""
    if not ours:
        raise FileNotFoundError(f"{run / 'eval.json'} is missing: vLLM cannot serve this draft here, so it is "
                                f"ranked by our evaluation; run python -m specforge_lite.evaluate --run-dir {run}")
    return {"num_draft_tokens": ours["num_draft_tokens"], "dtype": eval_inputs(run).get("dtype", "float32"),
            "mean_acceptance_length": ours["mean_acceptance_length"],
            "per_position_acceptance": ours["per_position_acceptance"],
            "speedup_vs_target_alone": ours["speedup_vs_target_alone"], "served_tokens_per_s": ours["tokens_per_s"]}


def rank(runs: list[Path], k: int | None = None, serve_again: bool = False, log=print) -> list[dict]:
    runs = [Path(r) for r in runs]
    check_comparable(runs)

    def timed(run: Path) -> bool:
        path = run / "vllm_eval.json"
        served = read_json(path, f"{how_to_serve_again(run)}, or delete it") if path.is_file() else {}
        return "speedup_vs_target_alone" in served and (k is None or served.get("num_draft_tokens") == k)

    ours_only = {r: reason for r in runs if (reason := unservable_here(r))}
    missing = [r for r in runs if r not in ours_only and (serve_again or not timed(r))]
    if missing:
        serve(missing, k, speed=True, log=log)
    for run, reason in ours_only.items():
        log(f"[rank] {run}: ranked by our own evaluation: {reason}")
    rows = []
    for run in runs:
        keys = OURS_KEYS if run in ours_only else ()  # (else only its calibration and fastest k, where recorded)
        ours = read_json(run / "eval.json", how_to_evaluate_again(run), keys) if (run / "eval.json").is_file() else {}
        served = (our_measure(run, ours) if run in ours_only else
                  read_json(run / "vllm_eval.json", how_to_serve_again(run), SERVED_KEYS))
        rows.append({"run": str(run), "method": method(run), "k": served["num_draft_tokens"],
                     "measured_by": "ours" if run in ours_only else "vLLM",
                     # our evaluation's: the draft's calibration at position 1, and the k it estimates fastest
                     "calibration_error": ((ours.get("calibration") or {}).get("ece_per_position") or [None])[0],
                     "best_k": ours.get("best_k"),
                     "dtype": served.get("dtype", "float32"),
                     "acceptance_length": served["mean_acceptance_length"],
                     "per_position": served["per_position_acceptance"],
                     "speedup_vs_target_alone": served["speedup_vs_target_alone"],
                     "served_tokens_per_s": served["served_tokens_per_s"],
                     "training_tokens_per_s": training_tokens_per_s(run),
                     "outputs_equal_greedy": "n/a" if run in ours_only else
                     f"{served['outputs_equal_our_greedy']}/{served['outputs_compared']}"})
    check_same_measure(rows)
    rows.sort(key=lambda r: -r["acceptance_length"])
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| rank | run | draft | acceptance length (k) | per position | speed-up vs target alone | measured by | "
             "calibration error (position 1) | fastest k (estimated) | training tokens/s | outputs equal to greedy |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        train = f"{r['training_tokens_per_s']:.0f}" if r["training_tokens_per_s"] else "n/a"
        ece = f"{r['calibration_error']:.3f}" if r.get("calibration_error") is not None else "n/a"
        speedup = f"{r['speedup_vs_target_alone']:.2f}x" if r["speedup_vs_target_alone"] is not None else "n/a"
        lines.append(f"| {i} | {r['run']} | {r['method']} | {r['acceptance_length']:.3f} ({r['k']}) | "
                     f"{', '.join(f'{x:.2f}' for x in r['per_position'])} | {speedup} | "
                     f"{r.get('measured_by', 'vLLM')} | "
                     f"{ece} | {r.get('best_k') or 'n/a'} | {train} | {r['outputs_equal_greedy']} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m specforge_lite.evaluate.rank", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", type=Path, help="finished, evaluated runs for one target")
    p.add_argument("--k", type=int, default=None, help="draft tokens per step (default: the k our evaluation used)")
    p.add_argument("--serve-again", action="store_true", help="serve every run, even one already timed")
    p.add_argument("--out", type=Path, default=None, help="write rank.md and rank.json here")
    a = p.parse_args(argv)
    with said_in_one_line():
        rows = rank(a.run_dirs, a.k, a.serve_again)
    table = markdown(rows)
    print(table)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "rank.md").write_text(table + "\n")
        (a.out / "rank.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
