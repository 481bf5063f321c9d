"""Causal attention that never holds a [T, T] matrix, and returns its log-sum-exp with a gradient.

Queries go in blocks of ``QUERY_BLOCK`` rows; each block's scores against the keys it may see are
computed, used and dropped, and the backward recomputes them from the saved log-sum-exp (the recipe
of FlashAttention, in plain PyTorch, so that one code path runs on CPU and GPU with any torch).
Memory is linear in T: one block's [B, h, QUERY_BLOCK, T] scores at a time.

PyTorch's fused kernels do not fit here: SDPA returns no log-sum-exp, the private flash ops that do
give it no gradient, and flex attention needs a compile step per shape on CPU. TTT needs the
log-sum-exp with its gradient, to merge each unroll step's same-row keys in exactly (methods/eagle3/ttt.py).
"""

from __future__ import annotations

import torch

from .fused import compute_dtype

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


def _group_rows(x: torch.Tensor, kv_heads: int, s: int, e: int) -> torch.Tensor:
    """Rows s..e-1 of x [B, h, T, ...] as [B, kv_heads, groups * (e - s), ...]: the query heads that share a key
    head stacked as more rows of it, so one product against the shared keys serves them all (no copy of keys)."""
    block = x.unflatten(1, (kv_heads, -1))[:, :, :, s:e]
    return block.reshape(*block.shape[:2], -1, *block.shape[4:])


def _ungroup_rows(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``_group_rows``'s inverse for one block: [B, kv_heads, groups * n, ...] -> [B, kv_heads * groups, n, ...]."""
    return x.unflatten(2, (groups, -1)).flatten(1, 2)


class _CausalAttentionLSE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, q_offset, segments, block):
        Tq, kv_heads = q.shape[-2], k.shape[1]
        groups = q.shape[1] // kv_heads
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        for s in range(0, Tq, block):
            e = min(s + block, Tq)
            end = min(q_offset + e, k.shape[-2])  # later keys are masked for every row of the block
            rows = (torch.arange(s, e, device=q.device) + q_offset).repeat(groups)
            scores = _block_scores(_group_rows(q, kv_heads, s, e), k[:, :, :end], scale, rows, segments)
            block_lse = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - block_lse[..., None]).to(v.dtype)
            lse[:, :, s:e] = _ungroup_rows(block_lse, groups)
            out[:, :, s:e] = _ungroup_rows(torch.matmul(probs, v[:, :, :end]), groups)
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
        kv_heads = k.shape[1]
        groups = q.shape[1] // kv_heads
        g = grad_out.float() if grad_out is not None else torch.zeros_like(out, dtype=torch.float32)
        # d(loss)/d(score) = p * (dp - D): D = rowsum(dO * O), less the log-sum-exp's own gradient (d lse/ds = p)
        D = (g * out.float()).sum(-1)
        if grad_lse is not None:
            D = D - grad_lse.float()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk = torch.zeros_like(k, dtype=torch.float32)
        dv = torch.zeros_like(v, dtype=torch.float32)
        # Under autocast the products run in its dtype, as the forward's (and FlashAttention's backward) do, the
        # softmax and the sums in fp32: a backward runs outside autocast, where they ran in fp32, which a GPU runs
        # at a fraction of bf16's rate. Without autocast, fp32 throughout (once, not per block: copies for bf16).
        qf, kf, vf = (q, k, v) if autocast_on else (q.float(), k.float(), v.float())
        for s in range(0, q.shape[-2], block):
            e = min(s + block, q.shape[-2])
            end = min(q_offset + e, k.shape[-2])
            rows = (torch.arange(s, e, device=q.device) + q_offset).repeat(groups)
            q_rows = _group_rows(q, kv_heads, s, e)
            qb = q_rows if qf is q else _group_rows(qf, kv_heads, s, e)  # (one regrouped copy where they are one)
            gb, kb, vb = _group_rows(g, kv_heads, s, e), kf[:, :, :end], vf[:, :, :end]
            with torch.autocast(device, dtype=autocast_dtype, enabled=autocast_on):
                scores = _block_scores(q_rows, k[:, :, :end], scale, rows, segments)
                probs = torch.exp(scores - _group_rows(lse, kv_heads, s, e)[..., None])
                dv[:, :, :end] += torch.matmul(probs.transpose(-1, -2), gb)
                ds = probs * (torch.matmul(gb, vb.transpose(-1, -2)) - _group_rows(D, kv_heads, s, e)[..., None])
                dq[:, :, s:e] = _ungroup_rows(torch.matmul(ds, kb) * scale, groups)
                dk[:, :, :end] += torch.matmul(ds.transpose(-1, -2), qb) * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def causal_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_offset: int = 0,
                         segments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of queries q [B, h, Tq, d] (rows q_offset..q_offset+Tq-1) over keys and values
    [B, kv, Tk, d], kv dividing h (grouped-query heads: query head i reads key head i // (h / kv)): (output
    [B, h, Tq, d], log-sum-exp of the scores [B, h, Tq] in fp32).
    ``segments`` [B, Tk]: in packed rows a query sees only its own conversation's keys."""
    return _CausalAttentionLSE.apply(q, k, v, scale, q_offset, segments, QUERY_BLOCK)


# ---- the same attention through flex attention (CUDA) -------------------------------------------------
# torch's flex attention runs causal attention as one fused kernel over the visible blocks only, returns the
# log-sum-exp, and (torch >= 2.7) back-propagates through it: the blockwise loop above in one kernel on a GPU.
# It compiles per shape (fixed lengths stay compiled; after a second length torch marks the lengths dynamic)
# and has no backward on CPU, so ``draft.ttt_attention=flex`` is for CUDA devices.
FLEX_BLOCK = 128
_flex_compiled = None


def _flex_attention(device_type: str):
    """Compiled flex attention on CUDA (the fused kernel); on CPU the eager reference, for checks without
    gradients."""
    global _flex_compiled
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda":
        return flex_attention
    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention)
    return _flex_compiled


def _block_ranges(segments: torch.Tensor, start: int, length: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and block of ``FLEX_BLOCK`` rows of ``segments[:, start:start+length]``: (lowest, highest)
    conversation id, the padding past ``length`` repeating the last row's."""
    seg = segments[:, start:start + length]
    pad = blocks * FLEX_BLOCK - length
    seg = torch.cat([seg, seg[:, -1:].expand(-1, pad)], dim=1) if pad else seg
    seg = seg.view(seg.shape[0], blocks, FLEX_BLOCK)
    return seg.amin(-1), seg.amax(-1)


def _sparse(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [B, 1, nq, nk] block pattern as flex attention's (number of blocks per query block, their indices)."""
    counts = visible.sum(-1, dtype=torch.int32)
    order = torch.argsort(visible.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts, order


def _causal(b, h, q, k):
    # (one function for every call: a compiled kernel is reused, where a new closure per call could recompile)
    return q >= k


def causal_block_mask(Tq: int, Tk: int, q_offset: int, segments: torch.Tensor | None, device: torch.device):
    """Flex attention's BlockMask of ``causal_attention_lse``'s pattern, built from block arithmetic (never a
    [Tq, Tk] tensor): a query block attends to the key blocks it can see, those below the diagonal (and, for
    packed rows, inside one conversation) as full blocks that need no mask, the others through the mask."""
    from torch.nn.attention.flex_attention import BlockMask

    nq, nk = -(-Tq // FLEX_BLOCK), -(-Tk // FLEX_BLOCK)
    q_first = torch.arange(nq, device=device) * FLEX_BLOCK + q_offset  # first and last row of each query block
    q_last = (q_first + FLEX_BLOCK - 1).clamp(max=q_offset + Tq - 1)
    k_first = torch.arange(nk, device=device) * FLEX_BLOCK
    k_last = (k_first + FLEX_BLOCK - 1).clamp(max=Tk - 1)
    visible = (k_first[None, :] <= q_last[:, None])[None, None]  # [1, 1, nq, nk]
    full = ((k_last[None, :] <= q_first[:, None]) & (k_last[None, :] - k_first[None, :] == FLEX_BLOCK - 1))[None, None]
    if segments is None:
        mask_mod = _causal if q_offset == 0 else (lambda b, h, q, k: q + q_offset >= k)
    else:
        q_lo, q_hi = _block_ranges(segments, q_offset, Tq, nq)
        k_lo, k_hi = _block_ranges(segments, 0, Tk, nk)
        visible = visible & (k_hi[:, None, :] >= q_lo[:, :, None])[:, None]
        full = full & (k_lo[:, None, :] == q_hi[:, :, None])[:, None]
        # out-of-range rows of a last, short block read a padded id that no real row has
        width = max(nq * FLEX_BLOCK + q_offset, nk * FLEX_BLOCK)
        seg = torch.cat([segments, segments.new_full((segments.shape[0], width - segments.shape[1]), -1)], dim=1)

        def mask_mod(b, h, q, k):
            return (q + q_offset >= k) & (seg[b, q + q_offset] == seg[b, k])
    partial = visible & ~full
    return BlockMask.from_kv_blocks(*_sparse(partial), *_sparse(full), BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(Tq, Tk))


def causal_attention_lse_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                              mask) -> tuple[torch.Tensor, torch.Tensor]:
    """``causal_attention_lse`` through flex attention with ``causal_block_mask``'s ``mask`` of its pattern; keys
    and values may have fewer (grouped) heads."""
    device, dtype = q.device.type, compute_dtype(q)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)  # (one dtype: under autocast rope may return fp32 queries)
    out, lse = _flex_attention(device)(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                                 **_lse_request())
    if not isinstance(lse, torch.Tensor):  # torch >= 2.9: an AuxOutput
        lse = lse.lse
    return out, lse.float()


def _lse_request() -> dict:
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # torch < 2.9
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}
