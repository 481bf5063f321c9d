"""Our recipe against SpecForge's and speculators' own, on identical inputs, judged by vLLM.

    python -m studies recipe_parity [--steps 400] [--minutes 10] [--out DIR]
        [--budgets steps time] [--peers specforge speculators] [--variants muon] [--seed N]

1. The embedded default's data (SmolLM2-135M-Instruct, the cpu_20min recipe: its regenerated answers and
   draft vocabulary) is captured once into a float32 hidden-state store (``offline dump``).
2. The batches our own offline run reads from it (same seed, micro-batch 2) are written out as a schedule of
   store sample indices, so every trainer sees the same token ids, loss masks, aux states and teacher.
3. Three drafts train on them: ours (train.py data.source=offline: our default recipe), SpecForge 0.2.0's
   EAGLE3 draft, loss, optimizer and schedule with its training script's defaults, and speculators
   0.9.0's (its CLI defaults: EAGLE 3.1 norms, kl_div, TTT 3, Muon), the peers' model and loss code run
   by their own packages in their own venv (``scripts/setup_peers.sh``; drivers in ``studies/peers/``),
   each exported by the peer's own save code.
4. Once at equal optimizer steps (``--steps``) and once at equal wall time (``--minutes``: ours through
   trainer.max_minutes, the peers with the steps that fit the budget after a timing of their own step).
5. Our evaluation of our draft fixes the prompts (8 per set) and the target's greedy outputs; vLLM serves all
   six exports on them; the table compares acceptance per set, general and chat.

``--variants`` adds our recipe with one change at each budget (``VARIANTS``: e.g. muon, speculators'
optimizer in our trainer); ``--budgets`` and ``--peers`` keep a part of the comparison.

What the peers' drivers had to adapt to run on a CPU is printed by them and listed in the report.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from .served_recipes import (ADAMW_6E4, MUON_MATRICES_2E3, ROOT, SPECULATORS_HEAD, SPECULATORS_MUON,
                             SPECULATORS_RESIDUAL, SPECULATORS_SCHEDULE, SPECULATORS_TTT, evaluate_reference,
                             serve_candidates, served_row, share_prompts, train_candidate, write_report)

PEERS = ("specforge", "speculators")
# our recipe with one change, as train.py overrides
VARIANTS = {"adamw": ADAMW_6E4,  # (AdamW in place of the default's Muon)
            "muon": ["trainer.optimizer=muon", "trainer.lr=6e-4", "trainer.muon_lr=null"],
            "muon_lr1e3": SPECULATORS_MUON,  # (speculators' learning rate, both groups)
            "muon_lr1e3_ns2": [*SPECULATORS_MUON, "trainer.muon_ns_steps=2"],  # (its cheaper step on a CPU)
            "muon_lr1e3_ns3": [*SPECULATORS_MUON, "trainer.muon_ns_steps=3"],
            "muon_mlr2e3": MUON_MATRICES_2E3,  # (the matrices' step twice speculators': the default's)
            "muon_mlr3e3": ["trainer.optimizer=muon", "trainer.lr=1e-3", "trainer.muon_lr=3e-3"],
            "lr1e3": ["trainer.optimizer=adamw", "trainer.lr=1e-3"],  # (the same learning rate with our AdamW)
            "lr2e3": ["trainer.optimizer=adamw", "trainer.lr=2e-3"],  # (is what Muon buys a larger step? no)
            # the rest of speculators' recipe in ours, piece by piece (served_recipes.py)
            "ttt3_nodecay": SPECULATORS_TTT,
            "speculators_like": [*SPECULATORS_TTT, *SPECULATORS_HEAD],
            "speculators_like_muon": [*SPECULATORS_TTT, *SPECULATORS_HEAD, *SPECULATORS_MUON],
            "norm_before_residual": SPECULATORS_RESIDUAL,
            "fp32": ["trainer.precision=fp32"],  # (the peers' drivers train in fp32)
            "linear_schedule": SPECULATORS_SCHEDULE,
            # all of the above but our schedule's shape: speculators' clipping, AdamW moments and decay, warmup
            "speculators_all": [*SPECULATORS_TTT, *SPECULATORS_HEAD, *SPECULATORS_MUON, *SPECULATORS_RESIDUAL,
                                "trainer.grad_clip=1.0", "trainer.betas=[0.9,0.999]", "trainer.weight_decay=0.01",
                                "trainer.warmup_ratio=0.01"]}
VARIANTS["speculators_all_linear"] = [*VARIANTS["speculators_all"], *SPECULATORS_SCHEDULE]  # (and its schedule)


def make_store(out: Path, log=print) -> Path:
    store = out / "store"
    if (store / "manifest.json").is_file():
        return store
    log(f"[bench] capturing the default's data into {store} (float32)")
    cmd = [sys.executable, "-m", "specforge_lite.offline", "dump", f"store={store}", "store.dtype=float32"]
    with open(out / "dump.log", "a") as log_file:
        if subprocess.run(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT).returncode != 0:
            raise SystemExit(f"error: the store dump failed; its log: {out / 'dump.log'}")
    return store


def write_schedule(store: Path, steps: int, path: Path, seed: int = 0) -> Path:
    """The store sample indices of each of our offline run's first ``steps`` micro-batches (at ``seed``)."""
    if path.is_file() and len(json.loads(path.read_text())["batches"]) >= steps:
        return path
    from specforge_lite.compose import load_config
    from specforge_lite.offline import store_run

    run = store_run(load_config(["tracker=none", "data.source=offline", f"data.store={store}",
                                 f"trainer.seed={seed}"]), log=lambda m: None)
    stream = run.batches()
    batches = [next(stream).inputs["store_index"].tolist() for _ in range(steps)]
    path.write_text(json.dumps({"batches": batches}))
    return path


def peer_python() -> str:
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "setup_peers.sh")], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: the peers' venv could not be built:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return proc.stdout.strip().splitlines()[-1]


def train_peer(peer: str, python: str, store: Path, schedule: Path, run_dir: Path, budget: list[str],
               seed: int = 0, log=print) -> None:
    """One peer's driver (its own model, loss, optimizer and save code) on the schedule; resumable."""
    if (run_dir / "final" / "config.json").is_file():
        return
    from specforge_lite.compose import load_config
    from specforge_lite.targets.acquire import resolve_model_dir

    target = resolve_model_dir(load_config(["tracker=none"]).model)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    cmd = [python, str(ROOT / "studies" / "peers" / f"{peer}_train.py"), "--store", str(store), "--schedule",
           str(schedule), "--target", str(target), "--out", str(run_dir / "final"), "--metrics",
           str(run_dir / "metrics.jsonl"), "--threads", "2", "--seed", str(seed), *budget]
    log(f"[bench] training {run_dir.name} with {peer}'s own code ({' '.join(budget)})")
    t0 = time.perf_counter()
    with open(run_dir / "train.log", "a") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if code != 0:
        raise SystemExit(f"error: {peer}'s driver failed (exit {code}); its log: {run_dir / 'train.log'}")
    (run_dir / "bench_train.json").write_text(json.dumps({"seconds": time.perf_counter() - t0, "command": cmd}))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m studies recipe_parity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=400, help="optimizer steps of the equal-steps comparison")
    p.add_argument("--minutes", type=float, default=5.0, help="training wall time of the equal-time comparison")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("runs/bench/recipe_parity"))
    p.add_argument("--budgets", nargs="+", choices=("steps", "time"), default=["steps", "time"])
    p.add_argument("--peers", nargs="*", choices=PEERS, default=list(PEERS))
    p.add_argument("--variants", nargs="*", choices=sorted(VARIANTS), default=[])
    p.add_argument("--seed", type=int, default=0, help="every trainer's seed and the batch order (another seed: "
                   "runs named *_seed{N}, served on the seed-0 reference's prompts when it is there)")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    store = make_store(a.out)
    suffix = f"_seed{a.seed}" if a.seed else ""
    # enough batches for the equal-time runs too (a peer step is never faster than 0.05 s here)
    schedule = write_schedule(store, max(a.steps, int(a.minutes * 60 / 0.05)), a.out / f"schedule{suffix}.json",
                              a.seed)
    python = peer_python() if a.peers else None
    from_store = ["data.source=offline", f"data.store={store}", f"trainer.seed={a.seed}"]
    # (equal steps: no time cap, so the runs are the same whatever else the machine is doing)
    budgets = {"steps": ([f"trainer.max_steps={a.steps}", "trainer.max_minutes=null"], ["--steps", str(a.steps)]),
               "time": ([f"trainer.max_minutes={a.minutes}", "trainer.max_steps=100000", "trainer.save_every=0"],
                        ["--minutes", str(a.minutes)])}
    runs: dict[str, Path] = {}

    def run_dir(name: str) -> Path:  # (this seed's folder of a candidate, in the order the table lists them)
        runs[name + suffix] = a.out / (name + suffix)
        return runs[name + suffix]

    for budget in a.budgets:
        ours, theirs = budgets[budget]
        for name, change in [("ours", []), *((f"ours_{v}", VARIANTS[v]) for v in a.variants)]:
            train_candidate(run_dir(f"{name}_{budget}"), [*from_store, *ours, *change])
        for peer in a.peers:
            train_peer(peer, python, store, schedule, run_dir(f"{peer}_{budget}"), theirs, a.seed)
    if "time" in a.budgets:
        # The peers' drivers train in fp32 (their CPU adaptation); ours trains at trainer.precision=auto: bf16
        # autocast on a CPU with native bf16. The same budget in fp32 separates recipe from precision there.
        train_candidate(run_dir("ours_time_fp32"), [*from_store, *budgets["time"][0], "trainer.precision=fp32"])
    reference = runs[f"ours_{a.budgets[0]}{suffix}"]
    # every seed is served on one set of prompts (the seed-0 reference's), so seeds differ by their drafts only
    prompts_from = a.out / f"ours_{a.budgets[0]}"
    if not (prompts_from / "eval_inputs.json").is_file():
        prompts_from = reference
    evaluate_reference(prompts_from, a.k, a.prompts, a.max_new_tokens)
    share_prompts(prompts_from, list(runs.values()))
    serve_candidates(list(runs.values()), a.k)
    rows = [served_row(name, run) for name, run in runs.items()]
    from specforge_lite.device import describe_cpu

    machine = (f"{describe_cpu()}; our runs at trainer.precision=auto, the peers' drivers in fp32 (their CPU "
               "adaptation), and ours_time_fp32 is our equal-time run in fp32")
    command = (f"--steps {a.steps} --minutes {a.minutes:g} --prompts {a.prompts} --budgets {' '.join(a.budgets)} "
               f"--peers {' '.join(a.peers)}" + (f" --variants {' '.join(a.variants)}" if a.variants else "")
               + (f" --seed {a.seed}" if a.seed else ""))
    preamble = (f"One capture of the embedded default's data (float32 store, {store}); the same batches in the same "
                f"order for every trainer; equal steps: {a.steps} optimizer steps each; equal time: {a.minutes:g} "
                f"minutes of training each. Served by vLLM at k={a.k} on {a.prompts} prompts per set. Ratios are to "
                f"{reference.name}. Regenerate: python -m studies recipe_parity {command}. What each "
                "peer driver adapted to run on CPU is in its train.log. " + machine + ".")
    print(write_report(a.out, "Recipe parity: ours, SpecForge 0.2.0, speculators 0.9.0 on identical inputs", rows,
                       reference.name, preamble))


if __name__ == "__main__":
    main()
