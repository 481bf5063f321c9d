"""EAGLE3's objective (``TTTObjective``): the training-time test (TTT), one draft step per proposed token, each step
fed the draft's own state of the step before (or, P-EAGLE, a mask slot: parallel.py), on draft/objective.py's
``DraftObjective`` (the capture and the teacher, the loss in chunks, the tallies, the device's step settings). Its
own settings: the unroll's depth (draft.ttt_length), its attention (draft.ttt_attention), recomputing each step in
backward (draft.checkpointing), and a rank's share of each row under sequence parallelism.
"""

from __future__ import annotations

import torch

from ...draft import fused
from ...draft.objective import STEP_DEFAULTS, DraftObjective, ObjectiveOutput, UnrollInputs, shift_left
from ...draft.sequence_parallel import SequenceShard, continued_positions, padded_rows
from .ttt import TTT_ATTENTION, TTTCache
from .ulysses import UlyssesCache


class TTTObjective(DraftObjective):
    """The TTT unroll's objective: ``ttt_length`` steps, step k scored against the teacher k positions on, its loss
    weighted ``decay ** k``."""

    # On a GPU (an H200 at Llama-3.1-8B's shape: docs/benchmarks.md) flex attention with the compiled chains was the
    # fastest correct way of the step, 4x blockwise and 1.2x flex alone at 8k tokens, in less memory than either;
    # elsewhere blockwise (flex has no backward on a CPU).
    device_defaults = STEP_DEFAULTS.joined(cuda={"ttt_attention": "flex"}, other={"ttt_attention": "blockwise"})

    def __init__(self, ttt_length: int, decay: float = 0.8, loss: str = "soft_ce", attention: str | None = None,
                 loss_chunk_rows: int | None = None, checkpointing: bool = False,
                 sequence: SequenceShard | None = None, compile: bool | None = None):
        """``sequence``: this rank's share of every row under sequence parallelism (draft/sequence_parallel.py);
        None: whole rows. ``attention``, ``compile``, ``loss_chunk_rows`` None: the device's (``device_defaults``)."""
        if ttt_length < 1:
            raise ValueError(f"draft.ttt_length={ttt_length}: unroll at least 1 step")
        super().__init__(ttt_length, decay, loss, loss_chunk_rows, compile)
        if attention is not None and attention not in TTT_ATTENTION:
            raise ValueError(f"draft.ttt_attention={attention!r}: use one of {TTT_ATTENTION}")
        self.ttt_length, self.attention, self.checkpointing = ttt_length, attention, checkpointing
        self.sequence = sequence

    @classmethod
    def from_config(cls, draft_cfg, sequence: SequenceShard | None = None) -> "TTTObjective":
        return cls(draft_cfg.ttt_length, draft_cfg.step_loss_decay, draft_cfg.loss, draft_cfg.ttt_attention,
                   draft_cfg.loss_chunk_rows, draft_cfg.checkpointing, sequence, draft_cfg.compile)

    def score_steps(self, draft, x: UnrollInputs) -> ObjectiveOutput:
        """Unroll the draft ``ttt_length`` steps over a batch and score every step.

        Alignment (step k, row t): input token x[t+1+k] at position t+k, hidden = fused aux state h[t] at
        k=0 and the previous step's output state after (``Eagle3Draft.step``: pre-norm, or normed with
        ``norm_output``; a parallel draft reads its mask slot instead, parallel.py); the teacher is
        the target's distribution at position t+1+k (which predicts x[t+2+k]); the row counts only if
        x[t+2+k] is an assistant token (mask aligned with the predicted token) and the target's full-vocab
        argmax lies in the draft vocab.
        Each step's loss is normalised over its valid tokens; step k is weighted decay**k.

        The normaliser is this micro-batch's count, not the global batch's (all micro-batches of an
        accumulation and all data-parallel ranks), as in SpecForge and EAGLE: which positions count depends
        on the target's argmax, known only after each micro-batch's capture, so a global count before the
        first backward would take a second target pass or every micro-batch's graph held at once. The
        step then averages per-micro-batch means (the engines divide by the accumulation, ranks average):
        the global token mean exactly when micro-batches score equally many tokens, and otherwise a
        weighting by micro-batch rather than by token.

        ``position_ids`` (packed rows): positions restart at 0 where a conversation starts. The draft then
        attends only within a conversation and a row counts only if the token it predicts is in its own
        conversation, so the loss equals that of the same conversations unpacked.

        Under sequence parallelism (``self.sequence``) the draft runs on this rank's rows [lo, hi) only;
        the masks and the normaliser are computed over whole rows, which every rank holds.
        """
        B, T = x.input_ids.shape
        lo, hi, Tp = 0, T, T
        if self.sequence is not None:  # rows padded to an even split; the padding is never valid (loss mask 0)
            Tp = self.sequence.padded_length(T)
            lo, hi = self.sequence.bounds(T)
        if x.position_ids is None:
            positions, segments = torch.arange(Tp, device=x.input_ids.device).unsqueeze(0).expand(B, Tp), None
        else:
            positions = continued_positions(x.position_ids, Tp)
            segments = (positions == 0).long().cumsum(-1)  # 1, 2, ... per conversation; 0 never occurs
        teacher_top = x.teacher_logits.argmax(-1)
        attention = self.device_defaults.value("ttt_attention", self.attention, x.input_ids.device)
        cache = TTTCache(segments, attention)
        if self.sequence is not None:  # every row of this rank's heads, through the group's all-to-all
            cache = UlyssesCache(cache, self.sequence)
        input_ids, loss_mask, in_vocab = (padded_rows(t, Tp) for t in (x.input_ids, x.loss_mask, x.in_vocab))
        scored_whole, scored_mine, rows = self._scored_rows(loss_mask, in_vocab, segments, lo, hi)
        hidden = draft.project_aux([padded_rows(a, Tp)[:, lo:hi] for a in x.aux])
        # Under autocast the lm_head reads its rows in the autocast dtype: they are gathered in it, halving the
        # loss's largest input (every step's rows at once: 14 GiB in fp32 for a 128k-token row at hidden 4096).
        device = x.input_ids.device.type
        rows_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        scored: list[tuple[torch.Tensor, ...]] = []  # per step: its valid rows, their teacher rows, weight
        counts = []  # per step: (valid over whole rows, this rank's valid)
        for k in range(self.ttt_length):
            step_ids = shift_left(input_ids, 1 + k)[:, lo:hi]
            if k:  # the next token and this state (EAGLE3), or a parallel draft's mask slot
                step_ids, hidden = draft.next_step_inputs(step_ids, hidden)
            hidden = self._step(draft, step_ids, hidden, (positions + k)[:, lo:hi], cache)
            n = scored_whole[k]  # over whole rows: every rank of a sequence-parallel group divides by the same count
            counts.append((n, scored_mine[k]))
            t_rows = rows[k][0] * T + rows[k][1] + lo + 1 + k  # teacher rows (of the [B * T] flattened teacher)
            weight = (self.decay ** k) / n.clamp(min=1).float()
            scored.append((hidden[rows[k]] if rows_dtype is None else hidden[rows[k]].to(rows_dtype), t_rows,
                           weight.expand(len(t_rows))))
        h, t_rows, weights = (torch.cat(parts) for parts in zip(*scored))
        sizes = [len(teacher_rows) for _, teacher_rows, _ in scored]
        del scored  # (each step's rows are in h now: not held twice through the loss)
        teacher = x.teacher_logits.flatten(0, 1)
        total, row_loss, row_correct = self._scored(draft, h, teacher, t_rows, teacher_top.flatten()[t_rows], weights)
        return self._output(draft, total, row_loss, row_correct, counts, sizes)

    def _scored_rows(self, loss_mask: torch.Tensor, in_vocab: torch.Tensor, segments: torch.Tensor | None, lo: int,
                     hi: int) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Per unroll step k: how many rows it scores over whole rows [K] and in this rank's rows [lo, hi) [K], and
        the (batch, row) indices of this rank's scored rows. Step k scores row t where the token it predicts (t + 2
        + k) is in the loss mask, its teacher's argmax (t + 1 + k) in the draft vocabulary, and, in packed rows, the
        predicted token in t's own conversation. All steps' rows are found before the unroll: finding them
        makes the host wait for the device (a nonzero's count), and a wait at every step would let the device idle
        while the host queues each next step's first kernels."""
        valid = []
        for k in range(self.ttt_length):
            step = shift_left(loss_mask, 2 + k).bool() & shift_left(in_vocab, 1 + k)
            if segments is not None:
                step &= shift_left(segments, 2 + k) == segments
            valid.append(step)
        valid = torch.stack(valid)  # [K, B, T]
        mine = valid[:, :, lo:hi]
        # (a nonzero per step, back to back: after the first wait the device has nothing queued to wait for)
        return valid.sum((1, 2)), mine.sum((1, 2)), [step.nonzero(as_tuple=True) for step in mine]

    def _step(self, draft, input_ids, hidden, positions, cache: TTTCache) -> torch.Tensor:
        """One unroll step, or (draft.checkpointing) one whose activations are recomputed in backward."""
        if not (self.checkpointing and torch.is_grad_enabled()):
            return draft.step(input_ids, hidden, positions, cache)
        before = len(cache)

        def run(ids, h, pos):
            # A recomputation in backward finds the later steps' keys in the cache: it must see only the
            # keys this step saw in the forward, so the cache (every draft layer's) is cut back to them first.
            cache.truncate(before)
            return draft.step(ids, h, pos, cache)

        return fused.checkpoint(run, input_ids, hidden, positions)
