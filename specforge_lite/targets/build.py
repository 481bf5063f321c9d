"""The target a run drafts for, built from its settings: its weights on the configured backend (replicated, or
partitioned across ranks), and its tokenizer with a chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import Config
from .families import get_family
from .hf import BACKENDS, HFTarget
from .protocol import Target


def build_target(config: Config, aux_layer_ids=None, ctx=None, parts_only: bool = False) -> HFTarget:
    """The frozen target on the configured backend (``target.backend``: hf | lean), replicated on every
    rank or, with ``target.shard=zero3`` in a distributed run (``ctx``), partitioned across the ranks.
    ``parts_only``: only the embedding, final norm and lm_head read from the checkpoint (a store's ingest)."""
    get_family(config.model.family)  # an unknown family fails before any download
    ids = aux_layer_ids if aux_layer_ids is not None else config.draft.aux_layer_ids
    backend, shard = config.target.backend, config.target.shard
    backend = "lean" if backend == "custom" else backend  # (the lean backend's former name, still read)
    if backend not in BACKENDS:
        raise ValueError(f"target.backend={backend!r}: use hf (transformers modules) or lean (our lean forward)")
    if shard not in ("none", "zero3"):
        raise ValueError(f"target.shard={shard!r}: use none (a whole target per rank) or zero3 (partitioned)")
    if shard == "zero3":
        if ctx is None or not ctx.enabled:
            raise ValueError("target.shard=zero3 partitions the target across ranks: launch several processes "
                             "(torchrun --nproc_per_node N train.py trainer=zero2 target.shard=zero3 ...)")
        if backend != "hf":
            raise ValueError("target.shard=zero3 runs the transformers modules (target.backend=hf): the lean "
                             "forward reads whole weights, which ZeRO-3 keeps partitioned")
    target = HFTarget.from_config(config.model, ids, backend, parts_only)
    if shard == "zero3" and not parts_only:
        from .sharding import shard_target_zero3

        shard_target_zero3(target.model, ctx.world_size)
    return target


def describe_target(config: Config, target: Target) -> str:
    """The target as a run's log names it: where it came from, its shape, the layers it captures, where it runs."""
    return (f"{config.model.name} from {target.location}: {target.num_layers} layers, hidden {target.hidden_size}, "
            f"vocab {target.vocab_size}, aux ids {target.aux_layer_ids} ({target.convention}) on "
            f"{target.device}/{target.dtype}")


def load_tokenizer(target: Target, chat_template: str | None = None) -> Any:
    """The target's tokenizer with a chat template: ``chat_template`` (a Jinja file) if given, else the
    tokenizer's own, else the family's documented turn format (base checkpoints ship none)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target.location, trust_remote_code=getattr(target, "trust_remote_code", False))
    if chat_template:
        path = Path(chat_template).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"model.chat_template={chat_template!r} is not a file; give a Jinja template file")
        tok.chat_template = path.read_text()
    elif tok.chat_template is None:
        tok.chat_template = target.family.fallback_chat_template
    if tok.chat_template is None:
        raise ValueError(f"the tokenizer at {target.location} has no chat template and the {target.family.name} family "
                         "has no documented turn format; the loss mask needs one: "
                         "model.chat_template=/path/to/template.jinja")
    return tok
