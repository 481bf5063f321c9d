"""eval.md and eval.png beside eval.json: the per-prompt-set results as a table and a plot."""

from __future__ import annotations

from pathlib import Path


def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def eval_markdown(result: dict) -> str:
    how = result.get("drafting", "chain")
    if how == "tree":
        how += f" (depth {result['num_draft_tokens']}, top-{result['tree_topk']}, budget {result['tree_budget']})"
    else:
        how += f" (k={result['num_draft_tokens']})"
    lines = [f"# Speculative decoding: {how}, temperature {result['temperature']}", "",
             "| prompt set | prompts | mean acceptance length | acceptance per position | tokens/s | target alone "
             "tokens/s | measured speed-up | estimated speed-up |",
             "|---|---|---|---|---|---|---|---|"]
    rows = list(result.get("sets", {}).items()) + [("all", result)]
    for name, r in rows:
        per_pos = " / ".join(_f(a) for a in r.get("per_position_acceptance", []))
        lines.append(f"| {name} | {r['prompts']} | {_f(r['mean_acceptance_length'], 3)} | {per_pos} | "
                     f"{_f(r['tokens_per_s'], 1)} | {_f(r['target_alone_tokens_per_s'], 1)} | "
                     f"{_f(r['speedup_vs_target_alone'])}x | {_f(r.get('estimated_speedup'))}x |")
    lines += _by_context_table(rows)
    costs = result.get("step_costs")
    if costs:
        lines += ["", f"Step costs (median): target decode {costs['target_decode_s'] * 1e3:.1f} ms, verification of "
                      f"{costs['verify_tokens']} tokens {costs['target_verify_s'] * 1e3:.1f} ms, one drafting round "
                      f"{costs['draft_round_s'] * 1e3:.1f} ms."]
    if result.get("heldout_acc"):
        lines += ["", "Held-out teacher-forced accuracy per TTT step: "
                  + ", ".join(_f(a, 3) for a in result["heldout_acc"])]
    return "\n".join(lines) + "\n"


def _by_context_table(rows: list[tuple[str, dict]]) -> list[str]:
    """Mean acceptance length (rounds) per context-length bucket, one line per prompt set."""
    buckets = list(rows[-1][1].get("by_context_length", {}))
    if not buckets:
        return []
    lines = ["", "Mean acceptance length by context length (tokens before the drafted position; rounds in brackets):",
             "", "| prompt set | " + " | ".join(buckets) + " |", "|---" * (len(buckets) + 1) + "|"]
    for name, r in rows:
        by = r.get("by_context_length", {})
        cells = [f"{_f(by[b]['mean_acceptance_length'], 3)} ({by[b]['rounds']})" if b in by else "-" for b in buckets]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def plot_eval(result: dict, path: Path) -> Path | None:
    """Acceptance per position (the share of rounds that accept a draft token there) per prompt set, the
    mean acceptance length per set, and the mean acceptance length per context-length bucket."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sets = result.get("sets", {})
    fig, (left, right, by_length) = plt.subplots(1, 3, figsize=(16, 4))
    for name, r in sets.items():
        per_pos = r.get("per_position_acceptance", [])
        left.plot(range(1, len(per_pos) + 1), per_pos, marker="o", label=name)
    left.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.02), title="acceptance per position")
    left.set_xticks(range(1, result["num_draft_tokens"] + 1))
    left.legend()
    names = list(sets)
    right.bar(names, [sets[n]["mean_acceptance_length"] for n in names])
    right.set(ylabel="mean acceptance length", title="per prompt set")
    right.tick_params(axis="x", rotation=20)
    buckets = list(result.get("by_context_length", {}))
    for name, r in [*sets.items(), ("all", result)]:
        means = [r.get("by_context_length", {}).get(b, {}).get("mean_acceptance_length") for b in buckets]
        by_length.plot(buckets, [float("nan") if m is None else m for m in means], marker="o", label=name,
                       **({"color": "black", "linewidth": 2} if name == "all" else {}))
    by_length.set(xlabel="context length (tokens)", ylabel="mean acceptance length", title="by context length")
    by_length.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_eval_report(run_dir: Path, result: dict) -> None:
    run_dir = Path(run_dir)
    (run_dir / "eval.md").write_text(eval_markdown(result))
    plot_eval(result, run_dir / "eval.png")
