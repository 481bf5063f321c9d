"""The soft cross-entropy of a chunk of rows (``fused.soft_ce_rows``'s outputs) as one Triton kernel: the draft's
loss on CUDA (draft/head_loss.py chooses it; this module imports Triton, so only that choice imports it).

Our own kernel, not a library's: Liger-Kernel's JSD and KL kernels take student and teacher as log-probabilities
aligned row by row, scale the batch by one normaliser and return the gradient with respect to the log-probabilities
(its fused-linear JSD computes the teacher's logits with a teacher lm_head of its own), and Apple's cut
cross-entropy takes hard labels. None of them reads a teacher row through an index that several TTT steps' rows
share, weights each row, or returns each row's loss and whether its argmax is the teacher's.

One program per row walks the draft vocabulary in blocks of BLOCK columns. The first pass keeps, lane by lane, the
running maximum and rescaled exp-sum of the row's logits z and of its teacher row t (read in place through the
row's index into the teacher's logits: no gathered copy), the teacher-weighted sum of z rescaled along with them,
and the first column holding the lane's largest z; the lanes are merged at the end (torch's argmax: the first
column of the maximum). The second pass reads the row again (still in L2) and writes dz = w * (softmax(z) - p).
Each logit is read twice and its gradient written once, where eager PyTorch makes about thirty fp32 passes over
the chunk. Logits of any float dtype; the math in fp32. sum(p) is 1 here by construction (the eager chain scales
by its rounding of 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Below every finite logit and finite itself: a lane's running maximum starts here, so that rescaling a lane that
# has seen nothing yet is exp(0) x 0 and never exp(-inf - -inf).
_FLOOR = -3.0e38


@triton.jit
def _soft_ce_row(z_ptr, z_row_stride, teacher_ptr, teacher_row_stride, teacher_rows_ptr, weights_ptr,
                 loss_ptr, argmax_ptr, dz_ptr, dz_row_stride, vocab, floor,
                 BLOCK: tl.constexpr, GRAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_row_stride
    t_row = teacher_ptr + tl.load(teacher_rows_ptr + row).to(tl.int64) * teacher_row_stride
    lanes = tl.arange(0, BLOCK)
    z_top = tl.zeros([BLOCK], dtype=tl.float32) + floor
    t_top = tl.zeros([BLOCK], dtype=tl.float32) + floor
    z_sum = tl.zeros([BLOCK], dtype=tl.float32)
    t_sum = tl.zeros([BLOCK], dtype=tl.float32)
    t_dot_z = tl.zeros([BLOCK], dtype=tl.float32)
    top_col = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + lanes
        inside = cols < vocab
        z = tl.load(z_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
        t = tl.load(t_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
        higher = z > z_top  # (strictly: a lane keeps the first column of its maximum)
        top_col = tl.where(higher, cols, top_col)
        z_new = tl.maximum(z_top, z)
        z_sum = z_sum * tl.exp(z_top - z_new) + tl.exp(z - z_new)
        z_top = z_new
        t_new = tl.maximum(t_top, t)
        t_rescale = tl.exp(t_top - t_new)
        t_exp = tl.exp(t - t_new)
        t_sum = t_sum * t_rescale + t_exp
        t_dot_z = t_dot_z * t_rescale + t_exp * tl.where(inside, z, 0.0)  # (t_exp is 0 outside: not 0 x -inf)
        t_top = t_new
    z_peak = tl.max(z_top, axis=0)
    z_lse = z_peak + tl.log(tl.sum(z_sum * tl.exp(z_top - z_peak), axis=0))
    t_peak = tl.max(t_top, axis=0)
    t_lane_scale = tl.exp(t_top - t_peak)
    t_norm = tl.sum(t_sum * t_lane_scale, axis=0)
    t_lse = t_peak + tl.log(t_norm)
    p_dot_z = tl.sum(t_dot_z * t_lane_scale, axis=0) / t_norm
    tl.store(loss_ptr + row, z_lse - p_dot_z)
    tl.store(argmax_ptr + row, tl.min(tl.where(z_top == z_peak, top_col, vocab), axis=0))
    if GRAD:
        weight = tl.load(weights_ptr + row).to(tl.float32)
        dz_row = dz_ptr + row * dz_row_stride
        for start in range(0, vocab, BLOCK):
            cols = start + lanes
            inside = cols < vocab
            z = tl.load(z_row + cols, mask=inside, other=0.0).to(tl.float32)
            t = tl.load(t_row + cols, mask=inside, other=0.0).to(tl.float32)
            dz = weight * (tl.exp(z - z_lse) - tl.exp(t - t_lse))
            tl.store(dz_row + cols, dz.to(dz_ptr.dtype.element_ty), mask=inside)


def block_for(vocab: int) -> int:
    """Columns a program reads at once: the vocabulary's power of two up to 2048 (8 fp32 values a thread for
    each of the first pass's six running vectors, with 8 warps)."""
    return max(16, min(2048, 1 << max(vocab - 1, 0).bit_length()))


def soft_ce_rows(z: torch.Tensor, teacher_logits: torch.Tensor, teacher_rows: torch.Tensor, top: torch.Tensor,
                 row_weights: torch.Tensor, grad_dtype: torch.dtype | None, block: int | None = None):
    """``fused.soft_ce_rows`` of logits z [n, Vd] against the teacher rows ``teacher_logits[teacher_rows]`` (read
    in place), in one kernel: (each row's loss [n] fp32, whether its argmax is ``top`` [n], the gradient of
    sum(row_weights * loss) with respect to z in ``grad_dtype``, None for none). ``block``: columns a program
    reads at once (None: ``block_for``)."""
    n, vocab = z.shape
    loss = torch.empty(n, dtype=torch.float32, device=z.device)
    argmax = torch.empty(n, dtype=torch.int32, device=z.device)
    dz = None if grad_dtype is None else torch.empty(n, vocab, dtype=grad_dtype, device=z.device)
    if n == 0:
        return loss, argmax == top, dz
    z = z if z.stride(-1) == 1 else z.contiguous()  # (the kernel steps along a row one element at a time)
    teacher = teacher_logits if teacher_logits.stride(-1) == 1 else teacher_logits.contiguous()
    block = block or block_for(vocab)
    out = loss if dz is None else dz  # (no gradient: a pointer the kernel never writes through)
    _soft_ce_row[(n,)](z, z.stride(0), teacher, teacher.stride(0), teacher_rows.contiguous(),
                       row_weights.contiguous(), loss, argmax, out, out.stride(0), vocab, _FLOOR,
                       BLOCK=block, GRAD=dz is not None, num_warps=8 if block >= 2048 else 4)
    return loss, argmax == top, dz
