"""The training objective every draft method builds on (``UnrollObjective``), in one object built from the draft
config: which teacher positions a batch needs, how the draft's unroll lines up with the teacher, the loss per
token (soft cross-entropy, or draft.loss=acceptance: -log of the expected speculative-sampling acceptance), the
decay over unroll steps, and the metrics (accuracy per step, the simulated acceptance length). Its unroll is the
training-time test (TTT: one draft step per proposed token, EAGLE3's, which a chain draft trains with); a method
that proposes otherwise overrides ``unroll`` in its folder (a block draft: methods/dflash/model.py).

Adding a loss option is a branch in ``token_loss`` and a name in ``LOSSES`` (and the config's comment).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import fused
from .sequence_parallel import SequenceShard, continued_positions, padded_rows
from .ttt import TTT_ATTENTION, TTTCache, shift_left

if TYPE_CHECKING:  # (only named in signatures: the draft stage imports nothing of the target's at run time)
    from ..targets.teacher import Teacher

LOSSES = ("soft_ce", "acceptance", "tv")


@dataclass
class StepStats:
    loss: torch.Tensor  # scalar, this step's loss summed over this rank's rows / valid tokens of the whole rows
    correct: torch.Tensor  # scalar count: draft argmax == teacher argmax (this rank's rows)
    valid: torch.Tensor  # scalar count of valid tokens (this rank's rows)


@dataclass
class TTTOutput:
    loss: torch.Tensor  # weighted sum over steps (what backward() sees)
    steps: list[StepStats]

    def accuracies(self) -> list[float]:
        return [float(s.correct) / max(float(s.valid), 1.0) for s in self.steps]


@dataclass
class UnrollInputs:
    """What one TTT unroll reads, for a batch [B, T]: the target's aux states, the teacher's logits and
    in-vocabulary flags, the tokens and their loss mask, and (packed rows) the positions."""

    aux: list[torch.Tensor]
    input_ids: torch.Tensor
    teacher_logits: torch.Tensor
    in_vocab: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor | None = None


def token_loss(kind: str, teacher_p: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """Per-token loss [N] between the teacher's distribution and the draft's logits.

    soft_ce: -sum_v p_t(v) log p_d(v). acceptance: -log sum_v min(p_t(v), p_d(v)), the log of the
    probability that speculative sampling accepts the draft's token (1 - total variation): zero exactly
    when the two distributions agree, and it spends no effort on the teacher's tail beyond the overlap.
    tv: 1 - sum_v min(p_t(v), p_d(v)), that probability's complement itself (bounded: a hopeless row
    weighs no more than 1, where -log grows without bound)."""
    if kind == "soft_ce":
        return -(teacher_p * torch.log_softmax(draft_logits, dim=-1)).sum(-1)
    if kind in ("acceptance", "tv"):
        accept = torch.minimum(teacher_p, torch.softmax(draft_logits, dim=-1)).sum(-1)
        return -torch.log(accept.clamp_min(1e-6)) if kind == "acceptance" else 1 - accept
    raise ValueError(f"draft.loss={kind!r}: use one of {LOSSES}")


def sim_accepted_drafts(accs: list[float]) -> float:
    """Expected number of accepted draft tokens over every TTT step given: sum over k of prod(acc_0..acc_k).
    Not a served acceptance length: that counts the bonus token (+1) and stops at the served k (it is
    ``1 + sim_accepted_drafts(accs[:k])``), hence the name."""
    total, prod = 0.0, 1.0
    for a in accs:
        prod *= a
        total += prod
    return total


# A step's settings left null take the value of the device it runs on. On a GPU (an H200 at Llama-3.1-8B's shape:
# docs/benchmarks.md) flex attention with the compiled chains was the fastest correct way of the step, 4x blockwise
# and 1.2x flex alone at 8k tokens, in less memory than either, and 4096-row loss chunks ran faster than 512 (each
# chunk adds the lm_head's whole weight gradient once more; small chunks leave the device underused). Elsewhere:
# blockwise attention (flex has no backward on a CPU), eager chains (compiling there needs a C++ compiler), 512 rows.
BY_DEVICE = {"cuda": {"ttt_attention": "flex", "compile": True, "loss_chunk_rows": 4096}}
OTHER_DEVICES = {"ttt_attention": "blockwise", "compile": False, "loss_chunk_rows": 512}


def by_device(name: str, setting, device: torch.device):
    """``setting``, or where it is null, the value of draft.``name`` on ``device``'s kind (``BY_DEVICE``)."""
    return setting if setting is not None else BY_DEVICE.get(device.type, OTHER_DEVICES)[name]


def device_settings(draft_settings, device: torch.device) -> dict[str, tuple]:
    """Each of ``BY_DEVICE``'s settings that ``draft_settings`` has: (its value on ``device``, whether the device
    chose it)."""
    return {n: (by_device(n, getattr(draft_settings, n), device), getattr(draft_settings, n) is None)
            for n in OTHER_DEVICES if hasattr(draft_settings, n)}


def chunk_size(setting: int | None, rows: torch.Tensor) -> int:
    """Rows per loss chunk over ``rows`` [N, ...]: the setting, 0 for all N at once, null for the device's default."""
    return by_device("loss_chunk_rows", setting, rows.device) or max(rows.shape[0], 1)


def chunked(chunk, rows: tuple[torch.Tensor, ...], size: int | None) -> tuple[torch.Tensor, ...]:
    """``chunk(*rows' slices)`` -> (weighted loss, each row's loss, each row's correctness) over ``size`` rows at
    a time (``chunk_size``), each chunk checkpointed when gradients are on (its [chunk, draft_vocab] logits
    recomputed in backward, never kept for all rows); the three summed / concatenated."""
    n = rows[0].shape[0]
    size = chunk_size(size, rows[0])
    parts = []
    for s in range(0, n, size):
        part = tuple(t[s : s + size] for t in rows)
        parts.append(fused.checkpoint(chunk, *part) if torch.is_grad_enabled() else chunk(*part))
    if not parts:
        h = rows[0]
        return h.new_zeros((), dtype=torch.float32), h.new_zeros(0), h.new_zeros(0, dtype=torch.bool)
    return sum(p[0] for p in parts), torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])


class UnrollObjective:
    """The objective of a draft's unrolled steps: the target's capture and the teacher on it, the unroll (the
    TTT unroll here; a method's subclass may replace it), the loss, its decay over steps and the metrics."""

    def __init__(self, ttt_length: int, decay: float = 0.8, loss: str = "soft_ce", attention: str | None = None,
                 loss_chunk_rows: int | None = None, checkpointing: bool = False,
                 sequence: SequenceShard | None = None, compile: bool | None = None):
        """``sequence``: this rank's share of every row under sequence parallelism (draft/sequence_parallel.py);
        None: whole rows. ``attention``, ``compile``, ``loss_chunk_rows`` None: the device's (``BY_DEVICE``)."""
        if ttt_length < 1:
            raise ValueError(f"draft.ttt_length={ttt_length}: unroll at least 1 step")
        if loss not in LOSSES:
            raise ValueError(f"draft.loss={loss!r}: use one of {LOSSES}")
        if attention is not None and attention not in TTT_ATTENTION:
            raise ValueError(f"draft.ttt_attention={attention!r}: use one of {TTT_ATTENTION}")
        self.ttt_length, self.decay, self.loss = ttt_length, decay, loss
        self.attention, self.loss_chunk_rows, self.checkpointing = attention, loss_chunk_rows, checkpointing
        self.sequence = sequence
        self.compile = compile  # the step's elementwise chains as compiled kernels (draft/fused.py)

    @classmethod
    def from_config(cls, draft_cfg, sequence: SequenceShard | None = None) -> "UnrollObjective":
        return cls(draft_cfg.ttt_length, draft_cfg.step_loss_decay, draft_cfg.loss, draft_cfg.ttt_attention,
                   draft_cfg.loss_chunk_rows, draft_cfg.checkpointing, sequence, draft_cfg.compile)

    def __call__(self, draft_forward, teacher: Teacher, batch) -> TTTOutput:
        """One micro-batch: the frozen target's capture and the teacher on it (in the target's own dtype),
        then the draft's unroll through ``draft_forward`` (the draft module, or a training engine's
        forward, so that the engine wraps exactly what is trained)."""
        packed = {} if batch.position_ids is None else {"position_ids": batch.position_ids}
        captured = teacher.target.capture(batch.input_ids, batch.attention_mask, **packed, **batch.inputs)
        logits, in_vocab = teacher(captured, self.teacher_positions(batch.loss_mask))
        inputs = UnrollInputs(captured.aux, batch.input_ids, logits, in_vocab, batch.loss_mask, batch.position_ids)
        return draft_forward(inputs, self)

    @staticmethod
    def teacher_positions(loss_mask: torch.Tensor) -> torch.Tensor:
        """Where the teacher is read: position j, where x[j+1] carries loss (see ``unroll``'s alignment)."""
        return shift_left(loss_mask, 1).bool()

    def unroll(self, draft, x: UnrollInputs) -> TTTOutput:
        """Unroll the draft ``ttt_length`` steps over a batch and score every step.

        Alignment (step k, row t): input token x[t+1+k] at position t+k, hidden = fused aux state h[t] at
        k=0 and the previous step's output state after (``Eagle3Draft.step``: pre-norm, or normed with
        ``norm_output``; a parallel draft reads its mask slot instead, methods/eagle3/parallel.py); the teacher is
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
        # (training steps only: an evaluation under no_grad would compile graphs of its own for a few batches)
        compile = by_device("compile", self.compile, x.input_ids.device)
        with fused.compiled(compile and torch.is_grad_enabled()):
            return self._unroll(draft, x)

    def _unroll(self, draft, x: UnrollInputs) -> TTTOutput:
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
        attention = by_device("ttt_attention", self.attention, x.input_ids.device)
        cache = (TTTCache(segments, attention) if self.sequence is None else self.sequence.cache(segments, attention))
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
        steps, start = [], 0
        for (n, mine), size in zip(counts, sizes):
            end = start + size
            steps.append(StepStats(row_loss[start:end].sum() / n.clamp(min=1), row_correct[start:end].sum(), mine))
            start = end
        if h.shape[0] == 0:
            # No token to score in this micro-batch (e.g. the target's answers all fall outside the draft
            # vocabulary): a zero loss that still reaches every trainable weight, so backward() runs and,
            # under data parallelism, every rank takes part in the gradient reduction.
            total = total.detach() + sum((p * 0).sum() for p in draft.parameters() if p.requires_grad)
        return TTTOutput(total, steps)

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

    def _scored(self, draft, hidden: torch.Tensor, teacher_logits: torch.Tensor, teacher_rows: torch.Tensor,
                teacher_top: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(weighted loss total, each row's loss, each row's draft argmax == teacher's) for the pre-norm rows
        [N, H] of all steps against their rows of the flattened teacher logits [B * T, Vd], in chunks of
        ``loss_chunk_rows`` rows whose [chunk, draft_vocab] logits are never kept for all N: soft_ce through
        the fused lm_head + loss (draft/head_loss.py), the other losses in checkpointed chunks (recomputed
        in backward)."""
        size = chunk_size(self.loss_chunk_rows, hidden)
        if self.loss == "soft_ce":
            return draft.soft_cross_entropy(hidden, teacher_logits, teacher_rows, teacher_top, weights, size)

        def chunk(h, rows, top, w):
            logits = draft.compute_logits(h).float()
            target_p = torch.softmax(teacher_logits.index_select(0, rows).float(), dim=-1)
            row_loss = token_loss(self.loss, target_p, logits)
            return (row_loss * w).sum(), row_loss.detach(), logits.argmax(-1) == top

        return chunked(chunk, (hidden, teacher_rows, teacher_top, weights), size)

    # ---- metrics ------------------------------------------------------------------------------
    def tally(self) -> "Tally":
        return Tally(self.ttt_length)


class Tally:
    """Sums over micro-batches (and, by the caller's all-reduce of ``sums``, over ranks):
    [loss, tokens, correct per step..., valid per step...]."""

    def __init__(self, ttt_length: int):
        self.k = ttt_length
        self.sums = torch.zeros(2 + 2 * ttt_length, dtype=torch.float64)

    def add(self, out: TTTOutput, tokens: int = 0, loss_divisor: int = 1) -> None:
        self.sums[0] += float(out.loss.detach()) / loss_divisor
        self.sums[1] += tokens
        self.sums[2 : 2 + self.k] += torch.stack([s.correct for s in out.steps]).double().cpu()
        self.sums[2 + self.k :] += torch.stack([s.valid for s in out.steps]).double().cpu()

    @property
    def tokens(self) -> int:
        return int(self.sums[1])

    @property
    def scored(self) -> int:
        """Tokens scored at the first unroll step."""
        return int(self.sums[2 + self.k])

    def accuracies(self) -> list[float]:
        return (self.sums[2 : 2 + self.k] / self.sums[2 + self.k :].clamp(min=1)).tolist()

    def metrics(self, ranks: int = 1) -> dict:
        """The logged figures: mean loss per rank, accuracy per step, simulated acceptance length."""
        accs = self.accuracies()
        return {"loss": float(self.sums[0]) / ranks, **{f"acc_{i}": a for i, a in enumerate(accs)},
                "sim_accepted_drafts": sim_accepted_drafts(accs)}
