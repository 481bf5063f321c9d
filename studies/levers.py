"""What raises served acceptance per unit of compute: each lever against the embedded default, judged by vLLM.

    python -m studies levers [--minutes 10] [--only warm_start,eagle31] [--seed N] [--out DIR]
    python -m studies levers --warm-start-study [--study-steps 100,400] [--out DIR]

Every candidate is the embedded default (``python train.py``: SmolLM2-135M-Instruct, the cpu_20min recipe)
with one lever changed, trained online by train.py for the same wall time of its training loop
(``trainer.max_minutes``; the schedule runs over the budget), then all of them are served by vLLM at k=3 on
the same prompts (8 per set: held-out chit-chat and five kinds the default never trains on), evaluated
once by our evaluation for the target's greedy outputs. The table gives vLLM's acceptance per set, the
general prompts and the chat pooled, and each lever's ratio to the default from the same run.

``--warm-start-study``: draft.init_layers_from_target against the default at equal steps (100 and 400),
with the teacher-forced step-0 accuracy of both drafts before any training.

A bench run is resumable: candidates already trained or served in ``--out`` are reused.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from .served_recipes import (ADAMW_6E4, MUON_MATRICES_2E3, SPECULATORS_HEAD, SPECULATORS_MUON, SPECULATORS_SCHEDULE,
                             SPECULATORS_TTT, Candidate, evaluate_reference, serve_candidates, served_row,
                             share_prompts, train_candidate, write_report)

# Each lever as train.py overrides on top of the default; the data levers regenerate their own answers
# (cached afterwards), so their first run spends that time before training.
LEVERS = [
    Candidate("default", [], "the embedded default (EAGLE 3.1, 1 layer, TTT 4, soft CE, draft vocabulary 8192, "
                             "Muon with AdamW: matrices at 2e-3, the rest at 1e-3)"),
    Candidate("adamw", ADAMW_6E4, "AdamW at 6e-4 over every weight, in place of the default's Muon"),
    Candidate("eagle3_plain", ["draft.norm_before_fc=false", "draft.norm_output=false"],
              "EAGLE3 without the EAGLE 3.1 norms (the default keeps them)"),
    Candidate("warm_start", ["draft.init_layers_from_target=true"],
              "the draft's layer starts as the target's layer after the top aux id"),
    Candidate("eagle31", ["draft.norm_before_fc=true", "draft.norm_output=true"],
              "EAGLE 3.1 norms (the default's own: the same run as default; eagle3_plain measures them)"),
    Candidate("eagle31_ttt3_vocab4k", ["draft.norm_before_fc=true", "draft.norm_output=true", "draft.ttt_length=3",
                                       "draft.draft_vocab_size=4096"],
              "the three levers that won on chat together: EAGLE 3.1 norms, TTT 3, draft vocabulary 4096"),
    Candidate("muon", ["trainer.optimizer=muon", "trainer.lr=6e-4", "trainer.muon_lr=null"],
              "speculators' optimizer: Muon over the layers' matrices, AdamW over the rest, the same peak lr"),
    Candidate("muon_lr1e3", SPECULATORS_MUON, "speculators' optimizer at its learning rate 1e-3 (both groups)"),
    *[Candidate(f"muon_lr1e3_ns{n}", [*SPECULATORS_MUON, f"trainer.muon_ns_steps={n}"],
                f"muon_lr1e3 with {n} Newton-Schulz iterations a step, not 5 (a cheaper step on a CPU)")
      for n in (2, 3)],
    Candidate("muon_mlr2e3", MUON_MATRICES_2E3,
              "muon_lr1e3 with the matrices' learning rate at 2e-3"),
    Candidate("muon_mlr2e3_ns3", [*MUON_MATRICES_2E3, "trainer.muon_ns_steps=3"],
              "muon_mlr2e3 with 3 Newton-Schulz iterations a step"),
    Candidate("frozen_head", SPECULATORS_HEAD, "the lm_head kept as the target's rows (speculators')"),
    Candidate("speculators_like", ["draft.norm_before_fc=true", "draft.norm_output=true", *SPECULATORS_TTT,
                                   *SPECULATORS_HEAD],
              "speculators' recipe in ours: EAGLE 3.1 norms, TTT 3 without step decay, frozen lm_head (AdamW kept)"),
    Candidate("eagle31_2layers", ["draft.norm_before_fc=true", "draft.norm_output=true", "draft.num_layers=2"],
              "EAGLE 3.1 norms and two layers"),
    Candidate("linear_schedule", SPECULATORS_SCHEDULE,
              "the learning rate decays linearly (speculators'), not by cosine"),
    Candidate("loss_acceptance", ["draft.loss=acceptance"], "-log expected acceptance (LK)"),
    Candidate("loss_tv", ["draft.loss=tv"], "total variation"),
    Candidate("ttt3", ["draft.ttt_length=3"], "TTT unroll of 3 (the served k)"),
    Candidate("ttt7", ["draft.ttt_length=7"], "TTT unroll of 7 (EAGLE3's)"),
    Candidate("vocab4k", ["draft.draft_vocab_size=4096"], "draft vocabulary of 4096 tokens"),
    Candidate("vocab16k", ["draft.draft_vocab_size=16384"], "draft vocabulary of 16384 tokens"),
    Candidate("mix_1to1", ["data.mix=[{source:builtin_chitchat,weight:1},{source:self_generated,weight:1}]"],
              "chit-chat : self-generated requests 1 : 1 (the default 2 : 1)"),
    Candidate("chitchat_only", ["data=chitchat"], "the bundled chit-chat only (its openings, answered by the target)"),
    Candidate("multi_turn", ["data.generation.max_turns=3"], "up to three answers per conversation regenerated"),
    Candidate("last_turn_loss", ["data.generation.max_turns=3", "data.loss_turns=last"],
              "three turns regenerated, loss on the last answer only"),
]


def _study_candidates(step_counts: list[int]) -> list[Candidate]:
    return [Candidate(f"{name}_{steps}", ([] if name == "default" else ["draft.init_layers_from_target=true"]) +
                      [f"trainer.max_steps={steps}", "trainer.max_minutes=null"])
            for steps in step_counts for name in ("default", "warm_start")]


def step0_accuracy(log=print) -> dict:
    """Teacher-forced accuracy per TTT step on the default's held-out conversations, before any training,
    of the default's freshly built draft and of the warm-started one (same seed)."""
    from specforge_lite.compose import load_config
    from specforge_lite.evaluate.heldout import heldout_accuracy
    from specforge_lite.data import pad_id
    from specforge_lite.run import Run

    out = {}
    for name, overrides in (("default", []), ("warm_start", ["draft.init_layers_from_target=true"])):
        run = Run.online(load_config(["tracker=none", *overrides]), log=lambda m: None)
        held = heldout_accuracy(run.objective, run.teacher, run.build_draft(), run.data.heldout,
                                pad_id(run.tokenizer), 16)
        out[name] = held["acc"]
        log(f"[bench] {name}: held-out accuracy per TTT step before training {[round(a, 3) for a in held['acc']]}")
    return out


def saved_step0_accuracy(saved: Path) -> dict:
    """``step0_accuracy``, or what an earlier run of this bench saved of it (a resumed bench reuses it)."""
    if saved.is_file():
        earlier = json.loads(saved.read_text()).get("step0_accuracy_before_training")
        if earlier:
            return earlier
    return step0_accuracy()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m studies levers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="training-loop wall time of every candidate")
    p.add_argument("--only", default=None, help="comma-separated lever names (the default is always included)")
    p.add_argument("--warm-start-study", action="store_true", help="warm start vs default at equal steps")
    p.add_argument("--study-steps", default="100,400", help="the warm-start study's step counts (comma-separated)")
    p.add_argument("--seed", type=int, default=0,
                   help="trainer.seed of every candidate (draft initialisation and data order): a repeat of a "
                        "lever's win under another seed")
    p.add_argument("--prompts", type=int, default=8, help="prompts per prompt set")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("runs/bench/levers"))
    p.add_argument("--prompts-from", type=Path, default=None, metavar="RUN",
                   help="serve on the prompts and greedy outputs of an earlier bench's reference run (its "
                        "eval_inputs.json, same target and settings) instead of evaluating the default again")
    a = p.parse_args(argv)

    out = a.out / ("warm_start_study" if a.warm_start_study else f"minutes_{a.minutes:g}")
    if a.seed or a.prompts != 8:
        out = out.with_name(f"{out.name}_seed{a.seed}_prompts{a.prompts}")
    out.mkdir(parents=True, exist_ok=True)
    saved = out / "extra.json"
    extra = {}
    if a.warm_start_study:
        steps = [int(x) for x in a.study_steps.split(",")]
        chosen = _study_candidates(steps)
        extra["step0_accuracy_before_training"] = saved_step0_accuracy(saved)
        budget = f"equal steps ({', '.join(map(str, steps))})"
    else:
        wanted = set(a.only.split(",")) | {"default"} if a.only else None
        unknown = (wanted or set()) - {c.name for c in LEVERS}
        if unknown:
            raise SystemExit(f"error: unknown lever(s) {sorted(unknown)}; levers: {[c.name for c in LEVERS]}")
        chosen = [c for c in LEVERS if wanted is None or c.name in wanted]
        if any(c.name == "warm_start" for c in chosen):
            extra["step0_accuracy_before_training"] = saved_step0_accuracy(saved)
        # max_steps only caps: the time budget ends every candidate's training
        chosen = [Candidate(c.name, [*c.overrides, f"trainer.max_minutes={a.minutes}", "trainer.max_steps=100000",
                                     "trainer.save_every=0", f"trainer.seed={a.seed}"], c.note) for c in chosen]
        budget = f"equal training wall time ({a.minutes:g} min of the training loop each)"
    runs = {}
    for c in chosen:
        runs[c.name] = out / c.name
        train_candidate(runs[c.name], c.overrides)
    reference = runs[chosen[0].name]
    if a.prompts_from is not None and not (reference / "eval_inputs.json").is_file():
        shutil.copyfile(a.prompts_from / "eval_inputs.json", reference / "eval_inputs.json")
    evaluate_reference(reference, a.k, a.prompts, a.max_new_tokens)
    share_prompts(reference, list(runs.values()))
    serve_candidates(list(runs.values()), a.k)
    rows = [{**served_row(c.name, runs[c.name]), "overrides": c.overrides, "note": c.note} for c in chosen]
    saved.write_text(json.dumps(extra, indent=2) + "\n")
    from specforge_lite.device import describe_cpu

    machine = describe_cpu()
    preamble = (f"SmolLM2-135M-Instruct, the embedded default with one lever changed each; {budget}; served by vLLM "
                f"at k={a.k}, {a.prompts} prompts per set, {a.max_new_tokens} new tokens, greedy; {machine}. "
                "general = every set but the held-out chit-chat, pooled by drafts; chat = the held-out chit-chat. "
                "Regenerate: python -m studies levers "
                + (f"--warm-start-study --study-steps {a.study_steps}" if a.warm_start_study
                   else f"--minutes {a.minutes:g}" + (f" --only {a.only}" if a.only else ""))
                + (f" --seed {a.seed}" if a.seed else "") + (f" --prompts {a.prompts}" if a.prompts != 8 else ""))
    if extra:
        preamble += "\n\nTeacher-forced held-out accuracy per TTT step before training: " + json.dumps(
            {k: [round(x, 3) for x in v] for k, v in extra["step0_accuracy_before_training"].items()})
    print(write_report(out, "Levers against the embedded default, served by vLLM", rows, chosen[0].name, preamble))


if __name__ == "__main__":
    main()
