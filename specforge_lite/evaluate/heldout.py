"""Teacher-forced draft accuracy per TTT step on held-out conversations."""

from __future__ import annotations

import torch

from ..data.loader import collate
from ..training.loop import batch_loss, sim_accept_len


@torch.no_grad()
def heldout_accuracy(target, draft, dataset, pad_id: int, draft_cfg, max_conversations: int, images=None) -> dict:
    was_training = draft.training
    draft.eval()
    correct = valid = None
    for i in range(min(max_conversations, len(dataset))):
        batch = collate([dataset[i]], pad_id, images).to(target.device)
        out = batch_loss(target, draft, batch, draft_cfg)
        c = torch.stack([s.correct for s in out.steps]).float()
        v = torch.stack([s.valid for s in out.steps]).float()
        correct = c if correct is None else correct + c
        valid = v if valid is None else valid + v
    draft.train(was_training)
    if correct is None:
        return {"acc": [], "sim_accept_len": 0.0, "tokens": 0}
    accs = (correct / valid.clamp(min=1)).tolist()
    return {"acc": accs, "sim_accept_len": sim_accept_len(accs), "tokens": int(valid[0])}
