"""Causal attention that never holds a [T, T] matrix, and returns its log-sum-exp with a gradient.

Queries go in blocks of ``QUERY_BLOCK`` rows; each block's scores against the keys it may see are
computed, used and dropped, and the backward recomputes them from the saved log-sum-exp (the recipe
of FlashAttention, in plain PyTorch, so that one code path runs on CPU and GPU with any torch).
Memory is linear in T: one block's [B, h, QUERY_BLOCK, T] scores at a time.

PyTorch's fused kernels do not fit here: SDPA returns no log-sum-exp, the private flash ops that do
give it no gradient, and flex attention needs a compile step per shape on CPU. TTT needs the
log-sum-exp with its gradient, to merge each unroll step's same-row keys in exactly (draft/ttt.py).
"""

from __future__ import annotations

import torch

QUERY_BLOCK = 128


def _block_scores(q: torch.Tensor, k: torch.Tensor, scale: float, rows: torch.Tensor,
                  segments: torch.Tensor | None) -> torch.Tensor:
    """fp32 scores [B, h, Bq, Tk] of query rows ``rows`` (absolute row numbers) against keys 0..Tk-1, -inf
    where a key lies after its query or (``segments`` [B, T]: packed rows) in another conversation."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    cols = torch.arange(k.shape[-2], device=q.device)
    masked = cols[None, :] > rows[:, None]  # [Bq, Tk]
    if segments is not None:
        seg_q, seg_k = segments[:, rows], segments[:, : k.shape[-2]]
        masked = (masked | (seg_q[:, :, None] != seg_k[:, None, :]))[:, None]  # [B, 1, Bq, Tk]
    return scores.masked_fill(masked, float("-inf"))


class _CausalAttentionLSE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, q_offset, segments, block):
        Tq = q.shape[-2]
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        for s in range(0, Tq, block):
            e = min(s + block, Tq)
            end = min(q_offset + e, k.shape[-2])  # later keys are masked for every row of the block
            rows = torch.arange(s, e, device=q.device) + q_offset
            scores = _block_scores(q[:, :, s:e], k[:, :, :end], scale, rows, segments)
            lse[:, :, s:e] = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - lse[:, :, s:e, None]).to(v.dtype)
            out[:, :, s:e] = torch.matmul(probs, v[:, :, :end])
        ctx.save_for_backward(q, k, v, out, lse, segments)
        ctx.scale, ctx.q_offset, ctx.block = scale, q_offset, block
        # The backward recomputes the scores as the forward computed them: under bf16 autocast the forward's
        # matmul cast q and k to one dtype, which they need not share (with norm_output a later step's queries
        # come from an fp32 norm, the step-0 keys from bf16 projections).
        device = q.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, segments = ctx.saved_tensors
        scale, q_offset, block = ctx.scale, ctx.q_offset, ctx.block
        device, autocast_on, autocast_dtype = ctx.autocast
        g = grad_out.float() if grad_out is not None else torch.zeros_like(out, dtype=torch.float32)
        # d(loss)/d(score) = p * (dp - D): D = rowsum(dO * O), less the log-sum-exp's own gradient (d lse/ds = p)
        D = (g * out.float()).sum(-1)
        if grad_lse is not None:
            D = D - grad_lse.float()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk = torch.zeros_like(k, dtype=torch.float32)
        dv = torch.zeros_like(v, dtype=torch.float32)
        kf, vf = k.float(), v.float()  # (once, not per block: for bf16 inputs each is a copy)
        for s in range(0, q.shape[-2], block):
            e = min(s + block, q.shape[-2])
            end = min(q_offset + e, k.shape[-2])
            rows = torch.arange(s, e, device=q.device) + q_offset
            qb, kb, vb, gb = q[:, :, s:e].float(), kf[:, :, :end], vf[:, :, :end], g[:, :, s:e]
            with torch.autocast(device, dtype=autocast_dtype, enabled=autocast_on):
                scores = _block_scores(q[:, :, s:e], k[:, :, :end], scale, rows, segments)
            probs = torch.exp(scores - lse[:, :, s:e, None])
            dv[:, :, :end] += torch.matmul(probs.transpose(-1, -2), gb)
            ds = probs * (torch.matmul(gb, vb.transpose(-1, -2)) - D[:, :, s:e, None])
            dq[:, :, s:e] = torch.matmul(ds, kb) * scale
            dk[:, :, :end] += torch.matmul(ds.transpose(-1, -2), qb) * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def causal_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_offset: int = 0,
                         segments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of queries q [B, h, Tq, d] (rows q_offset..q_offset+Tq-1) over keys and values
    [B, h, Tk, d] of the same heads: (output [B, h, Tq, d], log-sum-exp of the scores [B, h, Tq] in fp32).
    ``segments`` [B, Tk]: in packed rows a query sees only its own conversation's keys."""
    return _CausalAttentionLSE.apply(q, k, v, scale, q_offset, segments, QUERY_BLOCK)
