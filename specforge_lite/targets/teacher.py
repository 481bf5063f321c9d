"""The teacher: the target's distribution over the draft vocabulary, and whether the target's own
choice (the argmax over its full vocabulary) is a token the draft can say at all.

One ``Teacher`` is built once from a target and a draft vocabulary; the online (HF or lean forward)
and offline (store) paths share it, and so do a store's dump and ingest, which record what it says.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .protocol import Captured, Target

# Positions per chunk when the full-vocabulary argmax is needed (never a [T, V] tensor for a whole batch).
_ARGMAX_CHUNK = 256


class LogitHead:
    """An lm_head (all rows, or the draft vocabulary's) with the family's logit transform (Gemma's
    soft-capping): the logits the target's own forward gives for post-final-norm states.

    The one precision policy for target logits: the product and the transform run in the head's dtype, as
    transformers' forward and vLLM compute them (so a near tie rounds as the served model rounds it and the
    teacher's argmax is the server's), then everything that reads them (softmax, argmax, losses) takes
    float32. The teacher and the lean decoder's generation read logits here; evaluation reads the model's
    own forward, which this reproduces bit for bit (tests/test_families.py)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, family, config):
        self.weight, self.bias, self.family, self.config = weight, bias, family, config

    def in_head_dtype(self, h: torch.Tensor) -> torch.Tensor:
        """The logits as the model computes them, in the head's dtype (a float32 copy of them is exact)."""
        # F.linear, as nn.Linear: the same kernel as the model's lm_head, so the same rounding
        return self.family.postprocess_logits(F.linear(h.to(self.weight.dtype), self.weight, self.bias), self.config)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits [..., rows] for post-final-norm states h [..., H]."""
        return self.in_head_dtype(h).float()

    def argmax(self, h: torch.Tensor) -> torch.Tensor:
        """The argmax of ``self(h)`` without its float32 copy (the cast is exact, ties keep the first row)."""
        return self.in_head_dtype(h).argmax(-1)


def logprob_gap(head: LogitHead, final_hidden: torch.Tensor, ids: list[int], theirs: list[float]) -> float:
    """How far, in nats on average, the log-probabilities of ``ids[1:]`` that the post-norm states of ``ids``
    (``final_hidden`` [T, H]) give through ``head`` are from ``theirs`` (a server's ``prompt_logprobs``)."""
    next_ids = torch.tensor(ids[1:], device=final_hidden.device)[:, None]
    ours = torch.log_softmax(head(final_hidden[:-1]), -1).gather(-1, next_ids)[:, 0]
    return float((ours.cpu() - torch.tensor(theirs)).abs().mean())


class Teacher:
    def __init__(self, target: Target, draft_to_target: torch.Tensor, t2d: torch.Tensor):
        rows, bias = target.head_rows(draft_to_target)
        self.target = target
        self.draft_head = LogitHead(rows, bias, target.family, target.config)
        self.t2d = t2d.to(rows.device)
        self.draft_vocab_size = rows.shape[0]
        # read once, as a value: no device sync per batch (and a sizing run on fake tensors can build it)
        self.whole_vocabulary = bool(t2d.all())

    @property
    def device(self) -> torch.device:
        return self.target.device

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Teacher logits over the draft vocabulary (fp32) for post-final-norm states h [..., H]."""
        return self.draft_head(h)

    def in_vocab(self, rows: torch.Tensor) -> torch.Tensor:
        """Whether the target's full-vocabulary argmax lies in the draft vocabulary, for states [N, H]."""
        if self.whole_vocabulary:  # the whole vocabulary: no head to read (nor, when sharded, to gather)
            return torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
        whole = self.target.full_head()  # on every rank, rows or not: gathering a sharded head is collective
        if whole is None:
            raise ValueError("this target keeps only the draft rows of its lm_head; its captures must carry in_vocab")
        head = LogitHead(*whole, self.target.family, self.target.config)
        top = torch.empty(rows.shape[0], dtype=torch.long, device=rows.device)
        for s in range(0, rows.shape[0], _ARGMAX_CHUNK):
            top[s : s + _ARGMAX_CHUNK] = head.argmax(rows[s : s + _ARGMAX_CHUNK])
        return self.t2d[top]

    @torch.no_grad()
    def __call__(self, captured: Captured, needed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher logits over the draft vocabulary [B, T, Vd] and the in-vocabulary flags [B, T], computed
        only where ``needed`` [B, T] (all positions when None): elsewhere the logits are zeros and the flags
        False, which the objective never reads. The logits keep the head's dtype (every reader takes float32 of
        its rows): a bf16 target's are bf16 exactly, and an fp32 copy would double the largest tensor of a long
        row (a 128k-token row: 16 GiB in fp32 at a 32k draft vocabulary)."""
        h = captured.final_hidden
        B, T = h.shape[:2]
        if needed is None:
            needed = torch.ones(B, T, dtype=torch.bool, device=h.device)
        where = needed.nonzero(as_tuple=True)
        if captured.topk is not None:  # store.teacher=topk: every other draft token gets probability 0
            values, ids = captured.topk
            logits = torch.full((B, T, self.draft_vocab_size), float("-inf"), device=values.device)
            logits.scatter_(-1, ids, values)
        else:
            logits = torch.zeros(B, T, self.draft_vocab_size, device=h.device, dtype=self.draft_head.weight.dtype)
            logits[where] = self.draft_head.in_head_dtype(h[where])
        if captured.in_vocab is not None:
            return logits, captured.in_vocab & needed
        in_vocab = torch.zeros(B, T, dtype=torch.bool, device=h.device)
        in_vocab[where] = self.in_vocab(h[where])
        return logits, in_vocab
