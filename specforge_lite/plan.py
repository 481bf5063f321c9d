"""Sizing before spending: the memory a run needs per GPU, the setting that fits N GPUs of M GiB, and its steps.

    python -m specforge_lite.plan model=llama3_8b [overrides ...] [--gpus 8] [--gpu-gib 80] [--conversations N]
    python -m specforge_lite.plan --table [--out plan.json]      (the presets of docs/train-your-model.md)

Nothing is downloaded or run on a GPU. The target (its config.json, or the shape of a listed preset) and the
draft are built with fake weights, and one capture and one training step run on fake tensors at the run's row
length (max_length x micro_batch_size): every tensor they create is counted as the allocator would hold it,
so the activations are those of this code, this method and these settings (TTT attention way, loss chunks,
checkpointing). Rows longer than 4096 tokens are traced at 2048 and 4096 and extrapolated (the ways but sdpa
are linear in the row). The training state follows the optimizer and ZeRO's partitioning:

- no DeepSpeed: fp32 weights and gradients, AdamW's two fp32 moments (Muon, which keeps one on its
  matrices, is counted as AdamW: an upper bound);
- DeepSpeed (bf16): bf16 weights and gradients, an fp32 master copy and two moments, partitioned over the
  ranks by stage (1: optimizer state; 2: + gradients; 3: + weights); zero3_offload keeps the optimizer state
  on the host.

A GPU's usable memory is taken as its size less 2 GiB (CUDA context, NCCL buffers, the allocator's slack).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import weakref
from dataclasses import dataclass

import torch

GIB = 2**30
RESERVED_GIB = 2.0  # per GPU: CUDA context, communication buffers, allocator fragmentation
TRACE_MAX_TOKENS = 4096  # longer rows: traced at half and at this, then extrapolated linearly
PRESETS = ("llama3_8b", "qwen3_8b", "qwen3_32b", "llama3_70b")  # the table of docs/train-your-model.md


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


@dataclass
class Setting:
    """A way to run: the overrides that select it and what it divides."""

    overrides: str
    zero_stage: int | None  # None: no DeepSpeed
    shard_target: bool = False
    offload_optimizer: bool = False
    checkpointing: bool = False


# Cheapest in step time first: the first that fits is proposed. (ZeRO-3 alone is not a rung: DeepSpeed keeps up
# to 1e9 gathered parameters live, so a draft of one layer is whole on every rank during its step anyway.)
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
    """The first setting of the ladder whose per-GPU total fits, under ``trainer``'s accumulation (None: none
    fits); ``recomputes``: the method has draft.checkpointing (the rungs that set it are skipped otherwise)."""
    usable = (gpu_gib - RESERVED_GIB) * GIB
    for setting in LADDER:
        if (setting.shard_target and gpus == 1) or (setting.checkpointing and not recomputes):
            continue
        parts = per_gpu(traced, setting, gpus, trainer.grad_accum_steps > 1)
        if parts["total"] <= usable:
            return setting, parts
    return None


# ---- the fake run ---------------------------------------------------------------------------------------------
def target_config(model_cfg):
    """The target's transformers config: a listed preset's shape, else its config.json (local, cached or one
    small download)."""
    from transformers import AutoConfig

    from .errors import UserError
    from .targets.acquire import resolve_model_dir
    from .targets.shapes import known_config

    known = known_config(model_cfg.path)
    if known is not None:
        return known
    try:
        return AutoConfig.from_pretrained(resolve_model_dir(model_cfg), trust_remote_code=model_cfg.trust_remote_code)
    except Exception as e:  # noqa: BLE001 (offline, gated, missing: all one line)
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UserError(f"model.path={model_cfg.path!r}: its config.json cannot be read ({first}); give "
                        "model.path=DIR, a folder holding the target's config.json") from None


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


def trace(config, rows: int, tokens: int, fake: bool = True, peak=None) -> Traced:
    """One capture and one draft step of ``rows`` rows of ``tokens`` tokens, on fake weights and tensors
    (``fake=False``: real random weights, each peak measured by ``peak(fn) -> (result, bytes)``; the tests
    compare the two on a small target)."""
    import contextlib

    from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                               FakeTensorMode)

    from .draft.objective import BY_DEVICE, UnrollInputs, UnrollObjective
    from .methods import build_objective, draft_method, draft_spec, draft_vocab_size
    from .targets.families import get_family
    from .targets.families.base import architecture_class
    from .targets.hf import HFTarget
    from .targets.teacher import Teacher

    hf_config = target_config(config.model)
    if getattr(hf_config, "tie_word_embeddings", None) is None:
        hf_config.tie_word_embeddings = False
    vocab = hf_config.get_text_config().vocab_size
    vd = draft_vocab_size(config.draft, vocab)
    keep = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:vd].sort().values  # (real tensors)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[keep] = True
    draft_cfg = dataclasses.replace(config.draft, mask_token_id=0)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    peak = peak or _peak
    with mode:
        cls = architecture_class(hf_config)
        build = getattr(cls, "from_config", None) or cls._from_config  # (an Auto class's name; a model class's)
        model = build(hf_config, dtype=torch.bfloat16)
        backend = "lean" if config.target.backend in ("lean", "custom") else "hf"
        target = HFTarget(model, get_family(config.model.family), config.draft.aux_layer_ids, backend=backend)
        target_weights = _nbytes(model.parameters())
        target_layer = max(_nbytes(layer.parameters()) for layer in target.family.layers(model))
    teacher = Teacher(target, keep, t2d)  # (outside the fake mode: it reads t2d's values)
    with mode:
        spec = draft_spec(target.config, draft_cfg, target.aux_layer_ids, target.convention,
                          vocab_size=target.vocab_size, draft_vocab_size=vd, target_hidden_size=target.hidden_size)
        draft = draft_method(spec.method).model(spec)
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
                logits, in_vocab = teacher(captured, UnrollObjective.teacher_positions(mask))
            return UnrollInputs(captured.aux, ids, logits, in_vocab, mask)

        inputs, capture_peak = peak(capture)

        def step(checkpointing: bool):
            # (the loss in a GPU's chunks; eager: the compiled chains of draft.compile hold no more than eager's
            # passes, which fake tensors measure without compiling)
            changes = {"compile": False, **({"checkpointing": True} if checkpointing else {})}
            if config.draft.loss_chunk_rows is None:
                changes["loss_chunk_rows"] = BY_DEVICE["cuda"]["loss_chunk_rows"]
            objective = build_objective(dataclasses.replace(config.draft, **changes))
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
                  step_peak, step_ckpt)


def traced_at(config, tokens: int) -> Traced:
    """The fake run at ``tokens`` per row: traced directly up to TRACE_MAX_TOKENS, else extrapolated from two
    shorter traces (each byte count a line through them; the weights do not change)."""
    rows = config.trainer.micro_batch_size
    if tokens <= TRACE_MAX_TOKENS:
        return trace(config, rows, tokens)
    lo, hi = TRACE_MAX_TOKENS // 2, TRACE_MAX_TOKENS
    a, b = trace(config, rows, lo), trace(config, rows, hi)
    scale = (tokens - hi) / (hi - lo)
    return Traced(**{f.name: int(getattr(b, f.name) + scale * (getattr(b, f.name) - getattr(a, f.name)))
                     for f in dataclasses.fields(Traced)})


# ---- the report -----------------------------------------------------------------------------------------------
def plan(config, gpus: int, gpu_gib: float, conversations: int | None) -> dict:
    """Everything the command prints, as data."""
    from .job import steps_per_epoch

    tokens = config.data.max_length
    traced = traced_at(config, tokens)
    t = config.trainer
    fit = proposal(traced, gpus, gpu_gib, t, recomputes(config))
    out = {"model": config.model.name, "recipe": config.recipe_name, "method": config.draft.method,
           "max_length": tokens, "micro_batch_size": config.trainer.micro_batch_size, "gpus": gpus,
           "gpu_gib": gpu_gib, "traced": dataclasses.asdict(traced),
           "as_configured": per_gpu(traced, setting_of(config), gpus, t.grad_accum_steps > 1),
           "proposal": None if fit is None else {"overrides": fit[0].overrides, **fit[1]}}
    if conversations:
        per_epoch = steps_per_epoch(config, conversations, gpus // max(1, t.deepspeed.sequence_parallel))
        epochs = t.epochs if t.epochs is not None else t.max_steps / per_epoch
        out["data"] = {"conversations": conversations, "tokens_per_epoch_at_most": conversations * tokens,
                       "steps_per_epoch": math.ceil(per_epoch), "epochs": epochs,
                       "steps": max(1, math.ceil(epochs * per_epoch))}
    return out


def _gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def describe(p: dict) -> list[str]:
    tr = p["traced"]
    lines = [f"[plan] {p['model']} ({p['recipe']}), {p['method']}: rows of {p['max_length']} tokens x "
             f"{p['micro_batch_size']} per step and rank; target {_gib(tr['target_weights'])} GiB in bf16, draft "
             f"{tr['draft_trainable'] / 1e6:.0f}M trainable parameters"]
    header = f"{'GiB per GPU':<28}" + "".join(f"{k:>19}" for k in p["as_configured"])
    lines += ["", header, f"{'as configured':<28}" + "".join(f"{_gib(v):>19}" for v in p["as_configured"].values())]
    if p["proposal"]:
        prop = {k: v for k, v in p["proposal"].items() if k != "overrides"}
        lines.append(f"{'proposed':<28}" + "".join(f"{_gib(v):>19}" for v in prop.values()))
        lines += ["", f"[plan] on {p['gpus']} GPU(s) of {p['gpu_gib']:g} GiB ({RESERVED_GIB:g} GiB each kept for "
                      f"CUDA and communication): {p['proposal']['overrides']}"]
    else:
        lines += ["", f"[plan] nothing fits {p['gpus']} GPU(s) of {p['gpu_gib']:g} GiB: add GPUs, or shorten "
                      "data.max_length"]
    if "data" in p:
        d = p["data"]
        lines.append(f"[plan] {d['conversations']} conversations: at most {d['tokens_per_epoch_at_most'] / 1e6:.1f}M "
                     f"tokens per epoch, {d['steps_per_epoch']} steps per epoch, {d['steps']} steps for "
                     f"{d['epochs']:g} epochs")
    return lines


def table(gpu_kinds=((1, 80), (1, 141), (8, 24), (8, 40), (8, 80))) -> dict:
    """The presets under the scale recipe: the GiB one GPU needs as configured, and the setting (and GiB per
    GPU) each set of GPUs takes; as a result file of docs/results (a table with its machine and date)."""
    import datetime

    from .compose import load_config

    rows, traced = [], {}
    for name in PRESETS:
        config = load_config([f"model={name}"])
        tr = traced_at(config, config.data.max_length)
        traced[name] = dataclasses.asdict(tr)
        cells = []
        for gpus, gib in gpu_kinds:
            fit = proposal(tr, gpus, gib, config.trainer, recomputes(config))
            cells.append("does not fit" if fit is None else f"`{fit[0].overrides}` ({fit[1]['total'] / GIB:.0f})")
        rows.append([name, config.data.max_length, f"{per_gpu(tr, setting_of(config), 1)['total'] / GIB:.0f}",
                     *cells])
    return {"machine": "any machine (fake tensors: nothing runs on a device)",
            "date": datetime.date.today().isoformat(),
            "note": "python -m specforge_lite.plan --table; the setting proposed for each set of GPUs, with its "
                    f"GiB per GPU in brackets ({RESERVED_GIB:g} GiB of each GPU kept for CUDA and communication)",
            "columns": ["target (recipe=scale)", "max_length", "GiB on one GPU as configured",
                        *(f"{g} x {m} GiB" for g, m in gpu_kinds)],
            "rows": rows, "traced": traced}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specforge_lite.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="the run's overrides, as train.py takes them")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs the run gets (default 1)")
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="memory of each GPU in GiB (default 80)")
    parser.add_argument("--conversations", type=int, default=None,
                        help="training conversations (for tokens and steps per epoch)")
    parser.add_argument("--table", action="store_true", help="the presets' table (docs/train-your-model.md)")
    parser.add_argument("--out", default=None, help="also write the result as JSON here")
    a = parser.parse_args(argv)
    from .compose import load_config
    from .errors import UserError
    from .settings import check_settings

    try:
        if a.table:
            result = table()
            print("\n".join(["| " + " | ".join(map(str, r)) + " |" for r in [result["columns"], *result["rows"]]]))
        else:
            config = load_config(a.overrides)
            check_settings(config)
            result = plan(config, a.gpus, a.gpu_gib, a.conversations or config.data.max_samples)
            print("\n".join(describe(result)))
    except (UserError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
