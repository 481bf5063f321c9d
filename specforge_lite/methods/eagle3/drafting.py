"""How an EAGLE3 draft proposes tokens at serving time, as servers run it: the draft's own KV cache of the committed
context, kept across verification rounds (``DraftContext``), and each round's k tokens drafted one step each
(``draft_chain``) or a tree of them (``draft_tree``, EAGLE-2's dynamic tree, which evaluate/tree.py verifies)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ...draft.drafting import DraftTree, greedy_with_confidence
from .ttt import TreeCache, TTTCache


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

    def propose_sampled(self, aux_new: list[torch.Tensor], context: list[int], next_token: int, k: int,
                        choose: Callable[[torch.Tensor], tuple[int, torch.Tensor]]) -> tuple[list[int], list]:
        """k draft tokens, each drawn by ``choose`` from the state of its step (speculative sampling: the token
        and the distribution it was drawn from), one step each (a P-EAGLE draft's later steps read its mask
        slots' inputs, as its one forward does: the same distributions)."""
        return stepwise(self, aux_new, context, next_token, k, choose)

    def propose_tree(self, aux_new: list[torch.Tensor], context: list[int], next_token: int, depth: int, topk: int,
                     budget: int) -> DraftTree:
        return draft_tree(self, aux_new, context, next_token, depth, topk, budget)

    def round_at_width(self, aux: list[torch.Tensor], prompt: list[int], k: int, width: int) -> Callable[[], None]:
        """One round of ``k`` draft steps over ``width`` nodes each (1: a chain; a tree's top-k) after ``prompt``,
        whose aux states are ``aux``, made ready: calling it runs the steps alone (what evaluation times)."""
        draft, device, n = self.draft, aux[0].device, len(prompt)
        cache = TreeCache()
        h = draft.step(torch.tensor([prompt[1:] + prompt[-1:]], device=device), draft.project_aux(aux),
                       torch.arange(n, device=device)[None], cache)[:, -1:].expand(1, width, -1)

        def run() -> None:
            x = h
            for d in range(k):
                cache.add_nodes(list(range(d * width - width, d * width)) if d else [-1] * width)
                x = draft.step(torch.tensor([prompt[-1:] * width], device=device), x,
                               torch.full((1, width), n + d, device=device), cache)
                draft.compute_logits(x).topk(width, dim=-1)
        return run


def draft_chain(drafted: DraftContext, aux_new: list[torch.Tensor], context: list[int], next_token: int,
                k: int) -> list[int]:
    """k greedy draft tokens after ``context + [next_token]`` (target ids); ``aux_new``: the aux states of
    the context rows ``drafted`` does not hold yet. Their confidences: ``drafted.confidences``."""
    def greedy(h: torch.Tensor) -> tuple[int, float]:
        best, confidence = greedy_with_confidence(drafted.draft.compute_logits(h)[0, -1:])
        return int(drafted.draft.draft_to_target(best[0])), confidence[0]

    proposals, drafted.confidences = stepwise(drafted, aux_new, context, next_token, k, greedy)
    return proposals


def stepwise(drafted: DraftContext, aux_new: list[torch.Tensor], context: list[int], next_token: int, k: int,
             choose: Callable[[torch.Tensor], tuple[int, Any]]) -> tuple[list[int], list[Any]]:
    """k draft tokens after ``context + [next_token]``, one draft step each: ``choose`` takes the step's output
    state [1, 1, H] and gives the token (a target id) with what it knows of it (a confidence, a distribution)."""
    draft, device, n = drafted.draft, aux_new[0].device, len(context)
    cache, h = drafted.open_round(aux_new, context, next_token)
    proposals, known = [], []
    for j in range(k):
        d, what = choose(h)
        proposals.append(d)
        known.append(what)
        if j + 1 < k:  # step j+1 at row n-1 stands for position n-1+(j+1)
            ids, h = draft.next_step_inputs(torch.tensor([[d]], device=device), h)
            h = draft.step(ids, h, torch.tensor([[n + j]], device=device), cache, q_offset=n - 1)
    return proposals, known


@torch.no_grad()
def draft_tree(drafted: DraftContext, aux_new: list[torch.Tensor], context: list[int], next_token: int, depth: int,
               topk: int, budget: int) -> DraftTree:
    """The draft's tree after ``context + [next_token]`` (target ids); ``aux_new``: the aux states of the
    context rows ``drafted`` does not hold yet."""
    draft, device, n = drafted.draft, aux_new[0].device, len(context)
    cache, h = drafted.open_round(aux_new, context, next_token, TreeCache)
    logp = torch.log_softmax(draft.compute_logits(h)[0, -1].float(), -1)
    best = logp.topk(min(topk, logp.numel()))
    # Every candidate node: token, parent candidate, depth, score, and the draft state it was predicted from.
    tokens = draft.draft_to_target(best.indices).tolist()
    parents, depths, scores = [-1] * len(tokens), [1] * len(tokens), best.values.tolist()
    source = [h[0, 0]] * len(tokens)
    frontier = list(range(len(tokens)))
    in_cache: dict[int, int] = {}  # candidate -> its key's index in the tree cache (expanded nodes only)
    for d in range(1, depth):
        expand = sorted(frontier, key=lambda c: -scores[c])[:topk]
        cache.add_nodes([in_cache[parents[c]] if parents[c] >= 0 else -1 for c in expand])
        for c in expand:
            in_cache[c] = len(in_cache)
        out = draft.step(torch.tensor([[tokens[c] for c in expand]], device=device),
                         torch.stack([source[c] for c in expand])[None],
                         torch.full((1, len(expand)), n - 1 + d, device=device), cache)
        logp = torch.log_softmax(draft.compute_logits(out)[0].float(), -1)  # [len(expand), Vd]
        kids = logp.topk(min(topk, logp.shape[-1]), dim=-1)
        frontier = []
        for row, c in enumerate(expand):
            for lp, idx in zip(kids.values[row].tolist(), draft.draft_to_target(kids.indices[row]).tolist()):
                frontier.append(len(tokens))
                tokens.append(idx)
                parents.append(c)
                depths.append(d + 1)
                scores.append(scores[c] + lp)
                source.append(out[0, row])
    # Rerank (EAGLE-2): the best nodes overall; ties go to the shallower node so parents precede children.
    keep = sorted(range(len(tokens)), key=lambda c: (-scores[c], depths[c]))[:budget]
    keep.sort(key=lambda c: (depths[c], -scores[c]))
    where = {c: i for i, c in enumerate(keep)}
    return DraftTree(tokens=[tokens[c] for c in keep],
                     parents=[where[parents[c]] if parents[c] >= 0 else -1 for c in keep],
                     depths=[depths[c] for c in keep], scores=[scores[c] for c in keep])
