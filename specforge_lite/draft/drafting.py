"""What a draft's drafting gives an evaluation, whatever the method: the round's greedy choice with its confidence
(``greedy_with_confidence``, which every method's drafting reports) and a draft tree (``DraftTree``, what a method
that drafts trees proposes for EAGLE-2's tree verification in evaluate/tree.py). Each method's drafting is in its
folder (EAGLE3's chain and tree: methods/eagle3/drafting.py; P-EAGLE's one forward over mask slots:
methods/eagle3/parallel.py; a block draft's: methods/dflash/); evaluation asks the method for it
(``DraftMethod.drafting``), so it never names one."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """Nodes in an order where every parent comes before its children."""

    tokens: list[int]  # target ids
    parents: list[int]  # index of the parent node, -1 for children of the root (the committed token)
    depths: list[int]  # 1 for children of the root
    scores: list[float]  # cumulative draft log-probability from the root

    def children(self) -> dict[int, list[int]]:
        """Child indices of each node (-1: the root), best score first."""
        kids: dict[int, list[int]] = {-1: []}
        for i, p in enumerate(self.parents):
            kids.setdefault(p, []).append(i)
            kids.setdefault(i, [])
        for key in kids:
            kids[key].sort(key=lambda i: -self.scores[i])
        return kids

    def visible(self) -> torch.Tensor:
        """[N+1, N+1] bool over [root] + nodes: which verify positions each position attends to."""
        n = len(self.tokens)
        seen = torch.eye(n + 1, dtype=torch.bool)
        seen[:, 0] = True
        for i, p in enumerate(self.parents):
            if p >= 0:
                seen[i + 1] |= seen[p + 1]
        return seen


def greedy_with_confidence(logits: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """Each row's greedy draft id [N] and the draft's probability of it: its confidence that the token is
    accepted, which the evaluation holds against what was (calibration)."""
    best = logits.argmax(-1)  # (on the logits as computed: the token is the one drafted without this)
    return best, torch.softmax(logits.float(), -1).gather(-1, best[:, None])[:, 0].tolist()
