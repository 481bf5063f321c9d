"""Tokens/s of one EAGLE3 draft training step on CPU: ours against SpecForge's and speculators' own code.

    python -m studies step_speed [--peers specforge speculators] [--shape smollm2|llama3_8b]
        [--seq-lens 512,2048] [--ttt 7] [--draft-vocab 32000] [--repeats 3]

One step = the TTT unroll, its loss and the backward, fp32, on one row of T tokens with random aux states and
teacher logits (the target is not run) for a draft of ``--shape`` (specforge_lite/bench/shapes.py): ours with
the defaults, each peer's with its own EAGLE3 draft, TTT loop and loss (studies/peers/NAME_step.py), on the same
shapes and as many threads. Medians of ``--repeats`` steps after a warm-up, side by side, and our ratio to the
faster peer. A peer named alone runs in the throwaway venv scripts/setup_peers.sh builds; NAME=PYTHON runs it
by another interpreter. How our step's memory grows with T: ``python -m specforge_lite.bench seq_scaling``.
"""

from __future__ import annotations

import argparse
import json
import subprocess

import torch

from specforge_lite.bench.shapes import SHAPES, synthetic_draft, synthetic_row
from specforge_lite.bench.timing import measure

from .gpu_scale import peer_driver
from .recipe_parity import peer_python


def peer_interpreters(items: list[str]) -> dict[str, str]:
    """``--peers``: NAME (the venv of scripts/setup_peers.sh, built once) or NAME=PYTHON, each name's driver
    checked before anything runs."""
    peers = dict(item.split("=", 1) if "=" in item else (item, "") for item in items)
    for name in peers:
        peer_driver(name)
    if not all(peers.values()):
        venv = peer_python()
        peers = {name: python or venv for name, python in peers.items()}
    return peers


def peer_step(name: str, python: str, shape: dict, T: int, a) -> dict:
    """The peer's driver at one length: its JSON line (tokens_per_s, version, notes), or {"failed": why}."""
    cmd = [python, str(peer_driver(name)), "--seq-len", str(T), "--ttt", str(a.ttt),
           "--draft-vocab", str(a.draft_vocab), "--repeats", str(a.repeats), "--shape", json.dumps(shape),
           "--threads", str(torch.get_num_threads())]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"failed": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m studies step_speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", nargs="+", default=["specforge", "speculators"], help="NAME or NAME=PYTHON each")
    p.add_argument("--shape", default="smollm2", help=" | ".join(SHAPES))
    p.add_argument("--seq-lens", default="512,2048")
    p.add_argument("--ttt", type=int, default=7, help="TTT unroll steps")
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=3, help="timed steps per cell (median)")
    a = p.parse_args(argv)
    peers = peer_interpreters(a.peers)

    from specforge_lite.methods.eagle3.objective import TTTObjective
    from specforge_lite.methods.eagle3.settings import Eagle3Settings

    shape = SHAPES[a.shape]
    draft = synthetic_draft(shape, Eagle3Settings(), a.draft_vocab)
    print(f"One draft training step (forward + loss + backward) of {a.shape} shape, TTT {a.ttt}, draft vocab "
          f"{a.draft_vocab}, fp32, median of {a.repeats} after a warm-up:")
    print("| T | ours tok/s | " + " | ".join(f"{n} tok/s" for n in peers) + " | ours / faster peer |")
    print("|---" * (len(peers) + 3) + "|")
    notes = {}
    for T in [int(x) for x in a.seq_lens.split(",")]:
        inputs, objective = synthetic_row(shape, T, a.draft_vocab), TTTObjective(a.ttt)

        def step():
            objective.unroll(draft, inputs).loss.backward()
            draft.zero_grad(set_to_none=True)

        ours = T / measure(step, torch.device("cpu"), a.repeats)["seconds"]
        theirs = {name: peer_step(name, python, shape, T, a) for name, python in peers.items()}
        best = max((r["tokens_per_s"] for r in theirs.values() if "tokens_per_s" in r), default=float("nan"))
        print(f"| {T} | {ours:.0f} | " + " | ".join(f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else "failed"
                                                  for r in theirs.values()) + f" | {ours / best:.2f}x |", flush=True)
        notes = {name: f"failed: {r['failed']}" if "failed" in r else f"{r.get('version', '?')}: {r.get('notes', '')}"
                 for name, r in theirs.items()}
    for name, note in notes.items():  # (the longest row's)
        print(f"  {name} {note}")


if __name__ == "__main__":
    main()
