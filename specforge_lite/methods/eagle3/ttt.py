"""Training-time test (TTT): the EAGLE3 attention pattern and the unrolled draft forward.

At unroll step k a query at row t (which stands for sequence position t + k) attends to
* the step-0 keys of rows 0..t (causal): the context the target's own states describe, and
* the keys of steps 1..k at row t itself: the draft's own earlier guesses on this chain.
This is exactly what a server's draft KV cache holds when it drafts k tokens after position t.

Packed rows (several conversations in one row) add one rule: a query never sees step-0 keys of another
conversation (``segments``). Tree drafting at evaluation (EAGLE-2) generalises the same-row rule: a tree
node sees the context and the keys of its own ancestors (``TreeCache``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import repeat_kv

from ...draft.attention import causal_attention_lse, causal_attention_lse_flex, causal_block_mask

# blockwise: step-0 attention in query blocks with its log-sum-exp, the same-row keys merged in through it;
# memory linear in T. flex: the same, the step-0 attention one flex-attention kernel (CUDA). dense: the [T, T]
# scores of every step held at once (the reference, and for benchmarks). sdpa: one fused SDPA call per step
# over every step's keys with an explicit [T, (k+1) T] mask (the usual implementation; for benchmarks).
TTT_ATTENTION = ("blockwise", "flex", "dense", "sdpa")


KV = tuple[torch.Tensor, torch.Tensor]


class PerLayer:
    """What a draft of several decoder layers needs of a cache: each layer attends over its own keys. The
    cache object the draft is given is layer 0's; ``layer(i)`` makes (once) and returns layer i's.
    ``context``: per layer, the step-0 keys and values of earlier rows kept from an earlier call (a
    drafting server's KV cache); ``context_kv()`` returns them for the next call."""

    def _init_layers(self, context: list[KV] | None) -> None:
        self._contexts = list(context or [])
        self._layers = [self]

    def _kept(self, i: int) -> KV | None:
        return self._contexts[i] if i < len(self._contexts) else None

    def _new_layer(self, context: KV | None):
        raise NotImplementedError

    def layer(self, i: int):
        while len(self._layers) <= i:
            self._layers.append(self._new_layer(self._kept(len(self._layers))))
        return self._layers[i]

    def context_kv(self) -> list[KV]:
        """Per layer, the step-0 keys and values of every row so far: the ``context`` of the next call."""
        return [c.own_context_kv() for c in self._layers]


class TTTCache(PerLayer):
    """Keys/values per unroll step: step 0 over all rows, later steps only at the query rows.

    ``segments`` [B, T]: which conversation each row belongs to in packed rows (None: one per row).
    ``attention``: one of ``TTT_ATTENTION``.
    ``context``: per draft layer, the step-0 keys and values of earlier rows (``PerLayer``); the first
    step's keys extend them and its queries are the rows after them (``q_offset``)."""

    def __init__(self, segments: torch.Tensor | None = None, attention: str = "blockwise",
                 context: list[KV] | None = None, block_masks: dict | None = None):
        if attention not in TTT_ATTENTION:
            raise ValueError(f"draft.ttt_attention={attention!r}: use one of {TTT_ATTENTION}")
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.segments = segments
        self.attention = attention
        # flex attention's block masks by (query rows, key rows, offset), shared by every layer: every unroll
        # step and layer attends with the same pattern, made once (about sixty small kernels on a GPU each time)
        self._block_masks = {} if block_masks is None else block_masks
        self._init_layers(context)

    def _new_layer(self, context: KV | None) -> "TTTCache":
        return TTTCache(self.segments, self.attention, None if context is None else [context], self._block_masks)

    def block_mask(self, Tq: int, Tk: int, q_offset: int, device: torch.device):
        """Flex attention's block mask of the step-0 keys' pattern for ``Tq`` query rows from ``q_offset``."""
        key = (Tq, Tk, q_offset)
        if key not in self._block_masks:
            self._block_masks[key] = causal_block_mask(Tq, Tk, q_offset, self.segments, device)
        return self._block_masks[key]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if not self.keys:
            k, v = _after(self._kept(0), k, v)
        self.keys.append(k)
        self.values.append(v)

    def own_context_kv(self) -> KV:
        return self.keys[0], self.values[0]

    def truncate(self, steps: int) -> None:
        """Every layer back to its keys of the first ``steps`` unroll steps."""
        for c in self._layers:
            del c.keys[steps:], c.values[steps:]

    def __len__(self) -> int:
        return len(self.keys)

    def attend(self, q: torch.Tensor, q_offset: int, scale: float) -> torch.Tensor:
        way = {"dense": ttt_attention_dense, "sdpa": ttt_attention_sdpa}.get(self.attention, ttt_attention)
        return way(q, self, q_offset, scale)


def _after(kept: tuple[torch.Tensor, torch.Tensor] | None, k: torch.Tensor, v: torch.Tensor):
    """Keys and values ``k``, ``v`` placed after the ``kept`` rows (None: nothing kept)."""
    if kept is None:
        return k, v
    return torch.cat([kept[0], k], dim=-2), torch.cat([kept[1], v], dim=-2)


def ttt_attention(q: torch.Tensor, cache: TTTCache, q_offset: int, scale: float) -> torch.Tensor:
    """q [B, h, Tq, d]; the query rows are rows ``q_offset .. q_offset+Tq-1`` of the step-0 keys.

    Scores against step-0 keys are causal: attention in query blocks (draft/attention.py) that returns
    its log-sum-exp. Each later step contributes one same-row score; with the log-sum-exp standing for
    all step-0 scores, a softmax over [lse, same-row scores] gives the exact weight of the step-0 output
    and of each same-row value, as one softmax over all of them would (``merge_same_row``). Equal to
    ``ttt_attention_dense``.
    """
    if cache.attention == "flex":
        mask = cache.block_mask(q.shape[-2], cache.keys[0].shape[-2], q_offset, q.device)
        out0, lse0 = causal_attention_lse_flex(q, cache.keys[0], cache.values[0], scale, mask)
    else:
        out0, lse0 = causal_attention_lse(q, cache.keys[0], cache.values[0], scale, q_offset, cache.segments)
    if len(cache.keys) == 1:
        return out0
    return merge_same_row(q, out0, lse0, cache.keys[1:], cache.values[1:], scale)


def merge_same_row(q: torch.Tensor, out0: torch.Tensor, lse0: torch.Tensor, keys: list[torch.Tensor],
                   values: list[torch.Tensor], scale: float) -> torch.Tensor:
    """The attention output of queries q [B, h, Tq, d] over the step-0 keys (their output ``out0`` [B, h, Tq, d]
    and log-sum-exp ``lse0`` [B, h, Tq], fp32) and one more key and value per later step at each query's own row
    (``keys``, ``values``: each [B, kv_heads, Tq, d]): softmax([lse0, q . k_1 * scale, ...]) weighs out0, v_1, ...
    """
    return _SameRowMerge.apply(q, out0, lse0, scale, len(keys), *keys, *values)


def _by_row(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, h, Tq, d] as [B, kv_heads, Tq, groups, d] (a copy): each row's query heads of one key head together,
    the operand of one batched product per row."""
    return x.unflatten(1, (kv_heads, -1)).transpose(2, 3).contiguous()


def _rows_stacked(xs: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
    """Per-step tensors [B, kv_heads, Tq, d] as [B, kv_heads, Tq, steps, d]."""
    return torch.stack([x.to(dtype) for x in xs], 3)


def _per_step(x: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """[B, kv_heads, Tq, steps, d] as one contiguous tensor per step, each in its ``like``'s dtype."""
    return [s.to(t.dtype) for s, t in zip(x.permute(3, 0, 1, 2, 4).contiguous().unbind(0), like)]


def _by_head(x: torch.Tensor) -> torch.Tensor:
    """``_by_row``'s layout [B, kv_heads, Tq, groups, ...] back to [B, h, Tq, ...]."""
    return x.transpose(2, 3).flatten(1, 2)


class _SameRowMerge(torch.autograd.Function):
    """``merge_same_row`` as a few batched products over every step's keys at once (per row: its query heads
    against its steps' keys), with a backward of its own: as many kernels at the seventh unroll step as at the
    third. Autograd through a product, weight and sum per step and key ran about six eager ops per key in the
    forward and twice that in the backward, each a kernel and a pass over the queries on a GPU (15 ms of an 8k row's
    step at Llama-3-8B's shape on an H200). Keeps for its backward only what the step-0 attention keeps anyway (queries,
    keys, values, its output) and the fp32 weights [B, h, Tq, 1 + steps]; grouped-query heads read their key
    head's rows, never a copy of the keys per query head."""

    @staticmethod
    def forward(ctx, q, out0, lse0, scale, steps, *kv):
        dtype, kv_heads = q.dtype, kv[0].shape[1]
        scores = _by_row(q, kv_heads) @ _rows_stacked(kv[:steps], dtype).transpose(-1, -2)  # [B, n, Tq, g, s]
        lse = lse0.unflatten(1, (kv_heads, -1)).transpose(2, 3).unsqueeze(-1)
        weights = torch.softmax(torch.cat([lse, scores.float() * scale], -1), -1)  # [B, n, Tq, g, 1 + s]
        w = weights.to(dtype)
        mixed = w[..., 1:] @ _rows_stacked(kv[steps:], dtype)  # [B, n, Tq, g, d]
        out = (w[..., :1].transpose(2, 3) * out0.unflatten(1, (kv_heads, -1)) + mixed.transpose(2, 3)).flatten(1, 2)
        ctx.save_for_backward(q, out0, weights, *kv)
        ctx.scale, ctx.steps, ctx.lse_dtype = scale, steps, lse0.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        q, out0, weights, *kv = ctx.saved_tensors
        dtype, kv_heads, steps = q.dtype, kv[0].shape[1], ctx.steps
        grad, w = grad.to(dtype), weights.to(dtype)
        grad_out0 = (w[..., :1].transpose(2, 3) * grad.unflatten(1, (kv_heads, -1))).flatten(1, 2)
        # The values' side, then the keys': each side's stacked rows and reordered copies are freed before the
        # other's are made (a long row's backward peak is met here).
        g, values = _by_row(grad, kv_heads), _rows_stacked(kv[steps:], dtype)
        grad_w0 = torch.linalg.vecdot(grad, out0).unflatten(1, (kv_heads, -1)).transpose(2, 3).unsqueeze(-1)
        grad_w = torch.cat([grad_w0, g @ values.transpose(-1, -2)], -1).float()
        del values
        grad_values = _per_step(w[..., 1:].transpose(-1, -2) @ g, kv[steps:])
        del g
        grad_logits = weights * (grad_w - (weights * grad_w).sum(-1, keepdim=True))  # softmax's backward
        grad_scores = (grad_logits[..., 1:] * ctx.scale).to(dtype)  # [B, n, Tq, g, s]
        grad_q = _by_head(grad_scores @ _rows_stacked(kv[:steps], dtype))
        grad_keys = _per_step(grad_scores.transpose(-1, -2) @ _by_row(q, kv_heads), kv[:steps])
        return (grad_q, grad_out0, _by_head(grad_logits[..., 0]).to(ctx.lse_dtype), None, None,
                *grad_keys, *grad_values)


def _visible_context(Tq: int, T0: int, q_offset: int, segments: torch.Tensor | None, device) -> torch.Tensor:
    """Which step-0 keys each query row sees: [Tq, T0], or [B, 1, Tq, T0] for packed rows."""
    rows = torch.arange(Tq, device=device) + q_offset
    seen = torch.arange(T0, device=device)[None, :] <= rows[:, None]
    if segments is not None:  # packed rows: another conversation's keys are never visible
        seg_q = segments[:, q_offset : q_offset + Tq]
        seen = (seen & (seg_q[:, :, None] == segments[:, None, :T0]))[:, None]
    return seen


def ttt_attention_dense(q: torch.Tensor, cache: TTTCache, q_offset: int, scale: float) -> torch.Tensor:
    """``ttt_attention`` with every [Tq, T] score matrix held at once (autograd keeps one per step)."""
    groups = q.shape[1] // cache.keys[0].shape[1]
    k0, v0 = repeat_kv(cache.keys[0], groups), repeat_kv(cache.values[0], groups)
    T0, Tq = k0.shape[-2], q.shape[-2]
    scores = torch.matmul(q, k0.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~_visible_context(Tq, T0, q_offset, cache.segments, q.device), float("-inf"))
    extra_k = [repeat_kv(k, groups) for k in cache.keys[1:]]
    extra_v = [repeat_kv(v, groups) for v in cache.values[1:]]
    if extra_k:
        same_row = torch.stack([(q * k).sum(-1) for k in extra_k], dim=-1) * scale  # [B, h, Tq, steps]
        scores = torch.cat([scores, same_row], dim=-1)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs[..., :T0], v0)
    for j, v in enumerate(extra_v):
        out = out + probs[..., T0 + j, None] * v
    return out


def ttt_attention_sdpa(q: torch.Tensor, cache: TTTCache, q_offset: int, scale: float) -> torch.Tensor:
    """``ttt_attention`` as one ``scaled_dot_product_attention`` over the keys of every step, concatenated, with
    the explicit mask of what each query sees: the step-0 pattern, then the query's own row of each later step."""
    k, v = torch.cat(cache.keys, dim=-2), torch.cat(cache.values, dim=-2)
    Tq, T0, steps = q.shape[-2], cache.keys[0].shape[-2], len(cache.keys) - 1
    context = _visible_context(Tq, T0, q_offset, cache.segments, q.device)
    own = torch.eye(Tq, dtype=torch.bool, device=q.device).repeat(1, steps).expand(*context.shape[:-1], -1)
    mask = torch.cat([context, own], dim=-1)
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


class TreeCache(PerLayer):
    """Draft keys while drafting a tree (EAGLE-2): the context's keys, visible to every node, then one key
    per expanded node, visible only to that node and its descendants. A chain is the one-branch tree,
    so a query at depth d sees exactly what the TTT pattern's step d gives it.

    Call ``add_nodes(parents)`` before each ``step`` that feeds new nodes; ``parents[i]`` is the index of
    node i's parent among the nodes added so far, or -1 for a child of the root. ``context``: as for
    ``TTTCache``, per draft layer the kept keys and values of earlier context rows; every layer's cache
    reads the tree's shape from layer 0's (``shape_of``)."""

    def __init__(self, context: list[KV] | None = None, shape_of: "TreeCache | None" = None):
        self._init_layers(context)
        kept = self._kept(0)
        self.context_keys, self.context_values = kept if kept is not None else (None, None)
        self._context_open = True  # the first append extends the context rows
        self.node_keys = self.node_values = None
        self._shape_of = shape_of or self
        self._visible: torch.Tensor | None = None  # [M, M]: visible[i, j] = node j is node i or an ancestor

    def _new_layer(self, context: KV | None) -> "TreeCache":
        return TreeCache(None if context is None else [context], shape_of=self)

    @property
    def visible(self) -> torch.Tensor | None:
        return self._shape_of._visible

    def add_nodes(self, parents: list[int]) -> None:
        m, n = (0 if self.visible is None else self.visible.shape[0]), len(parents)
        visible = torch.zeros(m + n, m + n, dtype=torch.bool)
        if m:
            visible[:m, :m] = self.visible
        for i, p in enumerate(parents):
            if p >= 0:
                visible[m + i, :m] = visible[p, :m]
            visible[m + i, m + i] = True
        self._visible = visible

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._context_open:
            self._context_open = False
            kept = None if self.context_keys is None else (self.context_keys, self.context_values)
            self.context_keys, self.context_values = _after(kept, k, v)
        elif self.node_keys is None:
            self.node_keys, self.node_values = k, v
        else:
            self.node_keys = torch.cat([self.node_keys, k], dim=-2)
            self.node_values = torch.cat([self.node_values, v], dim=-2)
        if self.node_keys is not None and (self.visible is None or self.visible.shape[0] != self.node_keys.shape[-2]):
            raise RuntimeError("TreeCache: call add_nodes(parents) for the nodes of each step before the step")

    def attend(self, q: torch.Tensor, q_offset: int, scale: float) -> torch.Tensor:
        if self.node_keys is None:  # the context pass: plain causal attention
            context = TTTCache()
            context.append(self.context_keys, self.context_values)
            return ttt_attention(q, context, q_offset, scale)
        groups = q.shape[1] // self.context_keys.shape[1]
        k = repeat_kv(torch.cat([self.context_keys, self.node_keys], dim=-2), groups)
        v = repeat_kv(torch.cat([self.context_values, self.node_values], dim=-2), groups)
        Tq, T0 = q.shape[-2], self.context_keys.shape[-2]
        seen = torch.ones(Tq, k.shape[-2], dtype=torch.bool, device=q.device)
        seen[:, T0:] = self.visible[-Tq:].to(q.device)  # the queries are the newest nodes
        scores = (torch.matmul(q, k.transpose(-1, -2)) * scale).masked_fill(~seen, float("-inf"))
        return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)

    def own_context_kv(self) -> KV:
        return self.context_keys, self.context_values


DraftCache = TTTCache | TreeCache
