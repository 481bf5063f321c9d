"""What every lean forward shares: unpadding, per-sequence causal attention, rope, and re-padding.

A right-padded batch [B, T] becomes one row of its N real tokens, so no projection or MLP runs on pads
(the bulk of the compute: a batch's padding is pure waste in the HF forward). Attention runs per
sequence with a plain causal (or sliding-window) pattern, which needs no [T, T] mask for full layers.
Only the requested layers' input states and the final-norm state come back, re-padded to [B, T, H].
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def unpad(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None = None):
    """(flat token ids [N], positions [N], per-sequence lengths, flat index of each kept token) for a
    right-padded batch. With ``position_ids`` (packed rows) each conversation is a sequence of its own."""
    B, T = input_ids.shape
    if attention_mask is None:
        lengths = [T] * B
        keep = None
        flat = input_ids.reshape(-1)
    else:
        m = attention_mask.bool()
        if bool((m[:, 1:] & ~m[:, :-1]).any()):
            raise ValueError("the lean backend takes right-padded rows (as the data loader makes them); "
                             "use target.backend=hf for left-padded input")
        lengths = m.sum(1).tolist()
        keep = m.reshape(-1).nonzero(as_tuple=True)[0]
        flat = input_ids.reshape(-1)[keep]
    if position_ids is not None:
        positions = position_ids.reshape(-1) if keep is None else position_ids.reshape(-1)[keep]
        starts = (positions == 0).nonzero(as_tuple=True)[0].tolist() + [positions.numel()]
        lengths = [b - a for a, b in zip(starts[:-1], starts[1:])]
        return flat, positions, lengths, keep
    positions = torch.cat([torch.arange(n, device=input_ids.device) for n in lengths])
    return flat, positions, lengths, keep


def repad(x: torch.Tensor, keep: torch.Tensor | None, B: int, T: int) -> torch.Tensor:
    """[1, N, H] real-token states back to a zero-padded [B, T, H]."""
    if keep is None:
        return x.view(B, T, x.shape[-1])
    out = x.new_zeros(B * T, x.shape[-1])
    out.index_copy_(0, keep, x[0])
    return out.view(B, T, -1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the first cos.shape[-1] channels (partial rotary keeps the rest as is)."""
    rot = cos.shape[-1]
    xr, xp = (x, None) if rot == x.shape[-1] else (x[..., :rot], x[..., rot:])
    x1, x2 = xr.chunk(2, dim=-1)
    out = xr * cos + torch.cat((-x2, x1), dim=-1) * sin
    return out if xp is None else torch.cat((out, xp), dim=-1)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int], scale: float,
                      window: int | None = None) -> torch.Tensor:
    """Causal attention inside each sequence of a packed row. q [1, nh, N, d], k/v [1, nkv, N, d] -> [1, N, nh*d].

    ``window``: a key is visible when ``q_pos - k_pos < window`` (sliding-window layers)."""
    nh, d = q.shape[1], q.shape[-1]
    if k.shape[1] != nh:  # grouped-query: repeat the kv heads (faster than enable_gqa on CPU at long T)
        k = k.repeat_interleave(nh // k.shape[1], dim=1)
        v = v.repeat_interleave(nh // v.shape[1], dim=1)

    def attend(qs, ks, vs, n):
        if window is None or n <= window:
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        i = torch.arange(n, device=qs.device)
        band = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
        return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=band, scale=scale)

    if len(set(lengths)) == 1:  # equal lengths: one batched call
        n, B = lengths[0], len(lengths)
        split = lambda t: t.view(t.shape[1], B, n, d).transpose(0, 1)  # noqa: E731
        out = attend(split(q), split(k), split(v), n)  # [B, nh, n, d]
        return out.transpose(1, 2).reshape(1, B * n, nh * d)
    outs, s = [], 0
    for n in lengths:
        o = attend(q[:, :, s:s + n], k[:, :, s:s + n], v[:, :, s:s + n], n)
        outs.append(o.transpose(1, 2).reshape(1, n, nh * d))
        s += n
    return torch.cat(outs, dim=1)


class LeanForward:
    """Base of the per-family lean forwards: runs ``layer_forward`` over the unpadded batch."""

    def __init__(self, family, model: nn.Module):
        """Over ``model``'s weights in place, its parts found where its family says they are."""
        self.decoder = family.decoder(model)  # (its rotary embedding)
        self.config = family.text_config(model.config)
        self.layers = family.layers(model)
        self.embedding, self.final_norm = family.embedding(model), family.final_norm(model)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embedding.weight)

    def rope(self, h: torch.Tensor, positions: torch.Tensor) -> dict:
        """Position embeddings the layers need, computed once per forward."""
        cos, sin = self.decoder.rotary_emb(h, positions[None])
        return {"default": (cos[:, None], sin[:, None])}

    # A layer is project (norm, q/k/v, rope) -> attention -> finish (output projection, residual, MLP), so
    # that the capture forward (attention per sequence) and the decoder (targets/lean/decode.py: attention
    # over a KV cache) run the same layer code.
    def project(self, i: int, h: torch.Tensor, rope: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i's roped queries [1, nh, N, d], keys and values [1, nkv, N, d] for the states h [1, N, H]."""
        raise NotImplementedError

    def finish(self, i: int, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Layer i's output from its input h [1, N, H] and its attention output [1, N, nh*d]."""
        raise NotImplementedError

    def attention_scale(self, i: int) -> float:
        return self.layers[i].self_attn.scaling

    def window(self, i: int) -> int | None:
        """Layer i's sliding window (a key is visible when q_pos - k_pos < window), or None."""
        return None

    def layer_forward(self, i: int, h: torch.Tensor, rope: dict, lengths: list[int]) -> torch.Tensor:
        q, k, v = self.project(i, h, rope)
        a = segment_attention(q, k, v, lengths, self.attention_scale(i), self.window(i))
        del q, k, v  # (locals would otherwise stay alive through the MLP and raise the peak)
        return self.finish(i, h, a)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 layers_to_output_hidden_states: Sequence[int], position_ids: torch.Tensor | None = None
                 ) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """({layer id: state entering that layer (id L: pre-final-norm)}, post-final-norm state), each [B, T, H].
        ``position_ids``: packed rows, one sequence per conversation."""
        B, T = input_ids.shape
        ids, positions, lengths, keep = unpad(input_ids, attention_mask, position_ids)
        h = self.embed(ids)[None]
        rope = self.rope(h, positions)
        wanted, out = set(layers_to_output_hidden_states), {}
        for i in range(len(self.layers)):
            if i in wanted:
                out[i] = repad(h, keep, B, T)
            h = self.layer_forward(i, h, rope, lengths)
        if len(self.layers) in wanted:
            out[len(self.layers)] = repad(h, keep, B, T)
        return out, repad(self.final_norm(h), keep, B, T)
