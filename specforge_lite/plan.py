"""Sizing before spending: the memory a run needs per GPU, the setting that fits N GPUs of M GiB, the command
that launches it, and its steps and time per epoch.

    python -m specforge_lite.plan model=llama3_8b [overrides ...] [--gpus 8] [--gpu-gib 80] [--conversations N]
    specforge-lite plan model=llama3_8b ...                      (the same)
    python -m specforge_lite.plan --table [--out plan.json]      (the presets of docs/train-your-model.md)

Nothing is downloaded or run on a GPU. The target (a hub preset's shape shipped in the package: targets/shapes.py, a
tiny preset's own config, or the config.json of a folder or hub id) and the draft are built with fake weights, and
one capture and one training step run on fake tensors at the run's row length (max_length x micro_batch_size, or one
packed row of trainer.micro_batch_tokens): every tensor they create is counted as the allocator would hold it, so
the activations are those of this code, this method and these settings (TTT attention way, loss chunks,
checkpointing). Rows longer than 4096 tokens are traced at 2048 and 4096 and extrapolated on a line, except what
grows with the square of the row: the TTT ways that hold score matrices (dense, sdpa) and a target under eager
attention are traced at 1024, 2048 and 4096 and extrapolated on the parabola through them. The training state
follows the optimizer and ZeRO's partitioning:

- no DeepSpeed: fp32 weights and gradients, AdamW's two fp32 moments (Muon, which keeps one on its
  matrices, is counted as AdamW: an upper bound);
- DeepSpeed (bf16): bf16 weights and gradients, an fp32 master copy and two moments, partitioned over the
  ranks by stage (0: none; 1: optimizer state; 2: + gradients; 3: + weights); zero3_offload keeps the
  optimizer state on the host.

A GPU's usable memory is taken as its size less 2 GiB (CUDA context, NCCL buffers, the allocator's slack). One GPU
runs ``python train.py ...``; several run ``torchrun --nproc_per_node N train.py ...`` under a DeepSpeed trainer
(train.py refuses several processes without DeepSpeed), and each optimizer step reads a micro-batch on every
data-parallel rank. The time per epoch is estimated from the capture and draft-step rates measured on one GPU
(``MEASURED``, from docs/results), scaled to this target's and this draft's parameters.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import shlex
import sys
import weakref
from dataclasses import dataclass, field

import torch

GIB = 2**30
RESERVED_GIB = 2.0  # per GPU: CUDA context, communication buffers, allocator fragmentation
TRACE_MAX_TOKENS = 4096  # longer rows: traced at half and at this (and a quarter), then extrapolated
QUADRATIC_WAYS = ("dense", "sdpa")  # TTT attention ways whose memory grows with the square of the row
# the table of docs/train-your-model.md (the mission's own Gemma 4 and GPT-OSS with the usual dense ones)
PRESETS = ("llama3_8b", "qwen3_8b", "qwen3_32b", "llama3_70b", "gemma4", "gpt_oss_120b")


@dataclass
class Traced:
    """What one fake run measured, in bytes (per rank, at the run's row length)."""

    target_weights: int
    target_layer: int  # bytes of the largest decoder layer (a sharded target gathers one at a time)
    draft_trainable: int  # parameters
    draft_frozen: int  # parameters the draft holds but does not train (lm_head when frozen)
    capture_peak: int  # the target's forward with capture and the teacher, above the weights
    inputs: int  # the captured states and teacher logits the draft step reads
    step_peak: int  # the draft's forward + loss + backward above its inputs and weights
    step_peak_checkpointed: int  # the same with draft.checkpointing
    target_computing: int = 0  # target parameters a token's capture runs through (computing_parameters)


@dataclass
class Setting:
    """A way to run: the overrides that select it and what it divides."""

    overrides: str
    zero_stage: int | None  # None: no DeepSpeed
    shard_target: bool = False
    offload_optimizer: bool = False
    checkpointing: bool = False


# Cheapest in step time first: the first that fits is proposed. (ZeRO-3 alone is not a rung: DeepSpeed keeps up
# to 1e9 gathered parameters live, so a draft of one layer is whole on every rank during its step anyway.) One GPU
# starts at trainer=default (one process, no DeepSpeed); several start at trainer=zero0, its data-parallel form
# (train.py runs several processes through DeepSpeed only), and never take trainer=default.
LADDER = [
    Setting("trainer=default", None),
    Setting("trainer=zero1", 1),
    Setting("trainer=zero2", 2),
    Setting("trainer=zero2 draft.checkpointing=true", 2, checkpointing=True),
    Setting("trainer=zero3_offload draft.checkpointing=true", 3, offload_optimizer=True, checkpointing=True),
    Setting("trainer=zero2 target.shard=zero3 target.backend=hf draft.checkpointing=true", 2, shard_target=True,
            checkpointing=True),
    Setting("trainer=zero3_offload target.shard=zero3 target.backend=hf draft.checkpointing=true", 3,
            shard_target=True, offload_optimizer=True, checkpointing=True),
]
DATA_PARALLEL = Setting("trainer=zero0", 0)  # trainer=default's place on several GPUs (replicated state)


def ladder(gpus: int) -> list[Setting]:
    """The settings tried for ``gpus`` GPUs, cheapest first: every one launches on that many processes."""
    if gpus == 1:
        return [s for s in LADDER if not s.shard_target]  # (target.shard=zero3 partitions over several ranks)
    return [DATA_PARALLEL if s.zero_stage is None else s for s in LADDER]


GATHERED_LIMIT = 1_000_000_000  # DeepSpeed's stage3_max_live_parameters: parameters a rank keeps gathered


def recomputes(config) -> bool:
    """Whether the configured method can recompute its layers in backward (its settings have
    draft.checkpointing)."""
    return hasattr(config.draft, "checkpointing")


def setting_of(config) -> Setting:
    """The setting a configuration already asks for."""
    ds = config.trainer.deepspeed
    return Setting("as configured", ds.zero_stage if ds.enabled else None, config.target.shard == "zero3",
                   ds.offload_optimizer != "none", getattr(config.draft, "checkpointing", False))


def per_gpu(traced: Traced, setting: Setting, gpus: int, accumulating: bool = False) -> dict[str, float]:
    """Bytes per GPU by part, for ``gpus`` ranks running ``setting`` (``accumulating``: several micro-batches
    per step, across which ZeRO-1 keeps whole gradients; with one it reduces them into partitions, as ZeRO-2)."""
    p, frozen = traced.draft_trainable, traced.draft_frozen
    gathered = 0  # ZeRO-3's whole copies of partitioned weights, held while they are used
    if setting.zero_stage is None:  # fp32 master weights under autocast, the optimizer on every rank
        weights, grads, opt = 4 * (p + frozen), 4 * p, 8 * p
    else:  # DeepSpeed bf16: bf16 weights and gradients, fp32 master + two moments in the optimizer
        stage, n = setting.zero_stage, gpus
        weights = 2 * frozen + 2 * p / (n if stage >= 3 else 1)
        if stage >= 3:  # the step works on a gathered copy
            gathered += 2 * min(p, GATHERED_LIMIT)
        grads = 2 * p / (n if stage >= 2 or (stage == 1 and not accumulating) else 1)
        opt = 0 if setting.offload_optimizer else 12 * p / (n if stage >= 1 else 1)
    step = traced.step_peak_checkpointed if setting.checkpointing else traced.step_peak
    target = traced.target_weights
    if setting.shard_target:  # this rank's partition; the forward gathers a layer at a time
        target = target / gpus
        gathered += min(traced.target_layer, 2 * GATHERED_LIMIT)
    parts = {"target weights": target, "draft weights": weights, "gradients": grads, "optimizer state": opt,
             "gathered (ZeRO-3)": gathered,
             "activations": max(traced.capture_peak, traced.inputs + step)}
    parts["total"] = sum(parts.values())
    return parts


def proposal(traced: Traced, gpus: int, gpu_gib: float, trainer,
             recomputes: bool = True) -> tuple[Setting, dict] | None:
    """The first setting of ``ladder(gpus)`` whose per-GPU total fits, under ``trainer``'s accumulation (None: none
    fits); ``recomputes``: the method has draft.checkpointing (the rungs that set it are skipped otherwise)."""
    usable = (gpu_gib - RESERVED_GIB) * GIB
    for setting in ladder(gpus):
        if setting.checkpointing and not recomputes:
            continue
        parts = per_gpu(traced, setting, gpus, trainer.grad_accum_steps > 1)
        if parts["total"] <= usable:
            return setting, parts
    return None


def fitting(config, gpus: int, gpu_gib: float, traced_for) -> tuple[Setting, dict, int] | None:
    """(setting, its bytes per GPU, the row tokens it was sized at): the first setting that fits (``proposal``) at
    the run's rows, or, where none does and the rows are a token budget above data.max_length, the first that fits
    at rows of data.max_length with the budget lowered to it among its overrides (fewer tokens per step, the same
    conversations); None where neither fits. ``traced_for(tokens)``: the fake run at rows of that many tokens."""
    t, tokens = config.trainer, row_tokens(config)
    fit = proposal(traced_for(tokens), gpus, gpu_gib, t, recomputes(config))
    if fit is None and t.micro_batch_tokens and tokens > config.data.max_length:
        tokens = config.data.max_length
        fit = proposal(traced_for(tokens), gpus, gpu_gib, t, recomputes(config))
        if fit is not None:
            fit = (dataclasses.replace(fit[0], overrides=f"{fit[0].overrides} trainer.micro_batch_tokens={tokens}"),
                   fit[1])
    return None if fit is None else (*fit, tokens)


# keys a setting decides (its group chooses them): the user's own values of these are left out of its command
_DECIDED = ("trainer.deepspeed.enabled", "trainer.deepspeed.zero_stage", "trainer.deepspeed.offload_optimizer")


def launch_command(overrides: list[str], setting: Setting, gpus: int, optimizer: str = "adamw") -> str:
    """The command that runs ``setting`` on ``gpus`` GPUs: the user's overrides (those the setting decides left out:
    Hydra refuses a group named twice, and a kept trainer.deepspeed.enabled=false would undo the setting) and then
    the setting's; under DeepSpeed, AdamW for a run configured with Muon (ZeRO steps flat partitions, which Muon
    cannot: settings.py refuses the pair)."""
    own = setting.overrides.split()
    if setting.zero_stage is not None and optimizer == "muon":
        own.append("trainer.optimizer=adamw")
    decided = {o.split("=", 1)[0] for o in own} | set(_DECIDED)
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in decided]
    launcher = ["python", "train.py"] if gpus == 1 else ["torchrun", "--nproc_per_node", str(gpus), "train.py"]
    return " ".join([*launcher, *(shlex.quote(o) for o in [*kept, *own])])


def data_ranks(setting: Setting, gpus: int, sequence_parallel: int) -> int:
    """Data-parallel ranks of ``setting`` on ``gpus`` GPUs: one process without DeepSpeed, else a rank per GPU, a
    sequence-parallel group of them reading one row."""
    return 1 if setting.zero_stage is None else max(1, gpus // max(1, sequence_parallel))


# ---- the fake run ---------------------------------------------------------------------------------------------
def tiny_config(tiny):
    """A tiny preset's config as its build makes it (targets/acquire.py build_tiny_model), without building the
    model or fetching the tokenizer it borrows."""
    import transformers

    cls = getattr(transformers, tiny.architecture, None)
    if cls is None:
        raise ValueError(f"model.tiny.architecture={tiny.architecture!r} is not a transformers class")
    cfg_cls = getattr(transformers, tiny.config_class) if tiny.config_class else cls.config_class
    return cfg_cls(**dict(tiny.config), architectures=[tiny.architecture])


def target_config(model_cfg):
    """The target's transformers config, with nothing downloaded where the package knows it: a folder's
    config.json (model.path=DIR), else a listed preset's shipped shape, else a tiny preset's own config, else its
    config.json (the hub cache, or a download of that one file)."""
    from transformers import AutoConfig

    from .errors import UserError
    from .targets.acquire import resolve_model_dir
    from .targets.shapes import known_config

    path = model_cfg.path or ""
    local = bool(path) and os.path.isdir(os.path.expanduser(path))
    shipped = None if local else known_config(path)
    if shipped is not None:
        return shipped
    tiny = model_cfg.tiny
    if not local and tiny is not None and tiny.architecture and model_cfg.source in ("auto", "tiny"):
        return tiny_config(tiny)
    try:
        location = os.path.expanduser(path) if local else resolve_model_dir(model_cfg, config_only=True)
        return AutoConfig.from_pretrained(location, trust_remote_code=model_cfg.trust_remote_code)
    except Exception as e:  # noqa: BLE001 (offline, gated, missing: all one line)
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UserError(f"model.path={path!r}: its config.json cannot be read ({first}); give "
                        "model.path=DIR, a folder holding the target's config.json") from None


_TOWERS = re.compile(r"vision|visual|audio|multi_modal_projector")  # not run by a text capture
_EXPERTS = re.compile(r"(^|\.)experts\.")  # routed experts (a shared expert's name does not match)


def computing_parameters(model) -> int:
    """The target parameters one token of a text capture runs through: all but the embedding tables, the lm_head
    (the teacher reads the draft vocabulary's rows only), the vision and audio towers, and of the routed experts
    the share a token is routed to (num_experts_per_tok of them)."""
    text = model.config.get_text_config()
    experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
    routed = (getattr(text, "num_experts_per_tok", None) or getattr(text, "top_k_experts", None)
              or getattr(text, "experts_per_token", None))
    skip = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = model.get_output_embeddings()
    if head is not None:
        skip.add(id(head.weight))
    total = 0.0
    for name, param in model.named_parameters():
        if id(param) in skip or _TOWERS.search(name):
            continue
        share = routed / experts if experts and routed and _EXPERTS.search(name) else 1.0
        total += param.numel() * share
    return int(total)


class _EveryRowScored(torch.utils._python_dispatch.TorchDispatchMode):
    """Fake tensors hold no values: a mask's true positions (nonzero) are taken to be every position, as in a
    row the loss reads in full (the most memory a row of this length can take)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.nonzero.default:
            x = args[0]
            return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
        return func(*args, **(kwargs or {}))


class _Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """The bytes held by the storages that ops create while it is active, live and at their peak: what a
    caching allocator would hand out (tensors that existed before, such as weights and inputs, are not
    counted; a storage is freed when its last tensor goes)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.held = weakref.WeakKeyDictionary()  # storage -> bytes

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            if st._cdata in inputs or st in self.held:  # a view or an in-place result: nothing new
                continue
            self.held[st] = st.nbytes()
            weakref.finalize(st, self._free, st.nbytes())
            self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
        return out


def _peak(fn) -> tuple[object, int]:
    """(fn's result, the peak bytes of the storages created while it ran) on fake tensors."""
    counter = _Allocations()
    with counter, _EveryRowScored():
        out = fn()
    return out, counter.peak


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def parts_bytes(family, model) -> int:
    """Bytes of what the trainer of a target served by vLLM holds of it: the embedding, the final norm and the
    lm_head (counted once where the head is the embedding)."""
    parts = [family.embedding(model).weight, *family.final_norm(model).parameters(), family.lm_head_weight(model)]
    return _nbytes({id(p): p for p in parts}.values())


def _no_init_weights():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # (transformers before 5)
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def trace(config, rows: int, tokens: int, fake: bool = True, peak=None) -> Traced:
    """One capture and one draft step of ``rows`` rows of ``tokens`` tokens, on fake weights and tensors
    (``fake=False``: real random weights, each peak measured by ``peak(fn) -> (result, bytes)``; the tests
    compare the two on a small target)."""
    import contextlib

    from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                               FakeTensorMode)

    from .draft.objective import STEP_DEFAULTS, DraftObjective, UnrollInputs
    from .methods import draft_method
    from .targets.families import get_family
    from .targets.families.base import architecture_class
    from .targets.hf import HFTarget
    from .targets.teacher import Teacher

    hf_config = target_config(config.model)
    if getattr(hf_config, "tie_word_embeddings", None) is None:
        hf_config.tie_word_embeddings = False
    vocab = hf_config.get_text_config().vocab_size
    method = draft_method(config.draft.method)
    vd = method.draft_vocab_size(config.draft, vocab)
    keep = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:vd].sort().values  # (real tensors)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[keep] = True
    draft_cfg = dataclasses.replace(config.draft, mask_token_id=0)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    peak = peak or _peak
    # fake weights hold no values to initialise (a truncated normal, as SigLIP's, would ask for them)
    blank = _no_init_weights() if fake else contextlib.nullcontext()
    with mode, blank:
        cls = architecture_class(hf_config)
        build = getattr(cls, "from_config", None) or cls._from_config  # (an Auto class's name; a model class's)
        # the target's attention as its run loads it (sdpa, the default, is left to transformers: it falls back
        # where a part has none, as Gemma 4's audio tower)
        impl = config.model.attn_implementation
        model = build(hf_config, dtype=torch.bfloat16, **({} if impl == "sdpa" else {"attn_implementation": impl}))
        served = config.target.backend == "vllm"  # (a vLLM server runs it: the trainer holds its parts only)
        target = HFTarget(model, get_family(config.model.family), config.draft.aux_layer_ids,
                          backend="hf" if served else config.target.backend)
        target_weights = parts_bytes(target.family, model) if served else _nbytes(model.parameters())
        target_layer = max(_nbytes(layer.parameters()) for layer in target.family.layers(model))
        target_computing = computing_parameters(model)
    teacher = Teacher(target, keep, t2d)  # (outside the fake mode: it reads t2d's values)
    with mode:
        spec = method.new_spec(target.config, draft_cfg, target.aux_layer_ids, target.convention,
                               vocab_size=target.vocab_size, draft_vocab_size=vd, target_hidden_size=target.hidden_size)
        draft = method.model(spec)
        draft.set_vocab(keep - torch.arange(vd), t2d)
        draft.set_embedding(target.embedding_weight())
        if config.draft.freeze_lm_head:
            draft.lm_head.requires_grad_(False)
        trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in draft.parameters() if not p.requires_grad)

        def capture():
            ids = torch.zeros(rows, tokens, dtype=torch.long)
            mask = torch.ones(rows, tokens, dtype=torch.long)
            with torch.no_grad():
                captured = target.capture(ids)
                logits, in_vocab = teacher(captured, DraftObjective.teacher_positions(mask))
            return UnrollInputs(captured.aux, ids, logits, in_vocab, mask)

        inputs, capture_peak = peak(capture)

        def step(checkpointing: bool):
            # (the loss in a GPU's chunks; eager: the compiled chains of draft.compile hold no more than eager's
            # passes, which fake tensors measure without compiling)
            changes = {"compile": False, **({"checkpointing": True} if checkpointing else {})}
            if config.draft.loss_chunk_rows is None:
                changes["loss_chunk_rows"] = STEP_DEFAULTS.cuda["loss_chunk_rows"]
            objective = method.objective.from_config(dataclasses.replace(config.draft, **changes))
            # the products as CUDA autocast makes them (trainer.precision=fp32: none)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.trainer.precision != "fp32"):
                out = objective.unroll(draft, inputs)
            out.loss.backward()
            draft.zero_grad(set_to_none=True)

        try:
            _, step_peak = peak(lambda: step(False))
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            from .errors import UserError

            raise UserError(f"draft={config.draft.method}: its training step depends on values a run on fake tensors "
                            f"does not have ({type(e).__name__}); the plan sizes the EAGLE3 drafts (draft=eagle3, "
                            "EAGLE 3.1, P-EAGLE)") from None
        # (a method without draft.checkpointing keeps its activations: its one step is its only one)
        _, step_ckpt = peak(lambda: step(True)) if recomputes(config) else (None, step_peak)
    return Traced(target_weights, target_layer, trainable, frozen, capture_peak,
                  _nbytes([*inputs.aux, inputs.input_ids, inputs.teacher_logits, inputs.in_vocab, inputs.loss_mask]),
                  step_peak, step_ckpt, target_computing)


def quadratic_parts(config) -> set[str]:
    """The byte counts of a trace that grow with the square of the row: the draft step's under a TTT way that holds
    score matrices (dense, sdpa), the capture's under eager attention (T x T scores per head)."""
    parts = set()
    if getattr(config.draft, "ttt_attention", None) in QUADRATIC_WAYS:
        parts |= {"step_peak", "step_peak_checkpointed"}
    if config.model.attn_implementation == "eager":
        parts.add("capture_peak")
    return parts


def _through(xs: list[int], ys: list[int], x: int) -> int:
    """The value at ``x`` of the polynomial through the points (xs, ys) (Lagrange: a line through two, a parabola
    through three)."""
    total = 0.0
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        term = float(yi)
        for j, xj in enumerate(xs):
            if j != i:
                term *= (x - xj) / (xi - xj)
        total += term
    return int(total)


def traced_at(config, tokens: int) -> Traced:
    """The fake run at ``tokens`` per row: traced directly up to TRACE_MAX_TOKENS, else extrapolated from shorter
    traces: each byte count on the line through the traces at half and all of TRACE_MAX_TOKENS, or, for a count
    that grows with the square of the row (``quadratic_parts``), on the parabola through those and a quarter
    (the weights do not change)."""
    rows = config.trainer.micro_batch_size
    if tokens <= TRACE_MAX_TOKENS:
        return trace(config, rows, tokens)
    quadratic = quadratic_parts(config)
    lengths = [TRACE_MAX_TOKENS // 4] if quadratic else []
    lengths += [TRACE_MAX_TOKENS // 2, TRACE_MAX_TOKENS]
    traces = [trace(config, rows, n) for n in lengths]
    values = {}
    for f in dataclasses.fields(Traced):
        ys = [getattr(t, f.name) for t in traces]
        fit = slice(None) if f.name in quadratic else slice(-2, None)
        values[f.name] = _through(lengths[fit], ys[fit], tokens)
    return Traced(**values)


# ---- the time an epoch takes --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Measured:
    """Rates one GPU measured (``python -m studies gpu_scale``, docs/results/<source>): the capture of a
    target and its draft's training step, in tokens per second at rows of ``tokens``."""

    source: str
    device: str
    target: str
    computing: float  # the target's computing_parameters (its parameters less embeddings and lm_head)
    draft_trainable: float
    tokens: int
    capture: float
    steps: dict = field(default_factory=dict)  # TTT way (+compile, +ckpt) -> draft step tokens/s


# From docs/results (tests/test_plan.py holds them to the files): Llama-3.1-8B's and Qwen3-32B's shapes on one
# NVIDIA H200, 2026-11-28. computing: the file's target_params_b less the embedding table and lm_head
# (vocabulary x hidden each).
MEASURED = (
    Measured("gpu_scale_llama3_8b_h200.json", "NVIDIA H200", "llama3_8b", 8.030261248e9 - 2 * 128256 * 4096,
             424.701952e6, 2048, 31431.6, {"flex": 15360.7, "blockwise": 7405.9, "flex+compile": 17373.0,
                                           "flex+ckpt": 10298.3, "sdpa": 17724.2}),
    Measured("gpu_scale_llama3_8b_h200.json", "NVIDIA H200", "llama3_8b", 8.030261248e9 - 2 * 128256 * 4096,
             424.701952e6, 8192, 30168.5, {"blockwise": 6097.4, "flex": 19819.8, "flex+compile": 24466.4,
                                           "flex+ckpt": 16217.4, "sdpa": 11989.7}),
    Measured("gpu_scale_llama3_8b_long_h200.json", "NVIDIA H200", "llama3_8b", 8.030261248e9 - 2 * 128256 * 4096,
             424.701952e6, 32768, 22275.4, {"flex+compile": 19107.6, "flex+ckpt": 13274.3}),
    Measured("gpu_scale_qwen3_32b_h200.json", "NVIDIA H200", "qwen3_32b", 32.762123264e9 - 2 * 151936 * 5120,
             782.53568e6, 8192, 7148.2, {"flex": 12740.5}),
)


def way_keys(config, checkpointing: bool) -> list[str]:
    """The measured way names that time this run's draft step, the closest first: its TTT attention way on a GPU
    (draft.ttt_attention, null: the GPU's flex), with +ckpt under draft.checkpointing and +compile when compiled."""
    from .methods import draft_method

    d = config.draft
    gpu = draft_method(d.method).objective.device_defaults.cuda
    way = getattr(d, "ttt_attention", None) or gpu.get("ttt_attention")
    if way is None:  # (the measured ways are EAGLE3's TTT attention: a method without it has none measured)
        return []
    compiled = getattr(d, "compile", None)
    keys = [f"{way}+ckpt"] if checkpointing else []
    if compiled if compiled is not None else gpu["compile"]:
        keys.append(f"{way}+compile")
    return [*keys, way]


def row_seconds(traced: Traced, tokens: int, keys: list[str]) -> dict | None:
    """Seconds one GPU takes to capture a row of ``tokens`` and train the draft on it, from ``MEASURED``: the
    capture rate of the measured target nearest in computing parameters (at the measured length nearest), scaled by
    the ratio of computing parameters; the draft step's rate of the first of ``keys`` measured (the measured length
    nearest, then the draft nearest), scaled by the ratio of trainable parameters. None: nothing to scale from."""
    if not traced.target_computing or not traced.draft_trainable:
        return None
    cap = min(MEASURED, key=lambda m: (abs(math.log(m.computing / traced.target_computing)),
                                       abs(math.log(m.tokens / tokens))))
    key = next((k for k in keys if any(k in m.steps for m in MEASURED)), None)
    if key is None:
        return None
    step = min((m for m in MEASURED if key in m.steps), key=lambda m: (
        abs(math.log(m.tokens / tokens)), abs(math.log(m.draft_trainable / traced.draft_trainable))))
    cap_scale, step_scale = traced.target_computing / cap.computing, traced.draft_trainable / step.draft_trainable
    capture_s, step_s = tokens / cap.capture * cap_scale, tokens / step.steps[key] * step_scale
    return {"seconds": capture_s + step_s, "device": cap.device,
            "capture": {"source": cap.source, "target": cap.target, "tokens": cap.tokens, "tokens_per_s": cap.capture,
                        "scale": cap_scale, "seconds": capture_s},
            "step": {"source": step.source, "target": step.target, "way": key, "tokens": step.tokens,
                     "tokens_per_s": step.steps[key], "scale": step_scale, "seconds": step_s}}


# ---- the report -----------------------------------------------------------------------------------------------
def check_length(config, hf_config) -> None:
    """data.max_length past what the target's positions reach is refused, naming the limit."""
    from .errors import UserError

    limit = getattr(hf_config.get_text_config(), "max_position_embeddings", None)
    if isinstance(limit, int) and config.data.max_length > limit:
        raise UserError(f"data.max_length={config.data.max_length} is past {config.model.name}'s "
                        f"max_position_embeddings ({limit}): give data.max_length={limit} or less")


def row_tokens(config) -> int:
    """The tokens of the rows a run's step reads: its token budget (trainer.micro_batch_tokens, one packed row per
    micro-batch), else data.max_length."""
    return config.trainer.micro_batch_tokens or config.data.max_length


def plan(config, gpus: int, gpu_gib: float, conversations: int | None, overrides: list[str] | None = None) -> dict:
    """Everything the command prints, as data (``overrides``: the run's, for the command that launches it)."""
    from .job import steps_per_epoch

    check_length(config, target_config(config.model))
    tokens = row_tokens(config)
    traces = functools.cache(lambda n: traced_at(config, n))
    traced = traces(tokens)
    t = config.trainer
    found = fitting(config, gpus, gpu_gib, traces)
    fit, rows_at = (None, tokens) if found is None else (found[:2], found[2])
    out = {"model": config.model.name, "recipe": config.recipe_name, "method": config.draft.method,
           "max_length": tokens, "micro_batch_size": config.trainer.micro_batch_size,
           "micro_batch_tokens": t.micro_batch_tokens, "gpus": gpus,
           "gpu_gib": gpu_gib, "traced": dataclasses.asdict(traced),
           "as_configured": per_gpu(traced, setting_of(config), gpus, t.grad_accum_steps > 1),
           "proposal": None if fit is None else {"overrides": fit[0].overrides,
                                                 "command": launch_command(list(overrides or []), fit[0], gpus,
                                                                           t.optimizer),
                                                 **fit[1]}}
    if conversations:
        setting = fit[0] if fit is not None else setting_of(config)
        sp = t.deepspeed.sequence_parallel
        ranks = data_ranks(setting, gpus, sp)
        # token-budget micro-batches counted as rows of data.max_length fill them (the bound every row is counted at)
        micro_batches = (math.ceil(conversations / (rows_at // config.data.max_length)) if t.micro_batch_tokens
                         else None)
        per_epoch = steps_per_epoch(config, conversations, ranks, micro_batches)
        epochs = t.epochs if t.epochs is not None else t.max_steps / per_epoch
        out["data"] = {"conversations": conversations,
                       "tokens_per_epoch_at_most": conversations * config.data.max_length,
                       "data_ranks": ranks, "steps_per_epoch": math.ceil(per_epoch), "epochs": epochs,
                       "steps": max(1, math.ceil(epochs * per_epoch))}
        row = (row_seconds(traces(rows_at), rows_at, way_keys(config, setting.checkpointing)) if fit is not None
               else None)
        if row is not None:  # each GPU of the data-parallel ranks (and their sequence-parallel groups) on its rows
            epoch_s = (micro_batches or conversations) * row["seconds"] / (ranks * (sp if setting.zero_stage is not None
                                                                                     else 1))
            out["data"]["time"] = {"epoch_hours": epoch_s / 3600, "hours": epochs * epoch_s / 3600, **row}
    return out


def _gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def describe(p: dict) -> list[str]:
    tr = p["traced"]
    per_step = (f"micro-batches of one packed row of up to {p['max_length']} tokens (trainer.micro_batch_tokens)"
                if p.get("micro_batch_tokens") else f"rows of {p['max_length']} tokens x {p['micro_batch_size']}")
    lines = [f"[plan] {p['model']} ({p['recipe']}), {p['method']}: {per_step} per step and rank; target "
             f"{_gib(tr['target_weights'])} GiB in bf16, draft {tr['draft_trainable'] / 1e6:.0f}M trainable parameters"]
    header = f"{'GiB per GPU':<28}" + "".join(f"{k:>19}" for k in p["as_configured"])
    lines += ["", header, f"{'as configured':<28}" + "".join(f"{_gib(v):>19}" for v in p["as_configured"].values())]
    if p["proposal"]:
        prop = {k: v for k, v in p["proposal"].items() if k not in ("overrides", "command")}
        lines.append(f"{'proposed':<28}" + "".join(f"{_gib(v):>19}" for v in prop.values()))
        lines += ["", f"[plan] on {p['gpus']} GPU(s) of {p['gpu_gib']:g} GiB ({RESERVED_GIB:g} GiB each kept for "
                      f"CUDA and communication): {p['proposal']['overrides']}",
                  f"[plan] launch: {p['proposal']['command']}"]
    else:
        lines += ["", f"[plan] nothing fits {p['gpus']} GPU(s) of {p['gpu_gib']:g} GiB: add GPUs, or shorten "
                      "data.max_length"]
    if "data" in p:
        d = p["data"]
        lines.append(f"[plan] {d['conversations']} conversations: at most {d['tokens_per_epoch_at_most'] / 1e6:.1f}M "
                     f"tokens per epoch, {d['steps_per_epoch']} steps per epoch ({d['data_ranks']} data-parallel "
                     f"rank(s)), {d['steps']} steps for {d['epochs']:g} epochs")
        if "time" in d:
            tm, c, s = d["time"], d["time"]["capture"], d["time"]["step"]
            lines.append(f"[plan] time: about {tm['epoch_hours']:.1f} h per epoch, {tm['hours']:.1f} h in all, on "
                         f"GPUs as fast as the {tm['device']} these rates were measured on (docs/results): capture "
                         f"{c['tokens_per_s']:.0f} tok/s ({c['target']}, rows of {c['tokens']}) x {c['scale']:.2f} "
                         f"for this target's parameters, draft step {s['tokens_per_s']:.0f} tok/s ({s['way']}, rows "
                         f"of {s['tokens']}) x {s['scale']:.2f} for this draft's; every row counted at "
                         "data.max_length (an upper bound); regeneration, ZeRO communication and offload not counted")
    return lines


def table(gpu_kinds=((1, 80), (1, 141), (8, 24), (8, 40), (8, 80))) -> dict:
    """The presets under the scale recipe: the GiB one GPU needs as configured, and the setting (and GiB per
    GPU) each set of GPUs takes; as a result file of docs/results (a table with its machine and date)."""
    import datetime

    from .compose import load_config

    rows, traced = [], {}
    for name in PRESETS:
        config = load_config([f"model={name}"])
        traces = functools.cache(lambda n, config=config: traced_at(config, n))
        tr = traces(row_tokens(config))
        traced[name] = dataclasses.asdict(tr)
        cells = []
        for gpus, gib in gpu_kinds:
            fit = fitting(config, gpus, gib, traces)
            cells.append("does not fit" if fit is None else f"`{fit[0].overrides}` ({fit[1]['total'] / GIB:.0f})")
        rows.append([name, row_tokens(config), f"{per_gpu(tr, setting_of(config), 1)['total'] / GIB:.0f}",
                     *cells])
    return {"machine": "any machine (fake tensors: nothing runs on a device)",
            "date": datetime.date.today().isoformat(),
            "note": "python -m specforge_lite.plan --table; the setting proposed for each set of GPUs, with its "
                    f"GiB per GPU in brackets ({RESERVED_GIB:g} GiB of each GPU kept for CUDA and communication); "
                    "one GPU launches python train.py model=NAME SETTING, N GPUs torchrun --nproc_per_node N "
                    "train.py model=NAME SETTING (a DeepSpeed trainer: train.py runs several processes through "
                    "DeepSpeed only)",
            "columns": ["target (recipe=scale)", "row tokens", "GiB on one GPU as configured",
                        *(f"{g} x {m} GiB" for g, m in gpu_kinds)],
            "rows": rows, "traced": traced}


class _OneLineParser(argparse.ArgumentParser):
    """An argument it cannot read is one line naming it (and exit status 2), not the usage and the error."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def check_arguments(a) -> None:
    """The command's own numbers, refused in one line when out of range."""
    from .errors import UserError

    if a.gpus < 1:
        raise UserError(f"--gpus {a.gpus}: a run needs at least one GPU; give --gpus 1 or more")
    if not math.isfinite(a.gpu_gib) or a.gpu_gib <= RESERVED_GIB:
        raise UserError(f"--gpu-gib {a.gpu_gib:g}: give each GPU's memory in GiB, more than the {RESERVED_GIB:g} GiB "
                        "kept for CUDA and communication (--gpu-gib 80 for an 80 GiB GPU)")
    if a.conversations is not None and a.conversations < 1:
        raise UserError(f"--conversations {a.conversations}: give the number of training conversations, 1 or more "
                        "(or leave it out)")


def unknown_option(overrides: list[str]) -> str | None:
    """A group option (model=, trainer=, data=, recipe=, tracker=) that conf/ does not have, as one line naming
    those it has (Hydra's MissingConfigException otherwise, as a traceback)."""
    from .config import CONF_DIR, available_presets

    for override in overrides:
        key, _, value = override.partition("=")
        key = key.lstrip("+~")
        if "." in key or not (CONF_DIR / key).is_dir():
            continue
        options = available_presets(key)
        for v in value.split(","):
            if v and v not in options:
                return f"{key}={v}: there is no such {key} preset; the presets: {', '.join(options)}"
    return None


def main(argv: list[str] | None = None) -> int:
    prog = sys.argv[0] if sys.argv and sys.argv[0].startswith("specforge-lite") else "python -m specforge_lite.plan"
    parser = _OneLineParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="the run's overrides, as train.py takes them")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs the run gets (default 1)")
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="memory of each GPU in GiB (default 80)")
    parser.add_argument("--conversations", type=int, default=None,
                        help="training conversations (for tokens, steps and time per epoch)")
    parser.add_argument("--table", action="store_true", help="the presets' table (docs/train-your-model.md)")
    parser.add_argument("--out", default=None, help="also write the result as JSON here")
    a = parser.parse_args(argv)
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from .compose import load_config
    from .errors import UserError
    from .settings import check_settings

    try:
        if a.table:
            result = table()
            print("\n".join(["| " + " | ".join(map(str, r)) + " |" for r in [result["columns"], *result["rows"]]]))
        else:
            check_arguments(a)
            problem = unknown_option(a.overrides)
            if problem:
                raise UserError(problem)
            config = load_config(a.overrides)
            check_settings(config)
            sp = config.trainer.deepspeed.sequence_parallel
            if sp > 1 and a.gpus % sp:
                raise UserError(f"trainer.deepspeed.sequence_parallel={sp} must divide the --gpus {a.gpus} launched "
                                f"ranks: give --gpus a multiple of {sp}, or lower it")
            result = plan(config, a.gpus, a.gpu_gib, a.conversations or config.data.max_samples, a.overrides)
            print("\n".join(describe(result)))
    except (UserError, ValueError, HydraException, OmegaConfBaseException) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, (HydraException, OmegaConfBaseException)):  # (what Hydra says, and why, on one line)
            cause = str(e.__cause__ or "").strip()
            first = first.rstrip(".") + (f": {cause.splitlines()[0]}" if cause else "") + \
                "; python train.py --help lists the groups and settings"
        print(f"error: {first}", file=sys.stderr)
        return 2
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
