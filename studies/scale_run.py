"""A finished run as one row of a result table (docs/results/*.json, written into the docs by
scripts/docs_figures.py): how many answers the target wrote and how fast, the training, the loss, and our
evaluation per prompt set. scripts/gpu_recipe.sh writes one for the scale recipe on real weights.

    python -m studies scale_run RUN_DIR --out FILE.json [--machine "one NVIDIA H200, ..."] [--wall-s S]
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

COLUMNS = ["run", "end to end", "answers written by the target", "training", "loss", "held-out acc_0",
           "ours at k=3: all"]


def _read(path: Path) -> dict:
    if not path.is_file():
        raise SystemExit(f"error: {path} does not exist: point RUN_DIR at a finished run (its [done] line names it)")
    return json.loads(path.read_text())


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return [r for r in rows if "loss" in r]


def answers_cell(stats: dict) -> str:
    """The answers this run's regeneration wrote, its rate (what a user multiplies by their data size) and rounds."""
    regen = stats.get("regeneration") or {}
    if "answers" not in regen:
        return "none written here (cached or not regenerated)"
    rounds = f" in {regen['rounds']} rounds" if regen.get("rounds") else ""
    return (f"{regen['answers']} for {regen['regenerated']} conversations{rounds}: {regen['answers_per_s']:.1f} "
            f"answers/s, {regen.get('generated_tokens_per_s', 0):.0f} tokens/s")


def training_cell(metrics: list[dict]) -> str:
    if not metrics:
        return "no steps"
    last = metrics[-1]
    epochs = f", {last['epoch']:.2f} epochs" if "epoch" in last else ""
    return (f"{last['step']} steps{epochs}, {last['tokens_seen']} tokens in {last['elapsed_s']:.0f} s "
            f"({last['tokens_seen'] / last['elapsed_s']:.0f} tok/s)")


def row(run_dir: Path, name: str, wall_s: float | None) -> tuple[list, list[str]]:
    """The run's row and the names of its prompt sets (one column each, in the evaluation's order)."""
    stats, evaluation, metrics = _read(run_dir / "data_stats.json"), _read(run_dir / "eval.json"), _metrics(run_dir)
    sets = list(evaluation.get("sets") or {})
    loss = f"{metrics[0]['loss']:.2f} -> {metrics[-1]['loss']:.2f}" if metrics else "-"
    acc = evaluation.get("heldout_acc") or []
    cells = [name, f"{wall_s:.0f} s" if wall_s else "-", answers_cell(stats), training_cell(metrics), loss,
             f"{acc[0]:.3f}" if acc else "-", f"{evaluation['mean_acceptance_length']:.3f}"]
    cells += [f"{evaluation['sets'][s]['mean_acceptance_length']:.3f}" for s in sets]
    return cells, sets


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", default="scale recipe")
    parser.add_argument("--machine", default="")
    parser.add_argument("--note", default="")
    parser.add_argument("--wall-s", type=float, default=None, help="the whole command's seconds, set-up included")
    args = parser.parse_args(argv)
    cells, sets = row(args.run_dir, args.name, args.wall_s)
    result = {"machine": args.machine or "unnamed machine", "date": datetime.date.today().isoformat(),
              **({"note": args.note} if args.note else {}), "columns": COLUMNS + sets, "rows": [cells]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"| {' | '.join(result['columns'])} |\n| {' | '.join(map(str, cells))} |")


if __name__ == "__main__":
    main()
