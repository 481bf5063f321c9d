"""One case of the method x engine x precision matrix (tests/test_matrix.py in one process; the DeepSpeed
cases under torchrun through tests/distributed_worker.py): a draft built by the trainer's own builder for the
tiny target with one option that changes the computation, trained 3 optimizer steps on one fixed batch, as
the training loop does it (objective -> engine.backward -> engine.step). Returns each step's loss."""

from __future__ import annotations

import torch

from conftest import tiny_target, tiny_vocab
from specforge_lite.compose import load_config
from specforge_lite.data.loader import collate, collate_packed
from specforge_lite.methods import METHODS, build_objective
from specforge_lite.run import build_draft
from specforge_lite.targets import Teacher
from specforge_lite.training.engine import build_engine

# Every draft method and option that changes what a training step computes, as train.py overrides.
OPTIONS = {
    "eagle3": [],
    "norm_before_fc": ["draft.norm_before_fc=true"],
    "norm_output": ["draft.norm_output=true"],
    "eagle31": ["draft.norm_before_fc=true", "draft.norm_output=true"],
    "two_layers": ["draft.num_layers=2"],
    "eagle31_two_layers": ["draft.norm_before_fc=true", "draft.norm_output=true", "draft.num_layers=2"],
    "aux_norm": ["draft.use_aux_norm=true"],
    "peagle": ["draft.parallel_drafting=true", "draft.mask_token_id=3"],
    "dflash": ["draft=dflash", "draft.mask_token_id=3", "eval.num_draft_tokens=3"],
    "dspark": ["draft=dspark", "draft.mask_token_id=3", "eval.num_draft_tokens=3", "draft.markov_rank=16"],
    "dflash2": ["draft=dflash2", "draft.mask_token_id=3", "eval.num_draft_tokens=3", "draft.selector_rank=16",
                "draft.selector_top_k=8"],
    "packing": ["data.packing=true"],
    "checkpointing": ["draft.checkpointing=true"],
    "dense_attention": ["draft.ttt_attention=dense"],
    "loss_acceptance": ["draft.loss=acceptance"],
    "loss_tv": ["draft.loss=tv"],
    "warm_start": ["draft.init_layers_from_target=true"],
    "frozen_head": ["draft.freeze_lm_head=true"],
}
STEPS = 3


def rows(first: int, count: int) -> list[dict]:
    """Conversations of a learnable pattern (counting upwards), the answer after 4 prompt tokens."""
    g = torch.Generator().manual_seed(first)
    out = []
    for _ in range(count):
        T, start = int(torch.randint(14, 30, (1,), generator=g)), int(torch.randint(0, 256, (1,), generator=g))
        out.append({"input_ids": [(start + i) % 256 for i in range(T)], "loss_mask": [0] * 4 + [1] * (T - 4)})
    return out


def case_losses(option: str, precision: str, ctx=None, deepspeed: bool = False, row: int | None = None) -> list[float]:
    """The losses of ``STEPS`` steps. ``row``: train on that one conversation pair's row only (a DeepSpeed
    rank's share, or its one-process reference); None: both rows as one micro-batch."""
    method = next((o.split("=")[1] for o in OPTIONS[option] if o.startswith("draft=")), "eagle3")
    steps = [f"draft.{key}={value}" for key, value in METHODS[method].steps_settings(3).items()]  # (3 scored)
    overrides = ["model=llama3_tiny", "tracker=none", *steps, f"trainer.precision={precision}",
                 "trainer.optimizer=adamw", "trainer.lr=3e-3", "trainer.warmup_ratio=0", f"trainer.max_steps={STEPS}",
                 "trainer.grad_clip=1.0",
                 *(["trainer=zero2"] if deepspeed else []), *OPTIONS[option]]
    config = load_config(overrides)
    target = tiny_target(aux_ids=[1, 3, 5])
    vocab = tiny_vocab(target, target.vocab_size)  # the whole vocabulary: every position counts
    draft = build_draft(config, target, vocab)
    teacher = Teacher(target, vocab.draft_to_target, vocab.t2d)
    objective = build_objective(config.draft)
    from specforge_lite.training.distributed import DistributedContext

    engine = build_engine(draft, config.trainer, ctx or DistributedContext())
    groups = [rows(10, 2), rows(20, 2)]  # two rows of two conversations each (packed) or two micro-batch rows
    chosen = groups if row is None else [groups[row]]
    if config.data.packing:
        batch = collate_packed([r for g in chosen for r in g], 0, 64)
    else:
        batch = collate([g[0] for g in chosen], 0)
    losses = []
    for _ in range(STEPS):
        out = objective(engine.forward, teacher, batch)
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss.detach()))
    return losses
