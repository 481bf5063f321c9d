"""How a chain draft (EAGLE3, EAGLE 3.1) proposes tokens at serving time, as servers run it: the draft's own KV
cache of the committed context, kept across verification rounds, and the k tokens of a round drafted one step
each (``DraftContext``, ``draft_chain``); the round's greedy choice with its confidence, which every method's
drafting reports (``greedy_with_confidence``). A method drafting otherwise builds on these in its folder
(P-EAGLE's one forward over mask slots: methods/eagle3/parallel.py; a block draft's: methods/dflash/).
Evaluation (evaluate/spec_decode.py) asks the method for its drafting (methods/<name>/), so it never names one."""

from __future__ import annotations

import torch

from .ttt import TTTCache


class DraftContext:
    """EAGLE3's drafting, one step per draft token (``draft_chain``). The draft's step-0 keys and values of
    the committed context, kept across rounds (a server's draft KV cache). A round runs the draft's first step
    only over the rows committed since the last round, their queries attending to the kept keys, so drafting
    costs (new rows x context) per round instead of (context x context). Rows are added only after the target
    verified them: nothing is rolled back.

    Row t of the first step reads the target's aux states at position t and the token at t + 1; the row
    of the newest committed position reads the token the target just chose (``next_token``)."""

    def __init__(self, draft):
        self.draft = draft
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per draft layer
        self.rows = 0
        self.confidences: list[float] = []  # the draft's probability of each token of the last proposal

    one_forward = False  # one draft step per proposed token

    def new_rows(self, aux_new: list[torch.Tensor], context: list[int]) -> tuple[int, int]:
        """(rows held, rows in the context): ``aux_new`` must hold the aux states of the rows in between."""
        first, n = self.rows, len(context)
        if aux_new[0].shape[1] != n - first:
            raise ValueError(f"{type(self).__name__} holds {first} rows and the context has {n}: expected the aux "
                             f"states of {n - first} new rows, got {aux_new[0].shape[1]}")
        return first, n

    def open_round(self, aux_new: list[torch.Tensor], context: list[int], next_token: int, cache_type=TTTCache):
        """The round's draft cache (holding every committed row's step-0 keys) and the draft state of the
        last committed row [1, 1, H]. ``aux_new``: the aux states of the rows ``self.rows .. len(context)-1``."""
        first, n = self.new_rows(aux_new, context)
        device = aux_new[0].device
        tokens = torch.tensor([(context + [next_token])[first + 1:]], device=device)
        cache = cache_type(context=self.kept)
        h = self.draft.step(tokens, self.draft.project_aux(aux_new), torch.arange(first, n, device=device)[None],
                            cache, q_offset=first)[:, -1:]
        self.kept, self.rows = cache.context_kv(), n
        return cache, h

    def propose(self, aux_new: list[torch.Tensor], context: list[int], next_token: int, k: int) -> list[int]:
        return draft_chain(self, aux_new, context, next_token, k)


def draft_chain(drafted: DraftContext, aux_new: list[torch.Tensor], context: list[int], next_token: int,
                k: int) -> list[int]:
    """k greedy draft tokens after ``context + [next_token]`` (target ids); ``aux_new``: the aux states of
    the context rows ``drafted`` does not hold yet."""
    draft, device, n = drafted.draft, aux_new[0].device, len(context)
    cache, h = drafted.open_round(aux_new, context, next_token)
    proposals, drafted.confidences = [], []
    for j in range(k):
        best, confidence = greedy_with_confidence(draft.compute_logits(h)[0, -1:])
        d = int(draft.draft_to_target(best[0]))
        drafted.confidences += confidence
        proposals.append(d)
        if j + 1 < k:  # step j+1 at row n-1 stands for position n-1+(j+1)
            ids, h = draft.next_step_inputs(torch.tensor([[d]], device=device), h)
            h = draft.step(ids, h, torch.tensor([[n + j]], device=device), cache, q_offset=n - 1)
    return proposals


def greedy_with_confidence(logits: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """Each row's greedy draft id [N] and the draft's probability of it: its confidence that the token is
    accepted, which the evaluation holds against what was (calibration)."""
    best = logits.argmax(-1)  # (on the logits as computed: the token is the one drafted without this)
    return best, torch.softmax(logits.float(), -1).gather(-1, best[:, None])[:, 0].tolist()
