"""DFlash: a block-diffusion draft that proposes all k tokens in one forward, from the same capture as EAGLE3.

The target's aux states of the committed context are fused (``fc`` over their concatenation, then
``hidden_norm``) into one context state per position; every draft layer projects those into keys and
values (its own ``k_proj``/``v_proj``, ``k_norm``, RoPE at the context's positions) that stand in front of
its own keys. The block is the committed token (the bonus token the target just chose, at position n)
and k mask slots after it (``mask_token_id``, positions n+1..n+k): each slot runs through the Qwen3-style
layers (per-head q/k RMSNorm), attending to every context key and to every slot of its block (no causal
mask inside the block), and slot j is read out as the guess for the token at position n + j.

This is vLLM 0.32's ``DFlashQwen3ForCausalLM`` (served as ``method=dflash``): context keys and values
written from ``hidden_norm(fc(aux))`` without the layer's input norm, queries from the block. Training
takes every position a >= 1 of a row as an anchor at once: anchor a's block sees the context rows < a,
and its slot j is scored against the teacher at row a + j - 1 (which predicts x[a + j]), weighted
``decay ** (j - 1)``. The context attention is the blockwise causal attention of draft/attention.py; the
block's own keys are merged in through its log-sum-exp, as TTT merges its same-row keys.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import repeat_kv

from ...draft import fused
from ...draft.attention import causal_attention_lse
from ...draft.drafting import greedy_with_confidence
from ...draft.model import DraftMLP, DraftRMSNorm, TargetWiredDraft
from ...draft.objective import DraftObjective, ObjectiveOutput, UnrollInputs


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half, as vLLM's neox style) on [..., heads, T, d] with cos/sin [..., T, d]."""
    return fused.run(fused.rotate, x, cos, sin)


class DFlashAttention(nn.Module):
    def __init__(self, spec):
        super().__init__()
        H, d = spec.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_attention_heads, spec.num_key_value_heads, d
        self.q_proj = nn.Linear(H, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, H, bias=False)
        self.q_norm = DraftRMSNorm(d, eps=spec.rms_norm_eps)
        self.k_norm = DraftRMSNorm(d, eps=spec.rms_norm_eps)

    def _heads(self, x: torch.Tensor, proj: nn.Linear, n: int) -> torch.Tensor:
        """[..., T, H] -> [..., n, T, d]."""
        return proj(x).unflatten(-1, (n, self.head_dim)).transpose(-2, -3)

    def keys_values(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values [..., kv_heads, T, d] of states x [..., T, H]."""
        k = _rotate(self.k_norm(self._heads(x, self.k_proj, self.num_kv_heads)), cos, sin)
        return k, self._heads(x, self.v_proj, self.num_kv_heads)

    def query(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        return _rotate(self.q_norm(self._heads(x, self.q_proj, self.num_heads)), cos, sin)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """[..., heads, T, d] -> [..., T, H]."""
        return self.o_proj(out.transpose(-2, -3).flatten(-2))


class DFlashLayer(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.input_layernorm = DraftRMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.self_attn = DFlashAttention(spec)
        self.post_attention_layernorm = DraftRMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.mlp = DraftMLP(spec.llama_config())

    def forward(self, h: torch.Tensor, cos, sin, attend) -> torch.Tensor:
        """The block's states h [B, S, A, H] (slot s of anchor a at position a + s); ``attend(queries, keys,
        values)`` ([B, S, heads, A, d]) gives each slot's attention output."""
        x = self.input_layernorm(h)
        k, v = self.self_attn.keys_values(x, cos, sin)
        h = h + self.self_attn.output(attend(self.self_attn.query(x, cos, sin), k, v))
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(TargetWiredDraft):
    """The DFlash draft, with vLLM's weight names (``fc``, ``hidden_norm``, ``layers.{i}.*``, ``norm``,
    ``lm_head``, ``d2t``); the token embedding is the target's, frozen and shared, as vLLM shares it."""

    layer_class = DFlashLayer  # (DFlash 2's layers add convolutions around attention and MLP)

    def __init__(self, spec):
        super().__init__(spec)
        self.fc = nn.Linear(len(spec.aux_layer_ids) * spec.target_hidden_size, spec.hidden_size, bias=False)
        self.hidden_norm = DraftRMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(spec) for _ in range(spec.num_layers))
        self._finish_build()

    def compute_logits(self, state: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(state))

    def soft_cross_entropy(self, state, teacher_logits, teacher_rows, teacher_top, row_weights, chunk_rows):
        return self.lm_head(self.norm(state), teacher=(teacher_logits, teacher_rows, teacher_top, row_weights,
                                                       chunk_rows))

    # ---- forward pieces -------------------------------------------------------------------------
    def context_states(self, aux: list[torch.Tensor]) -> torch.Tensor:
        """hidden_norm(fc(concatenated aux states)) [B, T, H]: what every layer's context keys are made of."""
        if len(aux) != len(self.spec.aux_layer_ids):
            raise ValueError(f"got {len(aux)} aux states, the draft was built for {len(self.spec.aux_layer_ids)}")
        return self.hidden_norm(self.fc(torch.cat(aux, dim=-1).to(fused.compute_dtype(self.fc.weight))))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values of context states [B, T, H] at ``positions`` [B, T]."""
        cos, sin = self.rotary_emb(context, positions)
        return [layer.self_attn.keys_values(context, cos, sin) for layer in self.layers]

    def block(self, input_ids: torch.Tensor, positions: torch.Tensor, context_kv, attend) -> torch.Tensor:
        """The block's slot states (pre-norm) [B, S, A, H]: ``input_ids``/``positions`` [B, A, S] (every
        anchor's block of S = k + 1 slots); ``attend(context keys/values, queries, keys, values)`` gives each
        slot's attention output in a layer."""
        h = self.embed(input_ids.transpose(1, 2)).to(fused.compute_dtype(self.fc.weight))
        cos, sin = self.rotary_emb(h, positions.transpose(1, 2).flatten(1))
        cos, sin = (t.view(*h.shape[:3], -1) for t in (cos, sin))
        for layer, kv in zip(self.layers, context_kv):
            h = layer(h, cos, sin, lambda q, k, v, kv=kv: attend(kv, q, k, v))
        return h


def block_attention(context_kv, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Every anchor's slots over its context (rows < anchor: query row i stands for anchor i + 1 and sees
    context rows 0..i, causal) and over every slot of its own block. Context keys/values [B, kv, A, d];
    queries [B, S, h, A, d], block keys/values [B, S, kv, A, d]."""
    B, S, h, A, d = q.shape
    kv = k.shape[2]
    # Every slot of every query head that shares key head j reads the same context: stacked as more query heads
    # of j ([B, kv * groups * S, A, d]), they read the context's keys and values as they are, never a copy per
    # slot and query head.
    q_heads = q.unflatten(2, (kv, -1)).permute(0, 2, 3, 1, 4, 5).reshape(B, -1, A, d)
    out0, lse0 = causal_attention_lse(q_heads, *context_kv, scale)
    out0, lse0 = (t.unflatten(1, (kv, -1, S)).movedim(3, 1).flatten(2, 3) for t in (out0, lse0))  # [B, S, h, A, ...]
    qg = q.unflatten(2, (kv, -1))  # [B, S, kv, groups, A, d]
    own = torch.einsum("bskgad,btkad->bskgat", qg, k).flatten(2, 3).float() * scale  # slot s against each slot t
    w = torch.softmax(torch.cat([lse0.unsqueeze(-1), own], dim=-1), dim=-1).to(q.dtype)
    return w[..., :1] * out0 + torch.einsum("bskgat,btkad->bskgad", w[..., 1:].unflatten(2, (kv, -1)), v).flatten(2, 3)


class DFlashObjective(DraftObjective):
    """Every position a >= 1 of a row is an anchor; its block's slot j (1..k) is scored against the
    teacher at row a + j - 1 where x[a + j] carries loss and the teacher's argmax lies in the draft
    vocabulary, each slot's loss the mean over its valid anchors, weighted decay ** (j - 1). The teacher
    is read where every method's is (``teacher_positions``), and the metrics have one step per slot."""

    # The block's layout: slot 0 holds the anchor's own token, the others the mask token; the slots from
    # ``first_scored`` on are read out, slot j predicting x[a + j + 1 - first_scored] (DFlash: the masks
    # predict the tokens at their own positions; DSpark: every slot predicts the token after it).
    first_scored = 1

    def __init__(self, k: int, decay: float = 0.8, loss: str = "soft_ce", loss_chunk_rows: int | None = None,
                 compile: bool = False):
        """``k``: the block's slots that predict a token (its scored steps)."""
        super().__init__(k, decay, loss, loss_chunk_rows=loss_chunk_rows, compile=compile)

    @classmethod
    def from_config(cls, draft_cfg, sequence=None) -> "DFlashObjective":
        return cls(draft_cfg.draft_tokens, draft_cfg.step_loss_decay, draft_cfg.loss, draft_cfg.loss_chunk_rows,
                   draft_cfg.compile)

    def score_steps(self, draft, x: UnrollInputs) -> ObjectiveOutput:
        """Every anchor's block in one forward, each slot that predicts a token scored (the class's docstring)."""
        if x.position_ids is not None:
            raise ValueError(f"a {draft.spec.method} draft trains on unpacked rows: set data.packing=false")
        B, T = x.input_ids.shape
        k, A, device = self.scored_steps, T - 1, x.input_ids.device
        S = k + self.first_scored  # slots per block
        anchors = torch.arange(1, T, device=device)  # anchor a: block at positions a..a+S-1, context rows < a
        spec = draft.spec
        ids = torch.full((B, A, S), spec.mask_token_id, dtype=torch.long, device=device)
        ids[:, :, 0] = x.input_ids[:, 1:]
        positions = (anchors[:, None] + torch.arange(S, device=device)).expand(B, A, S)
        context = draft.context_states([a[:, :A] for a in x.aux])  # rows 0..T-2: every anchor's context
        context_kv = draft.context_kv(context, torch.arange(A, device=device).expand(B, A))
        scale = spec.head_dim ** -0.5
        slots = draft.block(ids, positions, context_kv,
                            lambda ckv, q, kk, vv: block_attention(ckv, q, kk, vv, scale))  # [B, S, A, H]
        teacher_top = x.teacher_logits.argmax(-1).flatten()
        scored, counts = [], []
        for step, j in enumerate(range(self.first_scored, S)):
            target = anchors + j + 1 - self.first_scored  # slot j of anchor a predicts x[target], teacher row - 1
            inside = target < T
            valid = torch.zeros(B, A, dtype=torch.bool, device=device)
            valid[:, inside] = (x.loss_mask[:, target[inside]].bool() & x.in_vocab[:, target[inside] - 1])
            n = valid.sum()
            counts.append((n, n))
            rows = valid.nonzero(as_tuple=True)
            t_rows = rows[0] * T + target[rows[1]] - 1
            weight = (self.decay ** step) / n.clamp(min=1).float()
            scored.append((slots[:, j][rows], t_rows, weight.expand(len(t_rows))))
        h, t_rows, weights = (torch.cat(parts) for parts in zip(*scored))
        total, row_loss, row_correct = self._score_rows(draft, x, h, t_rows, teacher_top[t_rows], weights)
        return self._output(draft, total, row_loss, row_correct, counts, [len(rows) for _, rows, _ in scored])

    def _score_rows(self, draft, x: UnrollInputs, h, t_rows, teacher_top, weights) -> tuple[torch.Tensor, ...]:
        """(weighted loss total, each row's loss, each row's draft argmax == teacher's) of the scored slot states
        ``h`` [N, H] against their rows ``t_rows`` of the flattened teacher [B * T]."""
        return self._scored(draft, h, x.teacher_logits.flatten(0, 1), t_rows, teacher_top, weights)


class DFlashContext:
    """DFlash drafting at serving time: the context's keys and values per layer, kept across rounds (rows
    are added once the target verified them), and one forward over the block [next token, k masks]."""

    one_forward = True

    def __init__(self, draft: DFlashDraft):
        self.draft, self.kept, self.rows = draft, None, 0
        self.confidences: list[float] = []  # the draft's probability of each token of the last proposal

    @torch.no_grad()
    def propose(self, aux_new: list[torch.Tensor], context: list[int], next_token: int, k: int) -> list[int]:
        """k greedy draft tokens after ``context + [next_token]``; ``aux_new``: the aux states of the
        context rows not kept yet."""
        slots = self.block_states(aux_new, context, next_token, k)[0, 1:, 0]  # the mask slots [k, H]
        best, self.confidences = greedy_with_confidence(self.draft.compute_logits(slots))
        return self.draft.draft_to_target(best).tolist()

    def block_states(self, aux_new: list[torch.Tensor], context: list[int], next_token: int,
                     k: int) -> torch.Tensor:
        """The block's slot states [1, k + 1, 1, H] (pre-norm), the new context rows' keys kept."""
        draft, n, device = self.draft, len(context), aux_new[0].device
        new = draft.context_kv(draft.context_states(aux_new), torch.arange(self.rows, n, device=device)[None])
        self.kept = new if self.kept is None else [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                                                   for (k0, v0), (k1, v1) in zip(self.kept, new)]
        self.rows = n
        ids = torch.tensor([[[next_token] + [draft.spec.mask_token_id] * k]], device=device)
        positions = torch.arange(n, n + k + 1, device=device)[None, None]
        scale = draft.spec.head_dim ** -0.5

        def attend(ckv, q, k, v):  # every slot over the whole context and the whole block: one softmax
            groups = q.shape[2] // k.shape[2]
            keys = repeat_kv(torch.cat([ckv[0], k[:, :, :, 0].transpose(1, 2)], dim=2), groups)  # [1, h, n + S, d]
            values = repeat_kv(torch.cat([ckv[1], v[:, :, :, 0].transpose(1, 2)], dim=2), groups)
            scores = (q[:, :, :, 0].transpose(1, 2) @ keys.transpose(-1, -2)).float() * scale  # [1, h, S, n + S]
            out = torch.softmax(scores, -1).to(q.dtype) @ values
            return out.transpose(1, 2).unsqueeze(3)  # [1, S, h, 1, d]

        return draft.block(ids, positions, self.kept, attend)
