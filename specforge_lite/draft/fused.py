"""The elementwise chains of a draft step, each written once, run eagerly or as compiled kernels (draft.compile).

Eager PyTorch runs every op of a chain as its own pass over the whole tensor: HF's RMSNorm makes six (an fp32
copy, the square, the mean, the scaling, the cast back, the weight), rope four per tensor, the soft cross-entropy
over a chunk's [rows, draft_vocab] logits about thirty in fp32. On a GPU the step's matrix products run near the
device's peak and these passes, bound by memory bandwidth, take much of the rest of the step (``python -m
studies step_traffic`` counts their bytes). torch.compile turns each chain into one or two fused kernels. Inside
``compiled(True)`` (the unroll, with draft.compile=true) ``run`` calls a chain's compiled twin; outside it, the
chain itself: the same math either way, equal up to rounding (tests/test_fused.py). A checkpointed part of the
unroll goes through ``checkpoint``, whose recomputation in backward calls the chains as its forward did.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F

_compiled: dict[Callable, Callable] = {}
_enabled = False


@contextlib.contextmanager
def compiled(enabled: bool):
    """Within the block, ``run`` calls the chains' compiled twins (``enabled``) or the chains themselves."""
    global _enabled
    before, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = before


def compiling() -> bool:
    """Whether ``run`` calls the compiled twins here (inside ``compiled(True)``)."""
    return _enabled


def checkpoint(fn: Callable, *args):
    """torch.utils.checkpoint of ``fn(*args)`` whose recomputation in backward, which runs after the forward's
    ``compiled`` block has ended, calls the chains as the forward did: else it would save other tensors."""
    from torch.utils.checkpoint import checkpoint as recomputed

    enabled = _enabled

    def again(*a):
        with compiled(enabled):
            return fn(*a)

    return recomputed(again, *args, use_reentrant=False)


# Compiles of one chain before torch falls back to running it eagerly: a chain is compiled for any length
# (dynamic) but once per rank, width, dtype and requires-grad pattern of its inputs, and a block draft's norm alone
# meets 6 to 7 of those in one step (torch's default allows 8).
RECOMPILE_LIMIT = 64


def run(chain: Callable, *args):
    """``chain(*args)``, through its compiled twin inside ``compiled(True)``."""
    if not _enabled:
        return chain(*args)
    twin = _compiled.get(chain)
    if twin is None:
        import torch._dynamo

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        twin = _compiled[chain] = torch.compile(chain, dynamic=True)
    return twin(*args)


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype products with ``t`` run in: autocast's on its device where autocast is on (fp32 master weights in
    a bf16 trainer), else ``t``'s own. An input cast to it once is not cast to fp32 first and back by autocast."""
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else t.dtype


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalised in fp32, cast back to x's dtype, times the weight in that dtype. A server holds
    the weight in the activations' dtype and computes it so (vLLM's order); under autocast the fp32 master weight
    times bf16 rows would promote the output, and with it the residual stream and the keys, to fp32."""
    return _RMSNorm.apply(x, weight, eps)


class _RMSNorm(torch.autograd.Function):
    """``rms_norm`` keeping for its backward only its input (which the layer before holds anyway) and each row's
    1 / rms: autograd through the chain of ops keeps an fp32 copy of the rows and the scaled rows, three times the
    rows' bytes per norm until the backward, a large per-token part of a long row's peak."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        h = x.float()
        inv_rms = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, inv_rms)
        return weight.to(x.dtype) * (h * inv_rms).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, inv_rms = ctx.saved_tensors
        normed = x * inv_rms  # (fp32 by promotion: no fp32 copy of x first)
        grad_weight = None
        if ctx.needs_input_grad[1]:  # products rounded as the forward's were, summed in fp32
            grad_weight = (grad * normed.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0, dtype=torch.float32)
            grad_weight = grad_weight.to(weight.dtype)
        grad_normed = grad * weight.float()  # (fp32 by promotion, in one pass)
        # dx = (dn - n * mean(dn * n)) / rms, in place over the fp32 rows already made
        mean = torch.linalg.vecdot(grad_normed, normed).unsqueeze(-1).div_(x.shape[-1])
        grad_x = grad_normed.sub_(normed.mul_(mean)).mul_(inv_rms)
        return grad_x.to(x.dtype), grad_weight, None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope (rotate-half, vLLM's neox style) on x [..., heads, T, d] with cos, sin [..., T, d]."""
    return x * cos.unsqueeze(-3) + _rotate_half(x) * sin.unsqueeze(-3)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rope on queries and keys [B, heads, T, d] with cos, sin [B, T, d] (transformers' apply_rotary_pos_emb)."""
    return rotate(q, cos, sin), rotate(k, cos, sin)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The Llama MLP's activation: silu(gate) * up."""
    return F.silu(gate) * up


def soft_ce_rows(z: torch.Tensor, teacher: torch.Tensor, top: torch.Tensor, row_weights: torch.Tensor,
                 grad_dtype: torch.dtype | None):
    """One chunk of the soft cross-entropy from its logits z [n, Vd] and its teacher rows [n, Vd]: (each row's loss
    [n] in fp32, whether its argmax is the teacher's ``top`` [n], and the gradient of sum(row_weights * loss) with
    respect to z in ``grad_dtype``, None for none). Row loss: lse(z) * sum(p) - p . z with p the teacher's softmax;
    its gradient w * (softmax(z) * sum(p) - p). In place over the chunk's own fp32 copies: in eager every pass
    over [n, Vd] costs, and a pass that allocates costs memory too."""
    z = z.float()
    p = teacher.float()
    p = p.sub_(p.amax(-1, keepdim=True)).exp_()
    p = p.div_(p.sum(-1, keepdim=True))
    correct = z.argmax(-1) == top
    p_dot_z = torch.linalg.vecdot(p, z)
    peak = z.amax(-1, keepdim=True)
    e = z.sub_(peak).exp_()  # (the log-sum-exp and the softmax from one exp)
    e_sum = e.sum(-1, keepdim=True)
    p_sum = p.sum(-1, keepdim=True)
    row_loss = ((peak + e_sum.log()) * p_sum).squeeze(-1) - p_dot_z
    if grad_dtype is None:
        return row_loss, correct, None
    scale = row_weights[:, None]
    return row_loss, correct, e.mul_(p_sum * scale / e_sum).sub_(p.mul_(scale)).to(grad_dtype)
