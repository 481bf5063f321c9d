"""What one draft training step holds at its peaks, at a real target's shape: where a GPU's memory per token goes.

    python -m studies step_memory [--target llama3_8b] [--seq-len 3000] [--checkpointing] [--out FILE.json]

Our EAGLE3 step (draft vocabulary 32k, TTT 7, micro-batch 1: forward, loss and backward; the loss in chunks of a
GPU's size) runs once in eager on CPU under bf16 autocast with fp32 master weights and bf16 inputs, as
trainer.precision=bf16 trains on a GPU. Every tensor an aten op makes is tracked until its storage is freed; at
the forward's and the backward's peaks the live bytes are grouped by what made them (the phase, the op, the
tensor's kind and dtype). Bytes counted, not timed: a GPU's allocator adds its rounding and cache, not its own
tensors. Per token, at two lengths: the growth between them is what a longer row costs (the blockwise
attention's blocks grow too; flex attention, the GPU's way, keeps its scores inside its kernel).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from specforge_lite.bench.step_ways import replace_objective
from specforge_lite.device import describe_cpu
from specforge_lite.draft.objective import STEP_DEFAULTS

from .step_flops import our_step
from .step_traffic import FREE


class LiveBytes(TorchDispatchMode):
    """The bytes of every storage an op makes, while it lives; the peak, and what was live at it by label."""

    def __init__(self, label):
        super().__init__()
        self.label = label  # (op name, output tensor) -> str
        self.live: dict[int, tuple[StorageWeakRef, int, str]] = {}
        self.total = 0
        self.phase = "forward"  # (the caller sets "backward" before it runs the backward)
        self.peak: dict[str, int] = defaultdict(int)  # per phase
        self.at_peak: dict[str, dict[str, int]] = {}  # per phase: label -> bytes live at that phase's peak

    def _purge(self) -> None:
        for key in [k for k, (ref, _, _) in self.live.items() if ref.expired()]:
            self.total -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in FREE - {"empty", "empty_like", "empty_strided"}:
            return out
        self._purge()
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key not in self.live:
                nbytes = storage.nbytes()
                self.live[key] = (StorageWeakRef(storage), nbytes, f"{self.phase} {self.label(name, t)}")
                self.total += nbytes
        if self.total > self.peak[self.phase]:
            self.peak[self.phase] = self.total
            grouped: dict[str, int] = defaultdict(int)
            for _, nbytes, label in self.live.values():
                grouped[label] += nbytes
            self.at_peak[self.phase] = dict(grouped)
        return out


def labeller(T: int, draft_vocab: int, hidden: int, head_dim: int, weight_shapes: set):
    """A tensor's label: the op that made it, its kind by shape and its dtype."""

    def kind(shape: tuple) -> str:
        if shape in weight_shapes:
            return "weight-shaped"
        if shape and shape[-1] == draft_vocab:
            return "[rows, draft vocab]"
        if len(shape) >= 4:
            return "per head" if shape[-1] == head_dim else "score blocks"
        if shape and shape[-1] % hidden == 0 and len(shape) >= 2:
            return f"[rows, {shape[-1] // hidden} x hidden]" if shape[-1] != hidden else "[rows, hidden]"
        return "[rows, other]" if shape and any(d >= T for d in shape) else "small"

    def label(op: str, t: torch.Tensor) -> str:
        return f"{op} {kind(tuple(t.shape))} {str(t.dtype).removeprefix('torch.')}"

    return label


def held(target: str, T: int, draft_vocab: int, ttt: int, checkpointing: bool) -> dict:
    """Per phase (forward with the loss, backward), the peak live bytes above the inputs of one eager step of T
    tokens, and what was live at it."""
    draft, objective, inputs = our_step(target, T, draft_vocab, ttt)
    objective = replace_objective(objective, loss_chunk_rows=STEP_DEFAULTS.cuda["loss_chunk_rows"],
                                  checkpointing=checkpointing)
    bf16 = torch.bfloat16  # (the target's dtype: its captured states and the teacher's logits)
    inputs = dataclasses.replace(inputs, aux=[a.to(bf16) for a in inputs.aux],
                                 teacher_logits=inputs.teacher_logits.to(bf16))
    spec, shapes = draft.spec, {tuple(p.shape) for p in draft.parameters()}
    if T in {d for shape in shapes for d in shape}:  # (rows are told from weights by their shapes)
        raise SystemExit(f"error: T={T} equals a dimension of the draft's weights; choose a --seq-len whose half "
                         f"and whole are none of {sorted({d for shape in shapes for d in shape})}")
    label = labeller(T, draft_vocab, spec.hidden_size, spec.head_dim, shapes)
    with LiveBytes(label) as live:
        with torch.autocast("cpu", dtype=bf16):
            out = objective.unroll(draft, inputs)
        live.phase = "backward"
        out.loss.backward()
    return {"T": T, "peak": dict(live.peak), "at_peak": live.at_peak}


def as_table(result: dict) -> dict:
    """The result file's table (scripts/docs_figures.py writes it into docs/benchmarks.md): per phase, its peaks,
    what at them is fixed and what grows per token, and the three labels that grow most."""
    rows = []
    for phase, r in result["phases"].items():
        (t0, g0), (t1, g1) = r["peak_gib"].items()
        largest = "; ".join(f"{label} {kb:.0f}" for label, kb in list(r["kb_per_token_by_label"].items())[:3])
        rows.append([phase, f"{g0:.2f} at {t0}, {g1:.2f} at {t1}", f"{r['fixed_gib']:.2f}",
                     f"{r['kb_per_token']:.0f}", largest])
    note = (f"{result['target']}'s shape, TTT {result['ttt']}, draft vocabulary {result['draft_vocab']}, eager under "
            f"bf16 autocast, blockwise attention{', checkpointing' if result['checkpointing'] else ''}; "
            "live bytes above the row's inputs")
    return {"note": note, "columns": ["phase", "peak (GiB)", "fixed at the peak (GiB)", "KB per token at the peak",
                                      "growing most (made in, op, kind, dtype: KB per token)"], "rows": rows}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m studies step_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="llama3_8b")
    p.add_argument("--seq-len", type=int, default=3000, help="the longer row; the shorter is half of it")
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--checkpointing", action="store_true", help="draft.checkpointing=true (the long rows' setting)")
    p.add_argument("--top", type=int, default=12, help="labels listed")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(2)
    short, long = (held(a.target, T, a.draft_vocab, a.ttt, a.checkpointing) for T in (a.seq_len // 2, a.seq_len))
    T, span = long["T"], long["T"] - short["T"]
    phases = {}
    for phase in ("forward", "backward"):
        # each label's bytes at the two peaks: what grows with the row (per token) and what does not (fixed)
        labels = long["at_peak"][phase].keys() | short["at_peak"][phase].keys()
        per_token = {k: (long["at_peak"][phase].get(k, 0) - short["at_peak"][phase].get(k, 0)) / span for k in labels}
        fixed = long["peak"][phase] - sum(per_token.values()) * T
        top = sorted(per_token.items(), key=lambda kv: -kv[1])[: a.top]
        phases[phase] = {"peak_gib": {short["T"]: short["peak"][phase] / 2**30, T: long["peak"][phase] / 2**30},
                         "kb_per_token": sum(per_token.values()) / 1e3, "fixed_gib": fixed / 2**30,
                         "kb_per_token_by_label": {k: v / 1e3 for k, v in top}}
    result = {"machine": f"bytes counted, not timed, on a CPU ({describe_cpu().split(';')[0]})",
              "date": time.strftime("%Y-%m-%d"), "target": a.target, "ttt": a.ttt, "draft_vocab": a.draft_vocab,
              "checkpointing": a.checkpointing,
              "command": "python -m studies step_memory " + " ".join(argv if argv is not None else sys.argv[2:]),
              "phases": phases}
    result.update(as_table(result))
    print(f"{a.target}, TTT {a.ttt}, draft vocabulary {a.draft_vocab}, checkpointing {a.checkpointing}")
    for phase, r in phases.items():
        gib = ", ".join(f"{v:.2f} GiB at T={t}" for t, v in r["peak_gib"].items())
        print(f"{phase} peak: {gib}; at it, {r['fixed_gib']:.2f} GiB fixed and {r['kb_per_token']:.0f} KB per "
              "token, of which:")
        for k, v in r["kb_per_token_by_label"].items():
            print(f"  {v:8.1f}  {k}")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
