"""The small-target recipe card: every draft method trained for the same wall time on a real small target,
its acceptance per prompt set at k = 1, 3 and 5.

    python -m studies recipe_card [--targets smollm2_135m gemma3_270m] [--minutes 8]
        [--out runs/bench/recipe_card] [--card docs/recipe_card.md]

Per target: EAGLE3, EAGLE 3.1 (norms before fc and on the output), P-EAGLE (mask slots, one forward) trained
with a TTT unroll of 6 (enough for k = 5), each served at k = 1, 3 and 5; DFlash trained once per k (its block
is its input, so its size is the served k). Every draft is the target's embedded-default recipe (the same
data, vocabulary and optimizer) with the method's settings, trained online by train.py for ``--minutes`` of
its training loop. The prompts (8 per set) and the target's greedy outputs come from our evaluation of the
first draft; vLLM serves every export on them where vLLM can serve the target's drafts (SmolLM2), and our
own speculative decoding measures them where it cannot (Gemma 3: vLLM 0.32's Gemma3ForCausalLM exposes no
aux hidden states, so no EAGLE3-family draft can run on it there; ours equals vLLM's acceptance to the third
decimal on the targets vLLM serves, tests/test_serving.py). The card (markdown) holds the table and the
exact commands.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from .served_recipes import (CHAT_SET, ROOT, Candidate, evaluate_reference, pooled, serve_candidates,
                             share_prompts, train_candidate)

KS = (1, 3, 5)
CHAIN_TTT = 6  # an unroll one longer than the largest served k
REFERENCE_K = 3  # the first draft's evaluation, whose prompts and greedy outputs every draft is measured on
TARGETS = {
    "smollm2_135m": {"overrides": [], "served_by": "vllm", "ks": KS},
    # a base model: no instruction-following to write its own requests, so its data is the chit-chat openings.
    # Measured by our evaluation after training (not inside it), without timing the target alone, at k=3 only:
    # each of its evaluations (7 sets, 262k vocabulary) costs 6-7 minutes on a 2-core CPU.
    "gemma3_270m": {"overrides": ["model=gemma3_270m", "data=chitchat", "eval.enabled=false",
                                  "eval.baseline_prompts=0"], "served_by": "ours", "ks": (3,)},
}


def candidates(ks: tuple[int, ...] = KS) -> list[tuple[Candidate, tuple[int, ...]]]:
    """(the draft, the k it is served at), for the served ``ks``."""
    from specforge_lite.methods import METHODS

    chain = [f"draft.ttt_length={CHAIN_TTT}"]
    plain = ["draft.norm_before_fc=false", "draft.norm_output=false"]  # (EAGLE 3.1's norms are EAGLE3's default)
    out = [(Candidate("EAGLE3", [*chain, *plain]), ks),
           (Candidate("EAGLE 3.1", [*chain, "draft.norm_before_fc=true", "draft.norm_output=true"]), ks),
           (Candidate("P-EAGLE", [*chain, *plain, "draft.parallel_drafting=true"]), ks)]
    for method, name in (("dflash", "DFlash"), ("dspark", "DSpark")):  # a block per k: its size is its input
        block = METHODS[method].steps_settings  # (the block that proposes k tokens)
        out += [(Candidate(f"{name} (block {k})", [f"draft.method={method}",
                                                   *(f"draft.{key}={value}" for key, value in block(k).items()),
                                                   f"eval.num_draft_tokens={k}"]), (k,)) for k in ks]
    return out


def folder(name: str) -> str:
    return name.lower().replace(" ", "_").replace("(", "").replace(")", "").replace(".", "")


def measure_ours(run: Path, k: int, prompts: int, max_new_tokens: int) -> dict:
    """Our speculative decoding of one export at k (python -m specforge_lite.evaluate), as vllm_eval.json's sets."""
    path = run / f"ours_k{k}.json"
    if not path.is_file():
        cmd = [sys.executable, "-m", "specforge_lite.evaluate", "--run-dir", str(run), "--k", str(k),
               "--num-prompts", str(prompts), "--max-new-tokens", str(max_new_tokens)]
        with open(run / "eval.log", "a") as out:
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT).returncode != 0:
                raise SystemExit(f"error: evaluating {run} at k={k} failed; its log: {run / 'eval.log'}")
        shutil.copyfile(run / "eval.json", path)
    return {name: {**s, "drafts": s["rounds"]} for name, s in json.loads(path.read_text())["sets"].items()}


def served_sets(run: Path, k: int, how: str, prompts: int, max_new_tokens: int) -> tuple[dict, str]:
    """(the acceptance per prompt set, who measured it): vLLM where the section is served and vLLM can serve
    the draft here, else our speculative decoding (a draft vLLM's CPU build cannot run: DSpark)."""
    from specforge_lite.evaluate.served import unservable_here

    if how == "ours" or unservable_here(run):
        return measure_ours(run, k, prompts, max_new_tokens), "ours"
    path = run / f"vllm_k{k}.json"
    if not path.is_file():  # (a rerun, e.g. for another target's section, serves nothing twice)
        serve_candidates([run], k)
        shutil.copyfile(run / "vllm_eval.json", path)
    return json.loads(path.read_text())["sets"], "vllm"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m studies recipe_card", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    p.add_argument("--minutes", type=float, default=8.0, help="training-loop wall time of every draft")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--out", type=Path, default=Path("runs/bench/recipe_card"))
    p.add_argument("--card", type=Path, default=ROOT / "docs" / "recipe_card.md")
    a = p.parse_args(argv)
    sections = []
    for target in a.targets:
        spec = TARGETS[target]
        out = a.out / target
        rows = []
        drafts = candidates(spec["ks"])
        for cand, ks in drafts:
            run = out / folder(cand.name)
            overrides = [*spec["overrides"], *cand.overrides, f"trainer.max_minutes={a.minutes}",
                         "trainer.max_steps=100000", "trainer.save_every=0"]
            train_candidate(run, overrides)
            if cand is drafts[0][0]:
                evaluate_reference(run, REFERENCE_K, a.prompts, a.max_new_tokens)
                if spec["served_by"] == "ours" and not (run / f"ours_k{REFERENCE_K}.json").is_file():
                    shutil.copyfile(run / "eval.json", run / f"ours_k{REFERENCE_K}.json")  # (that is its measurement)
            share_prompts(out / folder(drafts[0][0].name), [run])
            for k in ks:
                sets, measured_by = served_sets(run, k, spec["served_by"], a.prompts, a.max_new_tokens)
                general = [n for n in sets if n != CHAT_SET]
                rows.append({"method": cand.name, "k": k, "measured_by": measured_by,
                             "sets": {n: s["mean_acceptance_length"] for n, s in sets.items()},
                             "general": pooled(sets, general)["mean_acceptance_length"],
                             "chat": pooled(sets, [CHAT_SET])["mean_acceptance_length"],
                             "command": "python train.py " + " ".join(overrides)})
        sections.append((target, spec, rows))
        (out / "card.json").write_text(json.dumps(rows, indent=2) + "\n")
    write_card(a, sections)


NOTES = ("<!-- edition notes: kept when the card is regenerated -->", "<!-- end of edition notes -->")


def edition_notes(card: Path) -> list[str]:
    """The hand-written notes on an edition (what the figures mean, the machine's caveats) in the current card,
    between the ``NOTES`` markers, so that regenerating the tables keeps them."""
    text = card.read_text() if card.is_file() else ""
    if NOTES[0] not in text or NOTES[1] not in text:
        return [NOTES[0], "", NOTES[1], ""]
    return [NOTES[0] + text.split(NOTES[0], 1)[1].split(NOTES[1], 1)[0] + NOTES[1], ""]


def write_card(a, sections) -> None:
    from specforge_lite.device import describe_cpu

    notes = edition_notes(a.card)
    lines = ["# Recipe card: draft methods on small real targets", "",
             "No public draft exists for these targets; these are the reference figures. Regenerated by "
             f"`python -m studies recipe_card --minutes {a.minutes:g}` (every draft trained for "
             f"{a.minutes:g} minutes of its training loop, online, the target's embedded-default recipe with the "
             f"method's settings; {a.prompts} prompts per set, {a.max_new_tokens} new tokens, greedy). Machine: "
             f"{describe_cpu()}.",
             "", "Acceptance length = 1 + accepted draft tokens per verification round. general = every prompt set "
             "but the held-out chit-chat, pooled; chat = the held-out chit-chat.", "", *notes]
    for target, spec, rows in sections:
        judge = ("served by vLLM 0.32 (CPU build)" if spec["served_by"] == "vllm" else
                 "measured by our speculative decoding: vLLM 0.32 cannot serve an EAGLE3-family draft for Gemma 3 "
                 "(its Gemma3ForCausalLM exposes no aux hidden states)")
        sets = list(dict.fromkeys(n for r in rows for n in r["sets"]))
        lines += [f"## {target}", "", f"Acceptance {judge}.", "",
                  "| method | k | " + " | ".join(sets) + " | general | chat |", "|" + "---|" * (len(sets) + 4)]
        ours = spec["served_by"] == "vllm" and any(r.get("measured_by") == "ours" for r in rows)
        for r in rows:
            mark = " (ours)" if spec["served_by"] == "vllm" and r.get("measured_by") == "ours" else ""
            lines.append(f"| {r['method']}{mark} | {r['k']} | " + " | ".join(f"{r['sets'].get(n, float('nan')):.3f}"
                                                                       for n in sets)
                         + f" | {r['general']:.3f} | {r['chat']:.3f} |")
        if ours:
            lines += ["", "(ours): measured by our speculative decoding on the same prompts: vLLM 0.32's CPU build "
                      "cannot serve it (DSpark runs in vLLM's V2 model runner only, which needs Triton's CPU backend). "
                      "Our greedy outputs are the target's own in our bf16 forward, not vLLM's."]
        lines += ["", "Commands (each run's export in its `final/`):", "", "```bash"]
        lines += list(dict.fromkeys(r["command"] for r in rows)) + ["```", ""]
    a.card.parent.mkdir(parents=True, exist_ok=True)
    a.card.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
