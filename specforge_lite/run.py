"""One training run, assembled once: config -> target -> tokenizer -> data -> draft vocabulary -> teacher
and objective.

``Run.online`` runs the target live (train.py, a store's dump or ingest, evaluation, the benchmarks);
the store's constructor, ``offline.store_run``, reads the target's states back from a hidden-state store
into the same object; ``evaluate.finish`` is the end of a run (export, evaluation, served check). Each
stage's own builder is in pipeline.py; this module only puts them together, in one place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import Config
from .data import BatchStream, DraftVocab
from .data.images import image_inputs
from .draft import Draft, Eagle3Objective, build_objective
from .targets import Target, Teacher
from .training.distributed import DistributedContext


@dataclass
class Run:
    config: Config
    target: Target
    vocab: DraftVocab
    train_data: Any  # what the batch stream reads: the prepared training set, or the store's samples
    stats: dict  # written to data_stats.json
    tokenizer: Any = None  # online runs only
    data: Any = None  # data.PreparedData (held-out conversations, prompt sets): online runs only
    ctx: DistributedContext = field(default_factory=DistributedContext)
    # draft.init_from: the draft training continues from, as (spec, weights); None builds a new one
    initial: tuple[Any, dict] | None = None
    teacher: Teacher = field(init=False)
    objective: Eagle3Objective = field(init=False)

    def __post_init__(self):
        self.teacher = Teacher(self.target, self.vocab.draft_to_target, self.vocab.t2d)
        self.objective = build_objective(self.config.draft, self.ctx.sequence_shard())

    # ---- constructors -------------------------------------------------------------------------
    @classmethod
    def online(cls, config: Config, ctx: DistributedContext | None = None, log=print,
               aux_layer_ids: list[int] | None = None, vocab: DraftVocab | None = None,
               parts_only: bool = False) -> "Run":
        """The live target, its tokenizer, the prepared data and the draft vocabulary (``vocab``: one
        given, e.g. an export's; else built from the training data). ``parts_only``: the target's
        embedding, final norm and lm_head only, read from its safetensors (what a store's ingest needs)."""
        from .pipeline import (build_target, build_vocab, describe_precision, initial_draft, load_tokenizer, prepare,
                               target_mismatch)
        from .targets.capture import AuxIdsOutOfRange

        ctx = ctx or DistributedContext()
        initial = initial_draft(config, log) if config.draft.init_from else None
        if initial is not None:  # the draft keeps its own aux ids and vocabulary
            aux_layer_ids, vocab = list(initial[0].aux_layer_ids), DraftVocab.from_d2t(initial[1]["d2t"],
                                                                                     initial[0].vocab_size)
        try:
            target = build_target(config, aux_layer_ids=aux_layer_ids, ctx=ctx, parts_only=parts_only)
        except AuxIdsOutOfRange as e:  # (init_from sets the ids: draft.aux_layer_ids would change nothing)
            if initial is None:
                raise
            raise ValueError(f"draft.init_from={config.draft.init_from} reads aux ids {aux_layer_ids} and model="
                             f"{config.model.name} has {e.num_layers} layers: the draft was made for another target; "
                             "set model= to the target it drafts for") from None
        if initial is not None:  # (before any data is read)
            target_mismatch(initial[0], target, f"draft.init_from={config.draft.init_from}", config.model.name)
        tokenizer = load_tokenizer(target, config.model.chat_template)
        log(f"[target] {config.model.name} from {target.location}: {target.num_layers} layers, hidden "
            f"{target.hidden_size}, vocab {target.vocab_size}, aux ids {target.aux_layer_ids} ({target.convention}) on "
            f"{target.device}/{target.dtype}" + (f"; {ctx.world_size} ranks, target "
            f"{'sharded (ZeRO-3)' if config.target.shard == 'zero3' else 'replicated'}" if ctx.enabled else ""))
        log(f"[precision] {describe_precision(config, target)}")
        # rank 0 prepares (and caches) the data first; the other ranks then read the same cache
        if not ctx.is_main:
            ctx.barrier()
        data = prepare(config, target, tokenizer, log=log)
        if ctx.is_main:
            ctx.barrier()
        if vocab is None:
            vocab = build_vocab(config, target, data.train, tokenizer)
            log(f"[vocab] draft vocabulary {vocab.size} tokens, covering {vocab.coverage:.1%} of training loss tokens")
        return cls(config, target, vocab, data.train, data.stats, tokenizer, data, ctx, initial)

    # ---- what training reads ------------------------------------------------------------------
    def build_draft(self) -> Draft:
        from .pipeline import build_draft, draft_from_weights, frozen_as_configured

        if self.initial is not None:
            return frozen_as_configured(draft_from_weights(*self.initial, self.target), self.config)
        return build_draft(self.config, self.target, self.vocab, self.tokenizer,
                           log=print if self.ctx.is_main else lambda message: None)

    def batches(self) -> BatchStream:
        """This rank's share of every global batch (the ranks of a sequence-parallel group read the same rows)."""
        from .pipeline import packing_length, pad_id

        t = self.config.trainer
        pad = pad_id(self.tokenizer) if self.tokenizer is not None else 0  # pads are masked; never read
        return BatchStream(self.train_data, t.micro_batch_size, pad, t.seed, images=image_inputs(self.target),
                           rank=self.ctx.data_rank, world_size=self.ctx.data_world_size,
                           pack_length=packing_length(self.config, self.target), blocks=self._blocks())

    def _blocks(self) -> list[range] | None:
        """A store's shards, when data.store_order=shard asks to read them one at a time."""
        order = self.config.data.store_order
        if order not in ("global", "shard"):
            raise ValueError(f"data.store_order={order!r}: use global or shard")
        if order == "global" or not hasattr(self.train_data, "shard_ranges"):
            return None
        return self.train_data.shard_ranges()

    def tracker(self, run_dir: Path, step: int):
        from omegaconf import OmegaConf

        from .training.tracking import Tracker

        settings = OmegaConf.to_container(OmegaConf.structured(self.config))
        return Tracker(self.config.tracker, run_dir, settings, resume_step=step)

    def write_stats(self, run_dir: Path) -> None:
        if self.ctx.is_main:
            stats = {**self.stats, "draft_vocab_coverage": self.vocab.coverage}
            (Path(run_dir) / "data_stats.json").write_text(json.dumps(stats, indent=1))
