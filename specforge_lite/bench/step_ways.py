"""The ways one draft step can train (TTT attention, checkpointing, compiled chains, a frozen lm_head: a way is
"ATTENTION[+ckpt][+compile][+frozen_head]"), each checked against an fp32 reference before it is timed."""

from __future__ import annotations

import contextlib
import copy

import torch


def draft_step(draft, objective, inputs, autocast: bool, way: str = ""):
    """Forward + loss + backward of one unroll (the draft as ``way`` trains it: ``trained_as``); gradients dropped
    after (no optimizer step: the step alone is timed)."""
    def step():
        with trained_as(draft, way), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = objective.unroll(draft, inputs)
        out.loss.backward()
        draft.zero_grad(set_to_none=True)
    return step


@contextlib.contextmanager
def trained_as(draft, way: str):
    """Within the block the draft trains as ``way`` says: with "+frozen_head", its lm_head frozen."""
    if not head_frozen(way):
        yield
        return
    weight = draft.lm_head.weight
    trained = weight.requires_grad
    weight.requires_grad_(False)
    try:
        yield
    finally:
        weight.requires_grad_(trained)


def head_frozen(way: str) -> bool:
    """Whether a way trains with the lm_head frozen ("+frozen_head")."""
    return "frozen_head" in way.split("+")[1:]


def loss_and_grads(draft, objective, inputs, autocast: bool, way: str = ""):
    """(loss, each trained weight's gradient by name) of one unroll."""
    with trained_as(draft, way), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = objective.unroll(draft, inputs).loss
    loss.backward()
    grads = {n: p.grad.float().flatten() for n, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad(set_to_none=True)
    return loss.item(), grads


def check_ways(draft, objective, inputs, ways: list[str], autocast: bool) -> dict[str, dict]:
    """Each way's loss and gradients against an fp32 reference on the same row (blockwise without autocast):
    relative loss difference and gradients' relative error. In bf16 the gradients of a random-weight draft are
    far from fp32's (a relative error of about 0.2 at Llama-3-8B's shape on its captured states, for every
    way); a way is correct when its error is no more than 1.25x blockwise's own under the same autocast
    (blockwise: checked against a naive attention in fp32 on CPU) and its loss within 1e-2."""
    ref_loss, ref = loss_and_grads(draft, replace_attention(objective, "blockwise"), inputs, False)
    measured = {}
    for way in ["blockwise", *ways]:
        try:
            loss, grads = loss_and_grads(draft, replace_attention(objective, way), inputs, autocast, way)
        except Exception as e:  # noqa: BLE001 (a way that cannot run here is reported, not fatal)
            measured[way] = {"correct": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            continue
        got, want = (torch.cat([g[n] for n in grads]) for g in (grads, ref))  # (the weights this way trains)
        measured[way] = {"loss_rel_diff": abs(loss - ref_loss) / max(abs(ref_loss), 1e-30),
                         "grad_rel_err": float((got - want).norm() / want.norm().clamp_min(1e-30))}
    bound = 1.25 * measured["blockwise"].get("grad_rel_err", 0.0) + 1e-6
    for r in measured.values():
        if "error" not in r:
            r["correct"] = r["loss_rel_diff"] < 1e-2 and r["grad_rel_err"] <= bound
    return measured


def replace_attention(objective, way: str):
    """The objective with TTT attention ``way``; "+ckpt" also recomputes each step in backward
    (draft.checkpointing), "+compile" runs the step's elementwise chains compiled (draft.compile). (A frozen
    head is the draft's: ``trained_as``.)"""
    return replace_objective(objective, **way_options(way))


def way_options(way: str) -> dict:
    """The objective's settings of a way "ATTENTION[+ckpt][+compile][+frozen_head]"; the attention "default" leaves
    the attention and compile settings null: the device's (the objective's ``device_defaults``), as a run's defaults."""
    from ..methods.eagle3.ttt import TTT_ATTENTION

    attention, *options = way.split("+")
    if attention not in (*TTT_ATTENTION, "default") or set(options) - {"ckpt", "compile", "frozen_head"}:
        raise SystemExit(f"error: way {way!r}: an attention of {', '.join(TTT_ATTENTION)} or default, then +ckpt, "
                         "+compile and/or +frozen_head")
    default = attention == "default"
    return {"attention": None if default else attention, "checkpointing": "ckpt" in options,
            "compile": True if "compile" in options else None if default else False}


def replace_objective(objective, **changes):
    """A copy of the objective with some of its settings changed (the draft and the row stay shared)."""
    new = copy.copy(objective)
    new.__dict__.update(changes)
    return new
