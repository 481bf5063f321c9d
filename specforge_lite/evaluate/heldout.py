"""Teacher-forced draft accuracy per TTT step on held-out conversations."""

from __future__ import annotations

import torch

from ..data.loader import collate
from ..draft.objective import DraftObjective, sim_accepted_drafts


@torch.no_grad()
def heldout_accuracy(objective: DraftObjective, teacher, draft, dataset, pad_id: int, max_conversations: int,
                     images=None) -> dict:
    was_training = draft.training
    draft.eval()
    tally = objective.tally()
    conversations = min(max_conversations, len(dataset))
    for i in range(conversations):
        batch = collate([dataset[i]], pad_id, images).to(teacher.device)
        tally.add(objective(draft, teacher, batch))
    draft.train(was_training)
    if conversations == 0:
        return {"acc": [], "sim_accepted_drafts": 0.0, "tokens": 0}
    accs = tally.accuracies()
    return {"acc": accs, "sim_accepted_drafts": sim_accepted_drafts(accs), "tokens": tally.scored}
