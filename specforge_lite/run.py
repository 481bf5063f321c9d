"""One training run, assembled once: config -> target -> tokenizer -> data -> draft vocabulary -> teacher and
objective, and the draft it trains.

``Run.online`` runs the target live (train.py, a store's dump or ingest, the benchmarks); ``offline.store_run``
reads the target's states back from a hidden-state store into the same object. Each stage builds its own part
(targets.build_target, generation.prepare_with_target, ...); what only a run needs of them is built here: the
precision it trains in, the draft vocabulary, the packed row length, the draft (new, or continued from
draft.init_from). The end of a run (export, evaluation, served check) is job.finish.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .config import Config
from .data import BatchStream, DraftVocab, build_draft_vocab, pad_id
from .data.prepare import check_rows
from .data.images import image_inputs
from .data.vocab import choose_mask_token
from .device import dtype_name, native_bf16, resolve_device, resolve_dtype
from .draft import Draft, DraftObjective, DraftSpec
from .draft.method import DraftMethod
from .export import load_export
from .export.for_target import draft_from_weights, target_mismatch
from .generation import prepare_with_target
from .methods import draft_method, draft_vocab_size, fixed_fields, shape_settings
from .targets import (Target, Teacher, build_target, describe_target, load_tokenizer, target_identity,
                      tokenizer_before_target)
from .hub import DRAFT_FILES, local_or_hub
from .targets.acquire import resolve_model_dir
from .targets.capture import AuxIdsOutOfRange
from .training.distributed import DistributedContext, use_bf16
from .training.tracking import Tracker


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
    method: DraftMethod = field(init=False)  # the method of the draft settings (draft=<name>), asked once
    teacher: Teacher = field(init=False)
    objective: DraftObjective = field(init=False)

    def __post_init__(self):
        self.method = draft_method(self.config.draft.method)
        self.teacher = Teacher(self.target, self.vocab.draft_to_target, self.vocab.t2d)
        self.objective = self.method.objective.from_config(self.config.draft, self.ctx.sequence_shard())

    # ---- constructors -------------------------------------------------------------------------
    @classmethod
    def online(cls, config: Config, ctx: DistributedContext | None = None, log=print,
               aux_layer_ids: list[int] | None = None, vocab: DraftVocab | None = None,
               parts_only: bool = False) -> "Run":
        """The live target, its tokenizer, the prepared data and the draft vocabulary (``vocab``: one
        given, e.g. an export's; else built from the training data). ``parts_only``: the target's
        embedding, final norm and lm_head only, read from its safetensors (what a store's ingest needs)."""
        ctx = ctx or DistributedContext()
        allocator = use_expandable_segments(config.model.device)  # (before anything allocates on CUDA)
        initial = initial_draft(config, log) if config.draft.init_from else None
        if initial is not None:  # the draft keeps its own aux ids and vocabulary
            aux_layer_ids, vocab = list(initial[0].aux_layer_ids), DraftVocab.from_d2t(initial[1]["d2t"],
                                                                                     initial[0].vocab_size)
        if ctx.is_main:  # (rank 0 prepares the data: a file it cannot train on stops the run before any weight loads)
            check_rows(config.data, tokenizer_before_target(config), log)
        try:
            target = build_target(config, aux_layer_ids=aux_layer_ids, ctx=ctx, parts_only=parts_only, log=log)
        except AuxIdsOutOfRange as e:  # (init_from sets the ids: draft.aux_layer_ids would change nothing)
            if initial is None:
                raise
            raise ValueError(f"draft.init_from={config.draft.init_from} reads aux ids {aux_layer_ids} and model="
                             f"{config.model.name} has {e.num_layers} layers: the draft was made for another target; "
                             "set model= to the target it drafts for") from None
        if initial is not None:  # (before any data is read)
            target_mismatch(initial[0], target, f"draft.init_from={config.draft.init_from}", config.model.name)
        tokenizer = load_tokenizer(target, config.model.chat_template)
        log(f"[target] {describe_target(config, target)}" + (f"; {ctx.world_size} ranks, target "
            f"{'sharded (ZeRO-3)' if config.target.shard == 'zero3' else 'replicated'}" if ctx.enabled else ""))
        log(f"[precision] {describe_precision(config, target)}")
        log(f"[step] {describe_step(config.draft, target.device, allocator)}")
        # rank 0 prepares (and caches) the data first; the other ranks then read the same cache
        if not ctx.is_main:
            ctx.barrier()
        data = prepare_with_target(config, target, tokenizer, log=log)
        if ctx.is_main:
            ctx.barrier()
        if vocab is None:
            vocab = build_vocab(config, target, data.train, tokenizer)
            log(f"[vocab] draft vocabulary {vocab.size} tokens, covering {vocab.coverage:.1%} of training loss tokens")
        return cls(config, target, vocab, data.train, data.stats, tokenizer, data, ctx, initial)

    # ---- what training reads ------------------------------------------------------------------
    def build_draft(self) -> Draft:
        if self.initial is not None:
            return frozen_as_configured(draft_from_weights(*self.initial, self.target), self.config)
        return build_draft(self.config, self.target, self.vocab, self.tokenizer,
                           log=print if self.ctx.is_main else lambda message: None)

    def batches(self) -> BatchStream:
        """This rank's share of every global batch (the ranks of a sequence-parallel group read the same rows)."""
        t = self.config.trainer
        pad = pad_id(self.tokenizer) if self.tokenizer is not None else 0  # pads are masked; never read
        return BatchStream(self.train_data, t.micro_batch_size, pad, t.seed, images=image_inputs(self.target),
                           rank=self.ctx.data_rank, world_size=self.ctx.data_world_size,
                           pack_length=packing_length(self.config, self.target), blocks=self._blocks(),
                           token_budget=t.micro_batch_tokens)

    def _blocks(self) -> list[range] | None:
        """A store's shards, when data.store_order=shard asks to read them one at a time."""
        order = self.config.data.store_order
        if order == "global" or not hasattr(self.train_data, "shard_ranges"):
            return None
        return self.train_data.shard_ranges()

    def provenance(self) -> dict:
        """What the run trained from, as loaded: the target (``target_identity``) and the draft's start."""
        return {"target": target_identity(self.config, self.target),
                "draft_from": self.config.draft.init_from or "a new draft"}

    def tracker(self, run_dir: Path, step: int):
        from omegaconf import OmegaConf

        settings = {**OmegaConf.to_container(OmegaConf.structured(self.config), enum_to_str=True),  # (plain values)
                    "provenance": self.provenance()}
        return Tracker(self.config.tracker, run_dir, settings, resume_step=step)

    def write_stats(self, run_dir: Path) -> None:
        if self.ctx.is_main:
            stats = {**self.stats, "draft_vocab_coverage": self.vocab.coverage, **self.provenance()}
            (Path(run_dir) / "data_stats.json").write_text(json.dumps(stats, indent=1))


def describe_precision(config: Config, target: Target) -> str:
    """One line for the run's log: the dtypes the target, its answer generator and the draft's training
    use, and why `auto` chose them on this machine."""
    support = native_bf16(target.device)
    gen = config.data.generation.dtype
    generation = dtype_name(target.dtype if gen == "auto" else resolve_dtype(gen, target.device))
    training = "bf16 autocast" if use_bf16(config.trainer.precision, target.device) else "fp32"
    chosen = [f"target {dtype_name(target.dtype)}" + (" (auto)" if config.model.dtype == "auto" else ""),
              f"generation {generation}" + (" (auto)" if gen == "auto" else ""),
              f"draft training {training}" + (" (auto)" if config.trainer.precision == "auto" else "")]
    verdict = "native" if support.native else "not native"
    return f"{', '.join(chosen)}; bf16 is {verdict} on {target.device.type}: {support.reason}"


def describe_step(draft_settings, device: torch.device, allocator: str | None = None) -> str:
    """One line for the run's log: how the draft's step runs on this device, and which of its settings the device
    chose (left null: its method's objective's ``device_defaults``); ``allocator``: what CUDA's allocator runs with
    (``allocator_setting``)."""
    said = lambda v: str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731 (as the command line says it)
    return ", ".join([f"draft.{n}={said(value)}" + (f" ({device.type}'s default)" if chosen else "")
                      for n, (value, chosen) in draft_method(draft_settings.method).objective.device_defaults.settings(
                          draft_settings, device).items()]
                     + ([allocator] if allocator else []))


# PyTorch's CUDA caching allocator reads its settings once, when CUDA starts in the process. Expandable segments
# let it grow a segment instead of reserving a new block for each new size: the rows of a run differ in length,
# and without them the freed blocks of other sizes pile up until a late step runs out of memory with gigabytes
# reserved but unallocated (docs/troubleshooting.md).
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_CONF_NEW = "PYTORCH_ALLOC_CONF"  # (PyTorch >= 2.9's name, read when the CUDA one is unset)
EXPANDABLE = "expandable_segments:True"
SET_BY_RUN = "SPECFORGE_LITE_SET_ALLOC_CONF"  # the value a run set (a later run of the process: not the user's)


def allocator_setting(environ: MutableMapping[str, str] | dict, device: str,
                      cuda_initialized: bool = False) -> tuple[dict[str, str], str | None]:
    """What a run on ``device`` (the resolved model.device: cpu, cuda, cuda:N) sets in its environment for CUDA's
    allocator, and how its [step] line says it (None: not a CUDA run, nothing to say). Expandable segments unless
    the user set the allocator's variable (either name: theirs is left as it is), set only while CUDA has not
    started (``cuda_initialized``: after, the variable would change nothing)."""
    if torch.device(device).type != "cuda":
        return {}, None
    if environ.get(SET_BY_RUN) is not None and environ.get(ALLOC_CONF) == environ[SET_BY_RUN]:
        return {}, f"{ALLOC_CONF}={environ[ALLOC_CONF]} (set by the run; set the variable yourself to choose another)"
    for name in (ALLOC_CONF, ALLOC_CONF_NEW):
        if name in environ:
            return {}, f"{name}={environ[name]} (yours: left as set)"
    if cuda_initialized:
        return {}, (f"{ALLOC_CONF} not set: CUDA was initialised before the run could set it (export "
                    f"{ALLOC_CONF}={EXPANDABLE} before starting for fewer late out-of-memory errors)")
    return ({ALLOC_CONF: EXPANDABLE, SET_BY_RUN: EXPANDABLE},
            f"{ALLOC_CONF}={EXPANDABLE} (set by the run; set the variable yourself to choose another)")


def use_expandable_segments(device: str, environ: MutableMapping[str, str] | None = None) -> str | None:
    """Apply ``allocator_setting`` for model.device ``device`` (auto: cuda where there is one) to the process's
    environment, before anything allocates on CUDA; what the [step] line says of it."""
    environ = os.environ if environ is None else environ
    changes, said = allocator_setting(environ, str(resolve_device(device)), torch.cuda.is_initialized())
    environ.update(changes)
    return said


def packing_length(config: Config, target: Target) -> int | None:
    """The packed row length when data.packing is on (None: unpacked), after checking the target takes it."""
    if not config.data.packing:
        return None
    if config.data.source == "offline":
        raise ValueError("data.packing=true with data.source=offline: a store is read one sample per row; use "
                         "data.packing=false")
    if not target.family.supports_packing:
        raise ValueError(f"data.packing=true: the {target.family.name} family cannot keep packed conversations apart "
                         "(recurrent layers or model-computed positions); use data.packing=false")
    return config.data.max_length


def build_vocab(config: Config, target: Target, train_dataset, tokenizer) -> DraftVocab:
    return build_draft_vocab(train_dataset, target.vocab_size, draft_vocab_size(config.draft, target.vocab_size),
                             f"{tokenizer.name_or_path}|{len(tokenizer)}")


def mask_slot_token(config: Config, method: DraftMethod, target: Target, tokenizer=None, log=print) -> int | None:
    """draft.mask_token_id, or for a draft of ``method`` with mask slots and none set, the one ``choose_mask_token``
    picks from the target's tokenizer (``tokenizer``; None: loaded from the target's checkpoint folder)."""
    d = config.draft
    if d.mask_token_id is not None or not method.has_mask_slots(d):
        return d.mask_token_id
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(config.model))
    token, why = choose_mask_token(tokenizer, target.vocab_size)
    log(f"[draft] mask slots embed token {token}: {why} (set draft.mask_token_id to choose another)")
    return token


def build_draft(config: Config, target: Target, vocab: DraftVocab, tokenizer=None, log=print) -> Draft:
    method = draft_method(config.draft.method)
    draft_config = dataclasses.replace(config.draft,
                                       mask_token_id=mask_slot_token(config, method, target, tokenizer, log))
    spec = method.new_spec(target.config, draft_config, target.aux_layer_ids, target.convention,
                           vocab_size=target.vocab_size, draft_vocab_size=vocab.size,
                           target_hidden_size=target.hidden_size)
    torch.manual_seed(config.trainer.seed)
    draft = method.model(spec)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    if config.draft.init_lm_head_from_target:
        rows = target.head_rows(vocab.draft_to_target)[0].float()
        draft.init_lm_head_from_target(rows, torch.arange(vocab.size))
    method.warm_start(draft, config.draft, target)
    draft.to(target.device)
    draft.set_embedding(target.embedding_weight())
    return frozen_as_configured(draft, config)


def frozen_as_configured(draft: Draft, config: Config) -> Draft:
    """draft.freeze_lm_head: the lm_head keeps its rows (the optimizer, checkpoints' optimizer state and ZeRO
    take trainable weights only; the weights themselves are saved and exported whole)."""
    if config.draft.freeze_lm_head:
        draft.lm_head.requires_grad_(False)
    return draft


def _check_fixed_shape(config: Config, spec: DraftSpec) -> None:
    """What the method's settings fix in a draft's shape (a block draft's block_size, draft.block_size) must
    be the continued draft's: its block is its input, so a run at another length would train one block and
    export the other (labelled with the old k). Refused with the settings that continue it."""
    fixes = shape_settings(config.draft, spec)
    if fixes == {}:
        return
    differ = {key: (getattr(spec, key), value)
              for key, value in fixed_fields(config.draft, spec).items()
              if getattr(spec, key) != value}
    how = (" ".join(f"draft.{key}={value}" for key, value in fixes.items()) if fixes is not None else
           "the draft settings it was trained with (its export's config.json records them)")
    raise ValueError(f"draft.init_from={config.draft.init_from} is a {spec.method} draft with "
                     f"{', '.join(f'{key} {old}' for key, (old, _) in differ.items())}, and this run's settings give "
                     f"{', '.join(f'{key} {new}' for key, (_, new) in differ.items())}: its shape was fixed when it "
                     f"was trained (a block is the draft's input); continue it with {how}")


def _check_kept_shape(config: Config, spec: DraftSpec) -> None:
    """A continued draft keeps its shape (its layers, norms, mask slots, the aux states it reads, its vocabulary):
    settings of the shape that the command line gives, or that differ from their defaults, were given to be used, so
    where they differ from the draft's own too they are refused, never dropped. Otherwise the draft's own shape is
    taken, whatever it is. Its vocabulary only where the command line gave one: every recipe sets one, so the value
    alone says nothing of what the user asked."""
    method, d = draft_method(spec.method), config.draft
    shape = lambda settings: {"num_layers": settings.num_layers, "aux_layer_ids": settings.aux_layer_ids,  # noqa: E731
                              "draft_vocab_size": settings.draft_vocab_size, **method.spec_fields(settings)}
    given, defaults = shape(d), shape(type(d)())
    asked = [key for key, value in given.items() if f"draft.{key}" in config.command_line
             or (key != "draft_vocab_size" and value != defaults[key])]
    differ = [key for key in asked if getattr(spec, key) != given[key]]
    if differ:
        said = lambda value: str(value).lower() if isinstance(value, bool) else str(value)  # noqa: E731 (as typed)
        raise ValueError(f"draft.init_from={d.init_from} is a draft with "
                         f"{' and '.join(f'{key} {said(getattr(spec, key))}' for key in differ)}, and this run gives "
                         f"{' and '.join(f'draft.{key}={said(given[key])}' for key in differ)}: a continued draft "
                         "keeps its shape; drop those settings, or train a new draft (no draft.init_from)")


def initial_draft(config: Config, log=print) -> tuple[DraftSpec, dict[str, torch.Tensor]]:
    """draft.init_from: the (spec, weights) of the draft a run continues, from an export folder or a run folder's
    final/. Its method must be the run's (the objective trains that method)."""
    source = local_or_hub(config.draft.init_from, "draft.init_from", only=DRAFT_FILES)  # (a public draft's hub id too)
    folder = source / "final" if (source / "final" / "config.json").is_file() else source
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"draft.init_from={config.draft.init_from}: no draft there (an export folder with a "
                                "config.json, or a run folder with final/); give the folder of the draft to continue")
    spec, weights = load_export(folder)
    if spec.method != config.draft.method:
        raise ValueError(f"draft.init_from={config.draft.init_from} is a {spec.method} draft and this run trains "
                         f"draft={config.draft.method}: use draft={spec.method}")
    _check_fixed_shape(config, spec)
    _check_kept_shape(config, spec)
    ids = spec.aux_layer_ids or "the servers' default (it names none)"
    log(f"[draft] continuing the {spec.method} draft of {folder} (its {spec.num_layers} layer(s), aux ids "
        f"{ids} and {spec.draft_vocab_size}-token vocabulary)")
    return spec, weights
