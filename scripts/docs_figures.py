"""Every measured figure of the README and the docs, written from the result files in docs/results/.

A figure sits in a page between ``<!-- figure:NAME -->`` and ``<!-- /figure -->``. NAME is a result file
(docs/results/NAME.json), optionally followed by ``/VIEW``: a view below that writes prose or a table from that
file; without one, the file is a table (``columns``, ``rows``) written as one. A result file names the machine
and the date of what it holds, so each figure is stated with them, and two pages quoting one file cannot
disagree.

    python scripts/docs_figures.py            # rewrite the figures in place
    python scripts/docs_figures.py --check    # exit 1 naming each page whose figures differ (tests/test_docs.py)

To change a figure: edit or add its result file (a benchmark's own output where it writes one), then run this.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(<!-- figure:([\w./-]+) -->\n)(.*?)(<!-- /figure -->)", re.S)


def pct(ours: float, theirs: float) -> str:
    """Ours against theirs as a signed percentage, one decimal."""
    return f"{(ours / theirs - 1) * 100:+.1f}%"


def table(columns: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def plain_table(data: dict) -> str:
    """A result file that is a table: its caption (machine, date, what else it says), then the table."""
    caption = ", ".join(str(data[k]) for k in ("machine", "date") if k in data)
    caption += f"; {data['note']}" if "note" in data else ""
    return (f"*{caption[:1].upper()}{caption[1:]}.*\n\n" if caption else "") + table(data["columns"], data["rows"])


def default_run(data: dict) -> str:
    """The README's quality table: the embedded default, end to end, its export served by vLLM."""
    rows = [[f"{r['machine']}, {r['date']}", r["precision"], r["recipe"], f"{r['steps']} in {r['train_s']} s",
             f"{r['end_to_end_min']} min", f"**{r['general']} / {r['chat']}**", r["greedy_equal"]]
            for r in data["runs"]]
    return table(["machine, date", "precision", "draft, training", "steps, training time", "end to end",
                  "served general / held-out chat", "outputs equal to greedy"], rows)


def default_run_sentence(data: dict) -> str:
    r = data["runs"][0]
    return (f"On a {r['machine']} ({r['date']}, {r['precision']}) `python train.py` ran in "
            f"{r['end_to_end_min']} minutes end to end ({r['steps']} training steps in {r['train_s']} s), "
            f"and vLLM served its draft at an acceptance length of **{r['general']}** on general assistant "
            f"prompts and **{r['chat']}** on held-out chit-chat (k=3).")


def parity_summary(data: dict) -> str:
    """Ours against the peers' own recipes: the newest per-step figure, the equal-time one, SpecForge's."""
    steps, time, sf = data["steps_600_p32"], data["time_4min_p16"], data["steps_400_p32_specforge"]
    ours_t, spec_t = time["ours"], time["speculators"]
    return (f"At {steps['steps']} steps of the default's recipe ({steps['seeds']} seeds, {steps['prompts']} "
            f"prompts per set) our default leads speculators 0.9.0's own recipe by "
            f"**{pct(steps['ours']['general'], steps['speculators']['general'])} on general prompts** and "
            f"{pct(steps['ours']['chat'], steps['speculators']['chat'])} on held-out chat; for "
            f"{time['minutes']} minutes of training it leads by {pct(ours_t['general'], spec_t['general'])} and "
            f"{pct(ours_t['chat'], spec_t['chat'])}; SpecForge 0.2.0's defaults reach "
            f"{sf['specforge']['general'] / sf['ours']['general']:.2f}x and "
            f"{sf['specforge']['chat'] / sf['ours']['chat']:.2f}x of ours ({sf['steps']} steps, seed {sf['seed']}). "
            f"Every draft "
            f"served by vLLM; {data['machine']}, {data['date']}.")


def parity_seeds(data: dict) -> str:
    """The per-seed table at the default's steps, with the means over the seeds."""
    part = data["steps_600_p16"]
    sets = part["sets"]
    rows = [[s, who, *(f"{v:.3f}" for v in vals)] for s, per in enumerate(part["seeds"]) for who, vals in per.items()]
    for who in part["seeds"][0]:
        mean = [sum(per[who][i] for per in part["seeds"]) / len(part["seeds"]) for i in range(len(sets))]
        rows.append([f"mean ({len(part['seeds'])})", who, *(f"{v:.3f}" for v in mean)])
    return (f"*{data['machine']}, {data['date']}; {part['steps']} steps, {part['prompts']} prompts per set.*\n\n"
            + table(["seed", "trainer", *sets], rows))


def gpu_scale(data: dict) -> str:
    """A gpu_scale result as the study prints it (``python -m studies gpu_scale --table``): tokens/s and peak of
    each way and peer per length, ours against the faster peer, the bundled conversations' lengths one per
    micro-batch against token-budget micro-batches, and where one profiled step's time went."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from studies.gpu_scale import tables_markdown

    caption = (f"*{data['device']}, {data['date']}; torch {data['torch']}, transformers {data['transformers']}; "
               f"`{data['command']}`.*")
    return f"{caption}\n\n{tables_markdown(data)}"


def adapt_table(data: dict) -> str:
    """The adaptation demonstration: each set served before and after the promoted candidate."""
    rows = [[name, f"{before:.3f}", f"**{after:.3f}**", f"{after / before:.2f}x"]
            for name, (before, after) in data["sets"].items()]
    return f"*{data['machine']}, {data['date']}; {data['served']}.*\n\n" + table(
        ["set", "before (v0001, served)", "after (v0002, served)", "ratio"], rows)


def adapt_sentence(data: dict) -> str:
    (b1, a1), (b2, a2) = data["sets"].values()
    return (f"one adaptation of the default draft took served acceptance on held-out requests from {b1:.2f} to "
            f"{a1:.2f}, and on the regression set from {b2:.2f} to {a2:.2f} ({data['machine']}, {data['date']})")


VIEWS = {"table": plain_table, "readme": default_run, "sentence": default_run_sentence,
         "summary": parity_summary, "seeds": parity_seeds, "gpu_scale": gpu_scale,
         "before_after": adapt_table, "promoted": adapt_sentence}


def render(name: str) -> str:
    file, _, view = name.partition("/")
    path = RESULTS / f"{file}.json"
    if not path.is_file():
        raise SystemExit(f"error: a page names the figure {name!r}, but {path.relative_to(ROOT)} does not exist")
    if view not in ("", *VIEWS):
        raise SystemExit(f"error: the figure {name!r} names no view of {', '.join(VIEWS)}")
    return VIEWS[view or "table"](json.loads(path.read_text())).rstrip("\n") + "\n"


def rewrite(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(m.group(2)) + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page differs")
    args = parser.parse_args(argv)
    stale = []
    for page in PAGES:
        text = page.read_text()
        new = rewrite(text)
        if new != text:
            stale.append(str(page.relative_to(ROOT)))
            if not args.check:
                page.write_text(new)
    if stale and args.check:
        print(f"error: figures differ from docs/results in {', '.join(stale)}: run python scripts/docs_figures.py",
              file=sys.stderr)
        return 1
    for page in stale:
        print(f"rewrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
