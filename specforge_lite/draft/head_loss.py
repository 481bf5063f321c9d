"""The draft's lm_head and the soft cross-entropy against the teacher, fused, in row chunks.

A TTT unroll's loss needs the draft's logits over the whole draft vocabulary for every valid row of
every step: [N, Vd] in fp32 per step (32k rows x 32k tokens: 4 GiB). Here the rows of all steps go
through in chunks; each chunk's logits, the teacher's probabilities for its rows and the gradient of
the loss with respect to the logits (softmax(z) * sum(p) - p) live only inside the chunk, which turns
them at once into the gradients of its hidden rows and (accumulated in one buffer for all steps) of
the weight. The backward only scales those by the incoming gradient: no [N, Vd] tensor is kept and
nothing is recomputed (a checkpointed chunk would run the lm_head matmul a fourth time).

The loss of a row is -sum_v p(v) log softmax(z)(v) = lse(z) * sum(p) - sum_v p(v) z(v), with p the
teacher's softmax over the draft vocabulary at that row's teacher position; the rows are weighted
(step k's rows by decay**k / its valid count) into the one differentiable total. A chunk's loss and logit gradient
come from ``fused.soft_ce_rows`` (eager or compiled) or, on CUDA, from one Triton kernel (``chunk_soft_ce``).
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from torch import nn

from . import fused
from .fused import soft_ce_rows


class _HeadSoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, teacher_logits, teacher_rows, teacher_top, row_weights, chunk_rows, kernel):
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        chunk_loss = chunk_soft_ce(kernel)
        row_loss = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        row_correct = torch.empty(h.shape[0], dtype=torch.bool, device=h.device)
        dh = torch.empty_like(h) if need_dh else None
        dw = None
        # Under autocast the weight gradient's products run in its dtype (bf16), as nn.Linear's do: an fp32
        # accumulation in place (addmm_) would run the largest product of the step in fp32.
        low_precision = torch.is_autocast_enabled(h.device.type)
        # The weight in the products' dtype, cast once: autocast caches a parameter's cast, not that of a view of
        # it (weight.t()), and would cast the whole weight again in every chunk.
        w = weight.to(torch.get_autocast_dtype(h.device.type)) if low_precision else weight
        size = chunk_rows or max(h.shape[0], 1)
        for s in range(0, h.shape[0], size):
            rows = slice(s, s + size)
            z = torch.matmul(h[rows], w.t())
            row_loss[rows], row_correct[rows], dz = chunk_loss(
                z, teacher_logits, teacher_rows[rows], teacher_top[rows], row_weights[rows],
                w.dtype if need_dh or need_dw else None)
            if need_dh:
                dh[rows] = torch.matmul(dz, w).to(h.dtype)
            if need_dw and dw is None:
                dw = torch.matmul(dz.t(), h[rows]).float()
            elif need_dw and dw.dtype == dz.dtype and not low_precision:
                dw.addmm_(dz.t(), h[rows])  # accumulated inside the matmul: no [Vd, H] temporary
            elif need_dw:
                dw.add_(torch.matmul(dz.t(), h[rows]))
        ctx.save_for_backward(dh, dw)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(row_loss, row_correct)
        return (row_loss * row_weights).sum(), row_loss, row_correct

    @staticmethod
    def backward(ctx, grad_total, _grad_row_loss, _grad_row_correct):
        dh, dw = ctx.saved_tensors
        return (None if dh is None else dh * grad_total.to(dh.dtype),
                None if dw is None else (dw * grad_total).to(ctx.weight_dtype),
                None, None, None, None, None, None)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def soft_ce_kernel_default(device: torch.device) -> bool:
    """Whether chunks on ``device`` go through the Triton kernel unless told: on CUDA with Triton installed,
    where the elementwise chains run compiled (draft.compile, on by default on a GPU). There the kernel stands in
    for the compiled chain: it reads each logit twice and writes its gradient once where the compiled chain makes
    several passes over the chunk in fp32; draft.compile=false keeps the eager chain, no generated kernel at all."""
    return device.type == "cuda" and fused.compiling() and _triton_installed()


def chunk_soft_ce(kernel: bool):
    """The soft cross-entropy of one chunk, (z, teacher_logits, teacher_rows, top, row_weights, grad_dtype) ->
    (each row's loss, whether its argmax is ``top``, dz): the Triton kernel (draft/soft_ce_kernel.py, reading the
    teacher rows in place) or ``fused.soft_ce_rows`` on the gathered teacher rows (through ``fused.run``)."""
    if kernel:
        from .soft_ce_kernel import soft_ce_rows as rows_in_one_kernel

        return rows_in_one_kernel

    def chain(z, teacher_logits, teacher_rows, top, row_weights, grad_dtype):
        return fused.run(soft_ce_rows, z, teacher_logits.index_select(0, teacher_rows), top, row_weights, grad_dtype)

    return chain


class DraftHead(nn.Linear):
    """The draft's lm_head (a bias-free nn.Linear: same parameters and state-dict key). Called with
    ``teacher`` it returns ``head_soft_cross_entropy`` of its rows, computed as this module's forward so
    that a ZeRO-3 engine gathers the weight for it as for any other call."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor, teacher: tuple | None = None):
        if teacher is None:
            return super().forward(x)
        return head_soft_cross_entropy(x, self.weight, *teacher)


def head_soft_cross_entropy(h: torch.Tensor, weight: torch.Tensor, teacher_logits: torch.Tensor,
                            teacher_rows: torch.Tensor, teacher_top: torch.Tensor, row_weights: torch.Tensor,
                            chunk_rows: int = 512, kernel: bool | None = None,
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For hidden rows h [N, H] (already normed), the lm_head weight [Vd, H], the teacher's logits
    [R, Vd] and, per row of h, its teacher row (``teacher_rows`` [N]), the teacher's full-vocab argmax
    in draft ids (``teacher_top`` [N]) and its weight (``row_weights`` [N]): (sum of weight x soft
    cross-entropy, differentiable; each row's soft cross-entropy [N] and whether its draft argmax is
    the teacher's [N], both detached), ``chunk_rows`` rows at a time (0: all at once), each chunk's loss through
    the Triton kernel where ``kernel`` says (None: ``soft_ce_kernel_default``)."""
    if not torch.is_grad_enabled():  # (an autograd Function is told its inputs need grad even under no_grad)
        h, weight = h.detach(), weight.detach()
    kernel = soft_ce_kernel_default(h.device) if kernel is None else kernel
    return _HeadSoftCrossEntropy.apply(h, weight, teacher_logits, teacher_rows, teacher_top,
                                       row_weights.float(), chunk_rows, kernel)
