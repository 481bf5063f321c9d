"""Builders for each stage, so train.py, eval and the benchmarks wire the same objects the same way."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .config import Config
from .data import DraftVocab, build_draft_vocab
from .data.images import image_inputs
from .data.vocab import choose_mask_token
from .draft import Draft, Eagle3Spec, draft_method
from .draft.methods import draft_vocab_size
from .generation import LazyGenerator
from .targets import HFTarget, Target
from .targets.hf import BACKENDS
from .targets.families import get_family


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
        from .targets.sharding import shard_target_zero3

        shard_target_zero3(target.model, ctx.world_size)
    return target


def load_tokenizer(target: Target, chat_template: str | None = None) -> Any:
    """The target's tokenizer with a chat template: ``chat_template`` (a Jinja file) if given, else the
    tokenizer's own, else the family's documented turn format (base checkpoints ship none)."""
    from pathlib import Path

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


def describe_precision(config: Config, target: Target) -> str:
    """One line for the run's log: the dtypes the target, its answer generator and the draft's training
    use, and why `auto` chose them on this machine."""
    from .device import dtype_name, native_bf16, resolve_dtype
    from .training.distributed import use_bf16

    support = native_bf16(target.device)
    gen = config.data.generation.dtype
    generation = dtype_name(target.dtype if gen == "auto" else resolve_dtype(gen, target.device))
    training = "bf16 autocast" if use_bf16(config.trainer.precision, target.device) else "fp32"
    chosen = [f"target {dtype_name(target.dtype)}" + (" (auto)" if config.model.dtype == "auto" else ""),
              f"generation {generation}" + (" (auto)" if gen == "auto" else ""),
              f"draft training {training}" + (" (auto)" if config.trainer.precision == "auto" else "")]
    verdict = "native" if support.native else "not native"
    return f"{', '.join(chosen)}; bf16 is {verdict} on {target.device.type}: {support.reason}"


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def prepare(config: Config, target: HFTarget, tokenizer, log=print):
    """The data stage, with the target as the answer generator when data.regenerate is on."""
    from .data import prepare_data

    server = vllm_server(config, target, log)  # (engine openai with no server_url; started on first use)
    generator = LazyGenerator(config, target, tokenizer, server)
    sg = config.data.self_generated
    writer = LazyGenerator(config, target, tokenizer, server, temperature=sg.temperature, top_p=sg.top_p,
                           max_new_tokens=sg.max_new_tokens, seed=sg.seed)
    try:
        return prepare_data(config.data, tokenizer, generate=generator, model_fingerprint=generator.fingerprint(),
                            log=log, images=image_inputs(target), request_writer=writer)
    finally:
        if server is not None:
            server.stop()


def vllm_server(config: Config, target: HFTarget, log=print):
    """The vLLM server the openai engine starts from the serving environment, when no server_url is given:
    the target's own folder, its generation dtype, a context of the target's positions (at most 32k)."""
    gen = config.data.generation
    if gen.engine != "openai" or gen.server_url:
        return None
    from .device import dtype_name, resolve_dtype
    from .serving import VLLMServer

    positions = getattr(target.config, "max_position_embeddings", None) or 32768
    dtype = target.dtype if gen.dtype == "auto" else resolve_dtype(gen.dtype, target.device)
    return VLLMServer(str(target.location), min(positions, 32768), dtype_name(dtype), gen.server_memory_fraction,
                      log=log)


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


def mask_slot_token(config: Config, target: Target, tokenizer=None, log=print) -> int | None:
    """draft.mask_token_id, or for a draft with mask slots and none set, the one ``choose_mask_token`` picks
    from the target's tokenizer (``tokenizer``; None: loaded from the target's checkpoint folder)."""
    d = config.draft
    if d.mask_token_id is not None or not draft_method(d.method).has_mask_slots(d):
        return d.mask_token_id
    if tokenizer is None:
        from transformers import AutoTokenizer

        from .targets.acquire import resolve_model_dir

        tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(config.model))
    token, why = choose_mask_token(tokenizer, target.vocab_size)
    log(f"[draft] mask slots embed token {token}: {why} (set draft.mask_token_id to choose another)")
    return token


def build_draft(config: Config, target: Target, vocab: DraftVocab, tokenizer=None, log=print) -> Draft:
    if config.draft.attn_implementation != "eager":
        raise ValueError(f"draft.attn_implementation={config.draft.attn_implementation!r}: only 'eager' (the TTT "
                         "attention pattern in plain PyTorch, draft/ttt.py) is implemented")
    draft_config = dataclasses.replace(config.draft, mask_token_id=mask_slot_token(config, target, tokenizer, log))
    spec = Eagle3Spec.from_target(target.config, draft_config, target.aux_layer_ids, target.convention,
                                  vocab_size=target.vocab_size, draft_vocab_size=vocab.size,
                                  target_hidden_size=target.hidden_size)
    torch.manual_seed(config.trainer.seed)
    draft = draft_method(spec.method).model(spec)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    if config.draft.init_lm_head_from_target:
        rows = target.head_rows(vocab.draft_to_target)[0].float()
        draft.init_lm_head_from_target(rows, torch.arange(vocab.size))
    if config.draft.init_layers_from_target:
        top = max(spec.aux_layer_ids)
        if top + spec.num_layers > target.num_layers:
            raise ValueError(f"draft.init_layers_from_target: the draft's {spec.num_layers} layer(s) start as target "
                             f"layers {top}.. after the top aux id {top}, and the target has {target.num_layers}; "
                             "lower "
                             "the top of draft.aux_layer_ids or draft.num_layers")
        draft.start_from_target([target.llama_layer(top + i) for i in range(spec.num_layers)],
                                target.final_norm_weight())
    draft.to(target.device)
    draft.set_embedding(target.embedding_weight())
    return frozen_as_configured(draft, config)


def frozen_as_configured(draft: Draft, config: Config) -> Draft:
    """draft.freeze_lm_head: the lm_head keeps its rows (the optimizer, checkpoints' optimizer state and ZeRO
    take trainable weights only; the weights themselves are saved and exported whole)."""
    if config.draft.freeze_lm_head:
        draft.lm_head.requires_grad_(False)
    return draft


def initial_draft(config: Config, log=print) -> tuple[Eagle3Spec, dict[str, torch.Tensor]]:
    """draft.init_from: the (spec, weights) of the draft a run continues, from an export folder or a run folder's
    final/. Its method must be the run's (the objective trains that method)."""
    from pathlib import Path

    from .export import load_export

    source = Path(config.draft.init_from).expanduser()
    folder = source / "final" if (source / "final" / "config.json").is_file() else source
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"draft.init_from={config.draft.init_from}: no draft there (an export folder with a "
                                "config.json, or a run folder with final/); give the folder of the draft to continue")
    spec, weights = load_export(folder)
    if spec.method != config.draft.method:
        raise ValueError(f"draft.init_from={config.draft.init_from} is a {spec.method} draft and this run trains "
                         f"draft.method={config.draft.method}: set draft.method={spec.method}")
    ids = spec.aux_layer_ids or "the servers' default (it names none)"
    log(f"[draft] continuing the {spec.method} draft of {folder} (its {spec.num_layers} layer(s), aux ids "
        f"{ids} and {spec.draft_vocab_size}-token vocabulary)")
    return spec, weights


def draft_from_weights(spec: Eagle3Spec, weights: dict[str, torch.Tensor], target: Target) -> Draft:
    """A draft rebuilt from a checkpoint or export, wired to its target's embedding (a published draft's spec
    completed for the target first: export/published.py)."""
    from .export import fit_to_target
    from .export.published import weight_mismatch

    if spec.target_hidden_size != target.hidden_size or spec.vocab_size != target.vocab_size:
        raise ValueError(f"the draft was trained for a target with hidden size {spec.target_hidden_size} and vocab "
                         f"{spec.vocab_size}; this target has {target.hidden_size} and {target.vocab_size}")
    draft = draft_method(spec.method).model(fit_to_target(spec, target.num_layers))
    # an export may carry the target's embedding (export.include_embeddings); the draft reads the target's own
    weights = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()
               if not k.startswith("embed_tokens.")}
    problem = weight_mismatch(draft.state_dict(), weights)
    if problem:
        raise ValueError(f"draft weights do not fit: {problem}")
    draft.load_state_dict(weights)
    draft.to(target.device)
    draft.set_embedding(target.embedding_weight())
    return draft.eval()
