"""Run by tests/test_distributed.py and tests/test_matrix.py under ``torchrun --nproc_per_node 2``:
``sharded_target``: a ZeRO-3 sharded target against a whole copy of the same target in the same process,
on each rank's own batch; ``ulysses``: the draft's TTT unroll split across the ranks by sequence
parallelism against the whole unroll on one rank; ``matrix``: the matrix's cases (tests/matrix_cases.py)
under DeepSpeed ZeRO-2 (the option:precision pairs test_matrix.py names), each rank training on its own row."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from specforge_lite.compose import load_config  # noqa: E402
from specforge_lite.data.vocab import DraftVocab  # noqa: E402
from specforge_lite.targets import build_target  # noqa: E402
from specforge_lite.targets import Teacher  # noqa: E402
from specforge_lite.training.distributed import init_distributed  # noqa: E402


def sharded_target(preset: str, out: Path) -> None:
    config = load_config([f"model={preset}", "tracker=none", "trainer=zero2", "target.shard=zero3"])
    ctx = init_distributed(config.trainer)
    whole = build_target(load_config([f"model={preset}", "tracker=none"]))
    sharded = build_target(config, ctx=ctx)
    g = torch.Generator().manual_seed(100 + ctx.rank)  # every rank captures its own rows, as in training
    ids = torch.randint(0, whole.vocab_size, (2, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 25:] = 0
    vocab = DraftVocab(torch.linspace(0, whole.vocab_size - 1, 512).long().unique(), whole.vocab_size, float("nan"))
    a, b = whole.capture(ids, mask), sharded.capture(ids, mask)
    (ta, va), (tb, vb) = [Teacher(t, vocab.draft_to_target, vocab.t2d)(c) for t, c in ((whole, a), (sharded, b))]
    emb_param = sharded.family.embedding(sharded.model).weight
    emb = sharded.embedding_weight()
    result = {
        "rank": ctx.rank,
        "aux_max_diff": max(float((x - y).abs().max()) for x, y in zip(a.aux, b.aux)),
        "final_max_diff": float((a.final_hidden - b.final_hidden).abs().max()),
        "teacher_max_diff": float((ta - tb).abs().max()),
        "in_vocab_equal": bool(torch.equal(va, vb)),
        "embedding_equal": bool(torch.equal(emb, whole.embedding_weight())),
        "embedding_checksum": float(emb.double().sum()),
        "embedding_local_numel": emb_param.ds_tensor.numel(),  # this rank's partition
        "embedding_full_numel": emb.numel(),
        "sizes": [sharded.hidden_size, sharded.vocab_size, whole.hidden_size, whole.vocab_size],
    }
    gathered = [None] * ctx.world_size
    torch.distributed.all_gather_object(gathered, result)
    if ctx.is_main:
        out.write_text(json.dumps(gathered))
    ctx.barrier()


def ulysses(shape: str, out: Path) -> None:
    """Both ranks hold the same packed rows (odd length, so the split pads) at a real draft's head layout;
    each runs its share of the unroll (blockwise attention, activation checkpointing, small loss chunks),
    and the sums over the two ranks of loss and gradients are compared with the whole unroll: for an
    EAGLE3 draft and an EAGLE 3.1 draft of two layers."""
    import deepspeed

    from specforge_lite.methods.eagle3.settings import Eagle3Settings
    from specforge_lite.training.distributed import launcher_env, with_sequence_parallel

    deepspeed.init_distributed(dist_backend="gloo")
    ctx = with_sequence_parallel(launcher_env(), 2)
    results = [ulysses_unroll(ctx, shape, draft_cfg) for draft_cfg in
               (Eagle3Settings(), Eagle3Settings(norm_before_fc=True, norm_output=True, num_layers=2))]
    gathered = [None] * ctx.world_size
    torch.distributed.all_gather_object(gathered, results)
    if ctx.is_main:
        out.write_text(json.dumps([r for per_rank in zip(*gathered) for r in per_rank]))


def ulysses_unroll(ctx, shape: str, draft_cfg) -> dict:
    from specforge_lite.bench.shapes import SHAPES, synthetic_draft
    from specforge_lite.draft.objective import UnrollInputs
    from specforge_lite.methods.eagle3.objective import TTTObjective

    dims = {**SHAPES[shape], "num_hidden_layers": 8}
    draft = synthetic_draft(dims, draft_cfg, 96)
    table = torch.randn(dims["vocab_size"], dims["hidden_size"], generator=torch.Generator().manual_seed(1))
    draft.set_embedding(table)
    g = torch.Generator().manual_seed(7)  # the same rows on both ranks
    B, T, H = 2, 37, dims["hidden_size"]
    positions = torch.cat([torch.arange(20), torch.arange(17)])[None].repeat(B, 1)  # two conversations per row
    inputs = UnrollInputs([torch.randn(B, T, H, generator=g) for _ in range(3)],
                          torch.randint(0, dims["vocab_size"], (B, T), generator=g),
                          torch.randn(B, T, 96, generator=g), torch.rand(B, T, generator=g) > 0.2,
                          (torch.rand(B, T, generator=g) > 0.3).long(), positions)
    options = dict(ttt_length=4, loss_chunk_rows=8, checkpointing=True)
    whole = TTTObjective(**options).unroll(draft, inputs)
    whole.loss.backward()
    want = {n: p.grad.clone() for n, p in draft.named_parameters()}
    draft.zero_grad()
    part = TTTObjective(**options, sequence=ctx.sequence_shard()).unroll(draft, inputs)
    part.loss.backward()
    summed = torch.stack([part.loss.detach(), *[s.valid.float() for s in part.steps],
                          *[s.correct.float() for s in part.steps]])
    torch.distributed.all_reduce(summed)
    grad_diff = 0.0
    for n, p in draft.named_parameters():
        grad = p.grad.clone()
        torch.distributed.all_reduce(grad)
        grad_diff = max(grad_diff, float((grad - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-12)))
    return {"rank": ctx.rank, "layers": draft.spec.num_layers, "loss": float(summed[0]),
            "whole_loss": float(whole.loss),
            "valid": summed[1:5].tolist(), "whole_valid": [float(s.valid) for s in whole.steps],
            "correct": summed[5:].tolist(), "whole_correct": [float(s.correct) for s in whole.steps],
            "own_valid": [float(s.valid) for s in part.steps], "grad_rel_diff": grad_diff}


def matrix(cases: str, out: Path) -> None:
    """``cases``: comma-separated ``option:precision`` pairs."""
    from matrix_cases import case_losses

    from specforge_lite.training.distributed import init_distributed

    ctx = init_distributed(load_config(["tracker=none", "trainer=zero2"]).trainer)
    results = [{"option": option, "precision": precision, "rank": ctx.rank,
                "losses": case_losses(option, precision, ctx=ctx, deepspeed=True, row=ctx.rank)}
               for option, precision in (case.split(":") for case in cases.split(","))]
    gathered = [None] * ctx.world_size
    torch.distributed.all_gather_object(gathered, results)
    if ctx.is_main:
        out.write_text(json.dumps([r for per_rank in gathered for r in per_rank]))


if __name__ == "__main__":
    from specforge_lite.training.distributed import launcher_env, process_group

    entries = {"sharded_target": sharded_target, "ulysses": ulysses, "matrix": matrix}
    with process_group(launcher_env):  # (the entry joins; the group is destroyed when it returns)
        entries[sys.argv[1]](sys.argv[2], Path(sys.argv[3]))
    # The work is done and its result written: end here, without the interpreter's finalization. DeepSpeed keeps
    # its gloo groups alive (ZeRO state holds them), so destroying the group does not stop gloo's worker threads,
    # and one of them may still be freeing the last collective's tensors, which needs the GIL; a thread that asks
    # for it while the interpreter finalizes is ended by CPython (pthread_exit) inside a noexcept destructor, and
    # the process aborts ("terminate called without an active exception"). os._exit ends every thread at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
