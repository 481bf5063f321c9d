"""Compare the runs of a sweep: python -m specforge_lite.evaluate.sweep SWEEP_DIR [--out DIR]

Reads every run under SWEEP_DIR (a folder with metrics.jsonl; ``python train.py --multirun ...`` makes
one per job under multirun/<time>/<n>/) and prints a Markdown table: the overrides that distinguish the
run, final loss, accuracy per TTT step, the simulated acceptance length (1 + sum_{k<K} prod_{i<=k} acc_i,
K the served k) from training and from held-out data, the measured acceptance length (speculative
decoding, eval.json) and training tokens/s. Writes report.md, report.json and, with matplotlib
installed, report.png (accuracy per step per run; simulated vs measured acceptance) next to them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..draft.objective import sim_accepted_drafts
from ..errors import said_in_one_line
from ..records import read_metrics


def _overrides(run: Path) -> list[str]:
    path = run / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    import yaml

    return [o for o in yaml.safe_load(path.read_text()) or [] if not o.startswith(("output_dir=", "hydra."))]


def collect(sweep: Path) -> list[dict]:
    rows = []
    for metrics in sorted(sweep.rglob("metrics.jsonl")):
        run = metrics.parent
        lines = read_metrics(metrics)
        if not lines:
            continue
        last = lines[-1]
        accs = [last[k] for k in sorted((k for k in last if k.startswith("acc_")), key=lambda k: int(k[4:]))]
        ev = json.loads((run / "eval.json").read_text()) if (run / "eval.json").is_file() else {}
        speeds = [m["tokens_per_s"] for m in lines if "tokens_per_s" in m]
        # simulated acceptance lengths, comparable with the measured one: the bonus token plus the accepted
        # drafts of the first k steps only (k: the served draft length)
        k = ev.get("num_draft_tokens", len(accs))
        held = ev.get("heldout_acc")
        rows.append({"run": str(run.relative_to(sweep)) or ".", "overrides": _overrides(run), "step": last["step"],
                     "loss": last["loss"], "acc": accs, "sim_accept_len": 1 + sim_accepted_drafts(accs[:k]),
                     "heldout_sim_accept_len": 1 + sim_accepted_drafts(held[:k]) if held else None,
                     "mean_acceptance_length": ev.get("mean_acceptance_length"),
                     "tokens_per_s": sum(speeds) / len(speeds) if speeds else None})
    # show what distinguishes each run: the overrides all runs share are left out
    shared = set.intersection(*(set(r["overrides"]) for r in rows)) if len(rows) > 1 else set()
    for r in rows:
        r["overrides"] = " ".join(o for o in r["overrides"] if o not in shared) or r["run"]
    return rows


def _fmt(x, digits=3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(rows: list[dict]) -> str:
    out = ["| run | overrides | step | loss | acc per step | sim accept (train) | sim accept (held-out) | "
           "measured accept | tokens/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: -(r["mean_acceptance_length"] or 0)):
        out.append(f"| {r['run']} | {r['overrides']} | {r['step']} | {_fmt(r['loss'])} | "
                   f"{' '.join(f'{a:.2f}' for a in r['acc'])} | {_fmt(r['sim_accept_len'])} | "
                   f"{_fmt(r['heldout_sim_accept_len'])} | {_fmt(r['mean_acceptance_length'])} | "
                   f"{_fmt(r['tokens_per_s'], 0)} |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        left.plot(range(len(r["acc"])), r["acc"], marker="o", label=r["overrides"][:40])
    left.set(xlabel="TTT step", ylabel="final training accuracy", title="accuracy per step")
    left.legend(fontsize=7)
    pts = [(r["heldout_sim_accept_len"], r["mean_acceptance_length"]) for r in rows
           if r["heldout_sim_accept_len"] is not None and r["mean_acceptance_length"] is not None]
    if pts:
        right.scatter([p[0] for p in pts], [p[1] for p in pts])
        lo, hi = 1.0, max(max(p) for p in pts) + 0.1
        right.plot([lo, hi], [lo, hi], linestyle="--", color="gray")
    right.set(xlabel="simulated acceptance length (held-out)", ylabel="measured acceptance length",
              title="cheap estimate vs speculative decoding")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m specforge_lite.evaluate.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep_dir", type=Path)
    p.add_argument("--out", type=Path, default=None, help="where to write report.* (default: SWEEP_DIR)")
    a = p.parse_args(argv)
    with said_in_one_line():
        rows = collect(a.sweep_dir)
    if not rows:
        raise SystemExit(f"error: no runs (metrics.jsonl) under {a.sweep_dir}")
    out = a.out or a.sweep_dir
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows)
    print(table)
    (out / "report.md").write_text(table + "\n")
    (out / "report.json").write_text(json.dumps(rows, indent=1) + "\n")
    png = f", {out / 'report.png'}" if plot(rows, out / "report.png") else " (pip install matplotlib for report.png)"
    print(f"\nwrote {out / 'report.md'}, {out / 'report.json'}" + png)


if __name__ == "__main__":
    main()
