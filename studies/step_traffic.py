"""The memory traffic of one draft training step at a real target's shape, by kind of op: where an eager step's
time goes on a GPU besides its matrix products.

    python -m studies step_traffic [--target llama3_8b] [--seq-len 1024] [--out FILE.json]

Our EAGLE3 step (draft vocabulary 32k, TTT 7, micro-batch 1: forward, loss and backward; the loss in chunks of a
GPU's size) runs once in eager on CPU under bf16 autocast with fp32 master weights and bf16 inputs, as
trainer.precision=bf16 trains on a GPU, and every aten op it dispatches is recorded with the bytes of its inputs
and outputs (views are free; a gather counts the rows it reads, not its whole table).
The bytes of the elementwise kinds, divided by a GPU's memory bandwidth, are a floor on what they cost there:
the time torch.compile's fused kernels (draft.compile) can win. The matrix products' FLOPs at the device's bf16
rate are the floor of the rest. Kinds: matmul; loss (a [rows, draft_vocab] tensor); weights (a tensor of a
weight's shape: casts of the fp32 master weights, gradient sums); hidden (a [.., T, width] tensor); heads (per
head [.., T, head_dim]: rope, and the blockwise attention's copies of keys and values and its fp32 gradients);
scores (the blockwise attention's score blocks); other. Heads and scores are left out of the floor: flex attention,
the GPU's way, keeps most of them inside its kernel. Per token, at two lengths: the growth between them is the
per-token rate (the scores' grows with T).
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
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from specforge_lite.bench.step_ways import replace_objective
from specforge_lite.device import describe_cpu
from specforge_lite.draft.objective import STEP_DEFAULTS

from .step_flops import our_step

MATMULS = {"mm", "bmm", "addmm", "baddbmm", "matmul", "_scaled_dot_product_flash_attention_for_cpu"}
FREE = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze", "squeeze",
        "as_strided", "alias", "detach", "split", "unbind", "narrow", "_reshape_alias", "split_with_sizes",
        "lift_fresh", "empty", "empty_like", "empty_strided"}
GATHERS = {"embedding", "index_select", "index"}
# bandwidth (TB/s) and dense bf16 peak (TFLOP/s) of the GPUs users train on, from their data sheets
GPUS = {"H100 SXM": (3.35, 989), "H200": (4.8, 989)}


class Traffic(TorchDispatchMode):
    """Bytes in and out of every non-view aten op, by kind (``kind``)."""

    def __init__(self, T: int, draft_vocab: int, head_dim: int, weight_shapes: set):
        super().__init__()
        self.T, self.vocab, self.head_dim, self.weights = T, draft_vocab, head_dim, weight_shapes
        self.bytes: dict[str, float] = defaultdict(float)
        self.ops: dict[str, int] = defaultdict(int)

    def kind(self, name: str, shape: tuple) -> str:
        if name in MATMULS:
            return "matmul"
        if shape in self.weights:
            return "weights"
        if shape and shape[-1] == self.vocab:
            return "loss"
        if len(shape) == 3 and shape[1] == self.T:
            return "hidden"
        if len(shape) >= 4:  # per head [.., T, head_dim] (rope, q, k, v), or blocks of attention scores
            return "heads" if shape[-1] == self.head_dim else "scores"
        return "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in FREE:
            return out
        tensors = [x for x in tree_leaves((args, kwargs, out)) if isinstance(x, torch.Tensor)]
        first = next((x for x in tree_leaves(out) if isinstance(x, torch.Tensor)), None)
        kind = self.kind(name, tuple(first.shape) if first is not None else ())
        if name in GATHERS:  # reads only the rows it gathers: as many bytes as it writes
            tensors = [first, first]
        self.bytes[kind] += sum(x.numel() * x.element_size() for x in tensors)
        self.ops[kind] += 1
        return out


def traffic(target: str, T: int, draft_vocab: int, ttt: int) -> dict:
    """Bytes by kind, op counts and FLOPs of one eager step of T tokens."""
    from torch.utils.flop_counter import FlopCounterMode

    draft, objective, inputs = our_step(target, T, draft_vocab, ttt)
    objective = replace_objective(objective, loss_chunk_rows=STEP_DEFAULTS.cuda["loss_chunk_rows"])
    bf16 = torch.bfloat16  # (the target's dtype: its captured states and the teacher's logits)
    inputs = dataclasses.replace(inputs, aux=[a.to(bf16) for a in inputs.aux],
                                 teacher_logits=inputs.teacher_logits.to(bf16))
    shapes = {tuple(p.shape) for p in draft.parameters()}
    with FlopCounterMode(display=False) as flops, Traffic(T, draft_vocab, draft.spec.head_dim, shapes) as seen:
        with torch.autocast("cpu", dtype=bf16):
            out = objective.unroll(draft, inputs)
        out.loss.backward()
    return {"T": T, "bytes": dict(seen.bytes), "ops": dict(seen.ops), "flops": flops.get_total_flops()}


def per_token(short: dict, long: dict) -> dict:
    """The per-token rate of each kind: its growth from the shorter row to the longer."""
    span = long["T"] - short["T"]
    return {kind: (long["bytes"][kind] - short["bytes"].get(kind, 0.0)) / span for kind in long["bytes"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m studies step_traffic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="llama3_8b")
    p.add_argument("--seq-len", type=int, default=1024, help="the longer row; the shorter is half of it")
    p.add_argument("--at", type=int, default=4096, help="the row length the GPU floors are given for")
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(2)
    short, long = (traffic(a.target, T, a.draft_vocab, a.ttt) for T in (a.seq_len // 2, a.seq_len))
    rate = per_token(short, long)
    fixed = {kind: long["bytes"][kind] - rate[kind] * long["T"] for kind in rate}
    flops_per_token = (long["flops"] - short["flops"]) / (long["T"] - short["T"])
    at = {kind: fixed[kind] + rate[kind] * a.at for kind in rate}
    elementwise = sum(v for kind, v in at.items() if kind not in ("matmul", "heads", "scores"))
    rows = []
    for gpu, (tb_s, tflop_s) in GPUS.items():
        rows.append({"gpu": gpu, "elementwise_ms": elementwise / tb_s / 1e9,
                     "matmul_ms": flops_per_token * a.at / tflop_s / 1e9})
    result = {"machine": f"bytes counted, not timed, on a CPU ({describe_cpu().split(';')[0]})",
              "date": time.strftime("%Y-%m-%d"), "target": a.target, "ttt": a.ttt, "draft_vocab": a.draft_vocab,
              "command": "python -m studies step_traffic " + " ".join(argv if argv is not None else sys.argv[2:]),
              "mb_per_token": {k: v / 1e6 for k, v in sorted(rate.items(), key=lambda kv: -kv[1])},
              "ops_per_step": long["ops"], "gflop_per_token": flops_per_token / 1e9, "at_T": a.at, "floors": rows}
    # (a table result file: docs/benchmarks.md shows it)
    floors = "; ".join(f"{r['gpu']} >= {r['elementwise_ms']:.0f} ms (its matrix products >= {r['matmul_ms']:.0f} ms)"
                       for r in rows)
    result.update(note=f"{a.target}'s shape, TTT {a.ttt}, draft vocabulary {a.draft_vocab}, eager under bf16 "
                  f"autocast, blockwise attention; bytes read and written per token. Loss, hidden, weights and other "
                  f"at T={a.at}: {floors}",
                  columns=["kind of op", "MB per token", f"ops per step at T={long['T']}"],
                  rows=[[kind, f"{mb:.1f}", long["ops"][kind]] for kind, mb in result["mb_per_token"].items()])
    print(f"{a.target}, TTT {a.ttt}, draft vocabulary {a.draft_vocab}; eager step under bf16 autocast, per token:")
    for kind, mb in result["mb_per_token"].items():
        print(f"  {kind:10s} {mb:8.2f} MB/token  ({long['ops'][kind]} ops at T={long['T']})")
    for r in rows:
        print(f"  at T={a.at} on an {r['gpu']}: loss, hidden, weights and other >= {r['elementwise_ms']:.0f} ms, "
              f"matrix products >= {r['matmul_ms']:.0f} ms")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
