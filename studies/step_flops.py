"""The work of one draft training step, ours against SpecForge's and speculators' own code, at a real target's shape.

    python -m studies step_flops [--target llama3_8b] [--seq-len 256] [--out docs/results/step_flops.json]

Each step (EAGLE3 draft, draft vocabulary 32k, TTT 7, micro-batch 1: forward, loss and backward, as
``studies gpu_scale`` times them, each teacher as there) runs once on CPU in fp32 under torch's FlopCounterMode:
ours (blockwise attention, the fused lm_head + loss) here, the peers' by their drivers (studies/peers,
``--count-flops``) in their own venv (scripts/setup_peers.sh). The count is of matrix products; at 256 tokens
the attention's share is a fraction of a percent, so the figure is the per-token work besides the attention,
the same at every length (the attention's own grows with the row).
Divided into a GPU's tokens/s it gives the FLOP rate each code reached there: where the steps' work is equal, a
gap in tokens/s is a gap in how well the work runs, not in how much there is.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from specforge_lite.bench.real_shape import TARGETS, new_draft
from specforge_lite.bench.step_ways import replace_objective
from specforge_lite.device import describe_cpu

from .gpu_scale import peer_driver, peer_shape
from .recipe_parity import peer_python

PEERS = ("specforge", "speculators")
# SpecForge's trainer hands its step the target's final hidden state on a GPU (its head then makes the teacher's
# logits inside the step), where its CPU default takes ready logits: counted as gpu_scale times it
TEACHER_AS_ON_A_GPU = {"specforge": ["--teacher", "hidden_state"]}
# what differs in each step's work
WHAT = {"ours": "lm_head trained; the teacher's logits come from the capture",
        "specforge": "lm_head trained; its frozen head makes the teacher's logits inside the step",
        "speculators": "lm_head frozen; its frozen head makes the teacher's logits inside the step"}


def our_step(target: str, T: int, draft_vocab: int, ttt: int):
    """(draft, objective, inputs) of our EAGLE3 step on random inputs of the target's shape (CPU, fp32 weights;
    the loss in one chunk: its weight gradient is one product)."""
    from transformers import AutoConfig

    from specforge_lite.draft.objective import UnrollInputs
    from specforge_lite.methods import build_objective
    from specforge_lite.targets.capture import default_aux_layer_ids

    model_type, _, fields = TARGETS[target]
    config = AutoConfig.for_model(model_type, **fields)
    V, H = config.vocab_size, config.hidden_size
    g = torch.Generator().manual_seed(0)
    weights = torch.randn(V, H, generator=g) * 0.02  # (embedding and lm_head alike: their values do no work)
    draft, cfg, _, _ = new_draft(config, default_aux_layer_ids(config.num_hidden_layers), weights, weights,
                                 "eagle3", draft_vocab, ttt, torch.device("cpu"))
    ones = torch.ones(1, T, dtype=torch.long)
    inputs = UnrollInputs([torch.randn(1, T, H, generator=g) for _ in range(3)], torch.randint(0, V, (1, T)),
                          torch.randn(1, T, draft_vocab, generator=g), ones.bool(), ones)
    # (the counter skips the in-place addmm_ that accumulates chunks: one chunk, the same work)
    return draft, replace_objective(build_objective(cfg), loss_chunk_rows=0), inputs


def ours(target: str, T: int, draft_vocab: int, ttt: int) -> dict:
    """Our EAGLE3 step's GFLOP per token and trainable parameters, on random inputs of the target's shape."""
    from torch.utils.flop_counter import FlopCounterMode

    draft, objective, inputs = our_step(target, T, draft_vocab, ttt)
    with FlopCounterMode(display=False) as flops:
        objective.unroll(draft, inputs).loss.backward()
    return {"gflop_per_token": flops.get_total_flops() / T / 1e9,
            "trainable_m": sum(p.numel() for p in draft.parameters() if p.requires_grad) / 1e6}


def peer(name: str, python: str, target: str, T: int, draft_vocab: int, ttt: int) -> dict:
    """A peer's step counted by its own driver (one timed step beside it, as the driver always does)."""
    cmd = [python, str(peer_driver(name)), "--seq-len", str(T), "--ttt", str(ttt),
           "--draft-vocab", str(draft_vocab), "--repeats", "1", "--shape", json.dumps(peer_shape(target)),
           "--count-flops",
           *TEACHER_AS_ON_A_GPU.get(name, [])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines or "gflop_per_token" not in lines[0]:
        raise SystemExit(f"error: {name}'s driver failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    row = lines[0]
    return {"gflop_per_token": row["gflop_per_token"], "trainable_m": row["trainable_m"], "notes": row["notes"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m studies step_flops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="llama3_8b", choices=[t for t in TARGETS if t != "tiny"])
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(2)
    rows = {"ours": ours(a.target, a.seq_len, a.draft_vocab, a.ttt)}
    python = peer_python() if a.peers else None
    for name in filter(None, a.peers.split(",")):
        rows[name] = peer(name, python, a.target, a.seq_len, a.draft_vocab, a.ttt)
    # (a table result file: docs/benchmarks.md shows it; FLOPs are counted, so the CPU only says where)
    result = {"machine": f"FLOPs counted, not timed, in fp32 on a CPU ({describe_cpu().split(';')[0]})",
              "date": time.strftime("%Y-%m-%d"), "note": f"{a.target}'s shape, T={a.seq_len}, TTT {a.ttt}, draft "
              f"vocabulary {a.draft_vocab}, micro-batch 1: forward, loss and backward",
              "command": "python -m studies step_flops " + " ".join(argv if argv is not None else sys.argv[2:]),
              "columns": ["step", "GFLOP per token", "trainable parameters (M)", "what differs"],
              "rows": [[name, f"{r['gflop_per_token']:.2f}", f"{r['trainable_m']:.1f}", WHAT.get(name, "")]
                       for name, r in rows.items()],
              "peer_notes": {name: r["notes"] for name, r in rows.items() if "notes" in r}}
    print(f"\n{result['note']}\n" + "\n".join(" | ".join(map(str, row[:3])) for row in result["rows"]))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
