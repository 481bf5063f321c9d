"""DFlash 2: DFlash's block draft with local dynamic convolutions around attention and MLP and a low-rank
candidate selector, from the same capture as EAGLE3 (vLLM 0.32's ``DFlash2Qwen3ForCausalLM``, qwen3_dflash2.py).

- **Convolutions.** Every layer convolves the attention's and the MLP's inputs and outputs along the block:
  slot s mixes itself and the ``conv_kernel_size - 1`` slots before it (causal, within its block), channel
  group by channel group, with a kernel ``base_kernel[tap] + delta[s, tap, group]`` whose delta is projected
  from the slot's own state (``kernel_projection``; the input side's and the output side's from one
  projection of the sublayer's input). Both start as the identity, so a fresh DFlash 2 draft is a DFlash draft.
- **Candidate selector.** The draft's top ``selector_top_k`` tokens per slot are rescored with a low-rank
  edge term between the token before and the candidate, <predecessor[prev] * projection(state),
  successor[candidate]>, and a serving engine walks the block left to right taking the best-scoring
  candidate after the one it took (``DFlash2Context``).

The loss is DFlash's token loss plus ``selector_weight`` x the selector's cross-entropy over its candidates
(the teacher's token put in place of the last one where the top-k lacks it; speculators' recipe), both
weighted ``decay ** (j - 1)`` per slot. The selector's codebooks are indexed by token id both for the
previous token (a target id) and for the candidates (draft ids), as vLLM indexes them: a DFlash 2 draft keeps
the whole target vocabulary (whatever draft.draft_vocab_size says). vLLM runs it in its V2 model runner only
(not on its CPU build).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.functional import cross_entropy

from ...draft.objective import UnrollInputs, chunked, token_loss
from ..dflash.model import DFlashContext, DFlashDraft, DFlashLayer, DFlashObjective


def grouped_causal_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [B, S, A, H] (slot s of anchor a's block): out[s] = sum_t (base[t] + delta[s, t, group]) * x[s - t], the
    taps before a block's first slot left out. ``delta`` [B, S, A, taps, groups], ``base`` [taps, H]."""
    B, S, A, H = x.shape
    taps, groups = base.shape[0], H // group_size
    xs = x.unflatten(-1, (groups, group_size))
    out = torch.zeros_like(xs)
    for t in range(min(taps, S)):
        shifted = xs if t == 0 else torch.cat([xs.new_zeros(B, t, A, groups, group_size), xs[:, : S - t]], dim=1)
        out = out + shifted * (base[t].to(xs.dtype).view(groups, group_size) + delta[..., t, :, None])
    return out.flatten(-2)


class GroupedConv(nn.Module):
    """The input and output convolutions of one sublayer, their deltas from one projection of its input."""

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"draft.conv_group_size={group_size} must divide the hidden size {hidden_size}")
        self.taps, self.group_size, self.groups = taps, group_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)

    def identity_(self) -> None:
        """The convolutions as the identity (tap 0 one, the others and every delta zero)."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sublayer's convolved input, the output side's delta)."""
        delta = self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))
        return grouped_causal_conv(x, delta[..., 0, :, :], self.base_kernel[0], self.group_size), delta[..., 1, :, :]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return grouped_causal_conv(y, delta, self.base_kernel[1], self.group_size)


class DFlash2Layer(DFlashLayer):
    def __init__(self, spec):
        super().__init__(spec)
        self.attention_conv = GroupedConv(spec.hidden_size, spec.conv_kernel_size, spec.conv_group_size)
        self.mlp_conv = GroupedConv(spec.hidden_size, spec.conv_kernel_size, spec.conv_group_size)

    def forward(self, h: torch.Tensor, cos, sin, attend) -> torch.Tensor:
        x, delta = self.attention_conv.prepare(self.input_layernorm(h))
        k, v = self.self_attn.keys_values(x, cos, sin)
        attended = self.self_attn.output(attend(self.self_attn.query(x, cos, sin), k, v))
        h = h + self.attention_conv.finish(attended, delta)
        z, delta = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(z), delta)


class CandidateSelector(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int):
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def scores(self, unary: torch.Tensor, normed: torch.Tensor, previous: torch.Tensor,
               candidates: torch.Tensor) -> torch.Tensor:
        """The candidates' scores [N, K]: their unary logits [N, K] plus the edge term from the previous token
        [N] through the slot's normed state [N, H]."""
        projected = self.hidden_projection(normed).to(self.predecessor_codebook.dtype)
        context = self.predecessor_codebook[previous] * projected
        edges = (context[:, None, :] * self.successor_codebook[candidates]).sum(-1)
        return unary + edges.to(unary.dtype)


class DFlash2Draft(DFlashDraft):
    """DFlash's draft with DFlash 2's convolutions (``layers.{i}.attention_conv``/``mlp_conv``) and the
    ``candidate_selector``, vLLM's names."""

    layer_class = DFlash2Layer

    def __init__(self, spec):
        if spec.draft_vocab_size != spec.vocab_size:
            raise ValueError(f"a DFlash 2 draft with a draft vocabulary of {spec.draft_vocab_size} tokens: its "
                             f"selector reads token ids as vLLM does, for which the draft keeps the whole target "
                             f"vocabulary ({spec.vocab_size} tokens)")
        super().__init__(spec)
        self.candidate_selector = CandidateSelector(spec.vocab_size, spec.hidden_size, spec.selector_rank)
        with torch.no_grad():
            for p in (self.candidate_selector.predecessor_codebook, self.candidate_selector.successor_codebook,
                      self.candidate_selector.hidden_projection.weight):
                nn.init.normal_(p, std=0.02)
        for layer in self.layers:  # a fresh DFlash 2 draft computes what the DFlash draft of its weights would
            layer.attention_conv.identity_()
            layer.mlp_conv.identity_()

    def candidates(self, state: torch.Tensor, previous: torch.Tensor,
                   forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the unary logits [N, Vd], the top ``selector_top_k`` candidates [N, K], their selector scores [N, K])
        of slot states [N, H] (pre-norm) after the tokens ``previous`` [N]; ``forced`` [N] (training): a token put
        in the last candidate's place where the top-k lacks it."""
        normed = self.norm(state)
        logits = self.lm_head(normed)
        candidates = logits.topk(self.spec.selector_top_k, dim=-1).indices
        if forced is not None:
            missing = ~(candidates == forced[:, None]).any(-1)
            candidates[:, -1] = torch.where(missing, forced, candidates[:, -1])
        scores = self.candidate_selector.scores(logits.gather(-1, candidates), normed, previous, candidates)
        return logits, candidates, scores


class DFlash2Objective(DFlashObjective):
    """DFlash's anchors and slots, DFlash's token loss, and the selector's cross-entropy (module docstring)."""

    def __init__(self, k: int, decay: float = 0.8, loss: str = "soft_ce", loss_chunk_rows: int | None = None,
                 selector_weight: float = 1.0, compile: bool = False):
        super().__init__(k, decay, loss, loss_chunk_rows, compile)
        self.selector_weight = selector_weight

    @classmethod
    def from_config(cls, draft_cfg, sequence=None) -> "DFlash2Objective":
        return cls(draft_cfg.draft_tokens, draft_cfg.step_loss_decay, draft_cfg.loss, draft_cfg.loss_chunk_rows,
                   draft_cfg.selector_weight, draft_cfg.compile)

    def _score_rows(self, draft, x: UnrollInputs, h, t_rows, teacher_top, weights) -> tuple[torch.Tensor, ...]:
        teacher = x.teacher_logits.flatten(0, 1)
        previous = x.input_ids.flatten()[t_rows]  # the token before the predicted one

        def chunk(h, rows, previous, top, w):
            logits, candidates, scores = draft.candidates(h, previous, forced=top)
            logits = logits.float()
            row_loss = token_loss(self.loss, torch.softmax(teacher.index_select(0, rows).float(), -1), logits)
            target = (candidates == top[:, None]).int().argmax(-1)
            selector = cross_entropy(scores.float(), target, reduction="none")
            return ((row_loss + self.selector_weight * selector) * w).sum(), row_loss.detach(), logits.argmax(-1) == top

        return chunked(chunk, (h, t_rows, previous, teacher_top, weights), self.loss_chunk_rows)


class DFlash2Context(DFlashContext):
    """DFlash 2 drafting, as vLLM's DFlash 2 speculator runs it greedy: one forward over the block [next token,
    k masks], each mask slot's top-k candidates rescored by the selector after the token taken before it, the
    best one taken, left to right. ``confidences``: the taken candidate's share of its slot's scores."""

    @torch.no_grad()
    def propose(self, aux_new: list[torch.Tensor], context: list[int], next_token: int, k: int) -> list[int]:
        states = self.block_states(aux_new, context, next_token, k)[0, 1:, 0]  # the mask slots [k, H]
        previous = torch.tensor([next_token], device=states.device)
        drafted, self.confidences = [], []
        for s in range(k):
            _, candidates, scores = self.draft.candidates(states[s : s + 1], previous)
            best = scores.argmax(-1)
            previous = candidates[0, best]
            drafted.append(int(self.draft.draft_to_target(previous)))
            self.confidences.append(float(torch.softmax(scores.float(), -1)[0, best]))
        return drafted
