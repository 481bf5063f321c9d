"""A target at a real model's shape with random weights (no download), a draft of any method for it, and rows
captured through it: what a measurement of one draft step at scale runs on."""

from __future__ import annotations

import torch

from ..targets.shapes import shape_fields


def _preset(path: str) -> tuple[str, str, dict]:
    """A hub preset's shipped shape (targets/shapes.py) as (model type, family, config fields)."""
    model_type, fields = shape_fields(path)
    return model_type, model_type, fields


# Target presets by shape: (transformers model type, family, config fields). Random weights of this shape.
TARGETS = {
    "llama3_8b": _preset("meta-llama/Llama-3.1-8B-Instruct"),
    "llama3_70b": _preset("meta-llama/Llama-3.3-70B-Instruct"),
    "qwen3_32b": _preset("Qwen/Qwen3-32B"),
    "tiny": ("llama", "llama", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                    num_key_value_heads=2, num_hidden_layers=8, vocab_size=512,
                                    max_position_embeddings=4096, rms_norm_eps=1e-5,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}


def build_target(name: str, device: torch.device, dtype: torch.dtype):
    """An HFTarget (lean forward) of the preset's shape, random weights made directly on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..targets.families import get_family
    from ..targets.hf import HFTarget

    model_type, family, fields = TARGETS[name]
    config = AutoConfig.for_model(model_type, **fields)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)  # matrices; norm weights
    rotary = model.model.rotary_emb  # its inv_freq buffer is not a parameter: made again on the device
    model.model.rotary_emb = type(rotary)(config=config).to(device)
    model.config.use_cache = False
    return HFTarget(model, get_family(family), None, location=f"random weights, {name} shape", backend="lean")


def build_draft(target, method: str, draft_vocab: int, ttt: int, device: torch.device):
    """A draft of ``method`` for ``target`` (fp32 master weights), its vocabulary a fixed random draw."""
    from ..methods import build_objective
    from ..targets.teacher import Teacher

    draft, cfg, ids, t2d = new_draft(target.config, target.aux_layer_ids, target.embedding_weight(),
                                     target.full_head()[0], method, draft_vocab, ttt, device)
    return draft, cfg, Teacher(target, ids, t2d), build_objective


def new_draft(config, aux_layer_ids: list[int], embedding: torch.Tensor, head: torch.Tensor, method: str,
              draft_vocab: int, ttt: int, device: torch.device):
    """(draft, its settings, its vocabulary's target ids, t2d) for a target of ``config`` whose embedding and
    lm_head are given; the vocabulary is a fixed random draw."""
    from ..methods import draft_method
    from ..targets.capture import CONVENTION

    vocab_size, hidden_size = embedding.shape
    # (mask token 0: read only by the methods with mask slots)
    chosen = draft_method(method)  # (``ttt``: the positions it scores, EAGLE3's unroll or a block draft's k)
    cfg = chosen.settings(draft_vocab_size=draft_vocab, mask_token_id=0, **chosen.steps_settings(ttt))
    draft_vocab = chosen.draft_vocab_size(cfg, vocab_size)  # (DFlash 2 keeps the whole vocabulary, as a run does)
    spec = chosen.new_spec(config, cfg, aux_layer_ids, CONVENTION, vocab_size=vocab_size, draft_vocab_size=draft_vocab,
                           target_hidden_size=hidden_size)
    torch.manual_seed(0)
    draft = chosen.model(spec).to(device)
    g = torch.Generator().manual_seed(1234)
    ids = torch.randperm(vocab_size, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab((ids - torch.arange(draft_vocab)).to(device), t2d.to(device))
    draft.set_embedding(embedding)
    draft.init_lm_head_from_target(head, ids)
    return draft, cfg, ids, t2d


def capture(target, teacher, T: int, seed: int):
    """One row of T random tokens through the target: (UnrollInputs with every row scored, final state)."""
    from ..draft.objective import DraftObjective, UnrollInputs

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (1, T), generator=g).to(target.device)
    loss_mask = torch.ones(1, T, dtype=torch.long, device=target.device)
    captured = target.capture(ids)
    logits, in_vocab = teacher(captured, DraftObjective.teacher_positions(loss_mask))
    return UnrollInputs(captured.aux, ids, logits, torch.ones_like(in_vocab), loss_mask), captured.final_hidden


def packed(inputs, T: int, seed: int):
    """The first ``T`` rows of ``inputs`` as packed conversations of random lengths (positions restarting at 0
    where each starts), as data.packing makes them: (UnrollInputs, number of conversations)."""
    from ..draft.objective import UnrollInputs

    g = torch.Generator().manual_seed(seed)
    lengths, left = [], T
    while left > 0:
        lengths.append(min(left, int(torch.randint(max(T // 8, 1), max(T // 3, 2), (1,), generator=g))))
        left -= lengths[-1]
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(inputs.input_ids.device)
    head = lambda t: t[:, :T]  # noqa: E731
    return UnrollInputs([head(a) for a in inputs.aux], head(inputs.input_ids), head(inputs.teacher_logits),
                        head(inputs.in_vocab), head(inputs.loss_mask), positions), len(lengths)
