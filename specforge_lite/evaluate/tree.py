"""Tree verification (EAGLE-2's dynamic tree) of the trees a draft proposes, at temperature 0 and above.

Each round the draft grows a tree from the committed token (its method's drafting, ``propose_tree``: EAGLE3's in
methods/eagle3/drafting.py): the ``topk`` best children of the root, then
``depth - 1`` times the ``topk`` best frontier nodes (by cumulative draft log-probability) each get
their ``topk`` best children; the ``budget`` best nodes of the whole tree are kept (an ancestor always
outranks its descendants, so the kept set is a tree). The target scores every kept node in one forward,
each node attending to the context and its own ancestors (a 4D mask), and the round commits the longest
path the target accepts plus one token of the target's own.

Acceptance walks down from the root. At a node the target's distribution p is known; the node's children
are tried best-first, child x being accepted with probability p(x) / sum(p) and, when rejected, removed
from p. If no child is accepted the next token is drawn from what is left of p. Each emitted token is
therefore distributed exactly as p (a child's chance is p(x), and the leftover draw covers the rest), so
the output is the target's own sampling distribution; at temperature 0 p is the target's argmax and the
walk keeps the child equal to it. (The children are the draft's top-k, deterministic given the context,
which is why their draft probabilities do not enter the test.)
"""

from __future__ import annotations

import torch

from ..config import EvalConfig
from ..draft.drafting import DraftTree
from ..methods import draft_method
from .spec_decode import Generation, _croppable, _cut, _new_cache

TREE = EvalConfig(drafting="tree")  # what a method is asked whether it can be evaluated with


def _verify_tree(target, cache, next_token: int, tree: DraftTree, context_len: int):
    """The target's cached forward over ``[next_token] + tree``, each position seeing the context and its
    ancestors: aux states and logits per position."""
    device = target.device
    seen = tree.visible().to(device)
    q = seen.shape[0]
    mask = torch.zeros(1, 1, q, context_len + q, dtype=target.dtype, device=device)
    mask[..., context_len:] = torch.where(seen, 0.0, torch.finfo(target.dtype).min)
    positions = torch.tensor([[context_len] + [context_len + d for d in tree.depths]], device=device)
    return target.forward_cached(torch.tensor([[next_token] + tree.tokens], device=device), cache,
                                 attention_mask=mask, position_ids=positions)


def _keep_rows(cache, context_len: int, rows: torch.Tensor) -> None:
    """Keep, after the context, only the verified positions ``rows`` (the accepted path) in every layer."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue  # layers that share another layer's cache
        idx = rows.to(layer.keys.device) + context_len
        layer.keys = torch.cat([layer.keys[..., :context_len, :], layer.keys.index_select(-2, idx)], dim=-2)
        layer.values = torch.cat([layer.values[..., :context_len, :], layer.values.index_select(-2, idx)], dim=-2)


def _walk(logits: torch.Tensor, tree: DraftTree, children: dict[int, list[int]], temperature: float,
          generator: torch.Generator | None) -> tuple[list[int], int]:
    """The accepted path (node indices) and the token that follows it (see the module docstring)."""
    path, node = [], -1
    while True:
        row = logits[node + 1].float()
        if temperature <= 0:
            top = int(row.argmax())
            hit = next((c for c in children[node] if tree.tokens[c] == top), None)
            if hit is None:
                return path, top
        else:
            p = torch.softmax(row / temperature, -1).cpu()
            hit = None
            for c in children[node]:
                x = tree.tokens[c]
                if float(torch.rand((), generator=generator)) * float(p.sum()) < float(p[x]):
                    hit = c
                    break
                p[x] = 0.0
            if hit is None:
                return path, int(torch.multinomial(p / p.sum(), 1, generator=generator))
        path.append(hit)
        node = hit


def check_tree_support(target, draft=None) -> None:
    """A tree can be drafted by this draft (its method says) and verified by this target (its family says)."""
    if draft is not None:
        refused = draft_method(draft.spec.method).refused_evaluation(draft.spec, TREE)
        if refused:
            raise ValueError("; ".join(refused))
    if not target.family.supports_tree_mask:
        raise ValueError(f"the {target.family.name} family cannot verify a draft tree in one forward (recurrent or "
                         "model-computed positions); use eval.drafting=chain")


@torch.no_grad()
def tree_generate(target, draft, prompt: list[int], max_new_tokens: int, depth: int, topk: int, budget: int,
                  stop_ids: set[int], temperature: float = 0.0, generator: torch.Generator | None = None,
                  inputs: dict | None = None) -> Generation:
    """Speculative decoding with a draft tree per round; ``Generation.accepted`` holds the accepted depth."""
    check_tree_support(target, draft)
    device = target.device
    cache = _new_cache(target)
    aux_new, logits = target.forward_cached(torch.tensor([prompt], device=device), cache, **(inputs or {}))
    if not _croppable(cache):
        raise ValueError(f"the {target.family.name} target keeps sliding-window or recurrent cache layers, which "
                         "cannot drop a tree's rejected branches; use eval.drafting=chain")
    if temperature > 0:
        next_token = int(torch.multinomial(torch.softmax(logits[0, -1].float() / temperature, -1).cpu(), 1,
                                           generator=generator))
    else:
        next_token = int(logits[0, -1].argmax())
    drafted = draft_method(draft.spec.method).drafting(draft)
    context, gen = list(prompt), Generation([next_token])
    while len(gen.tokens) < max_new_tokens and next_token not in stop_ids:
        tree = drafted.propose_tree(aux_new, context, next_token, depth, topk, budget)
        aux_verified, vlogits = _verify_tree(target, cache, next_token, tree, len(context))
        path, following = _walk(vlogits[0], tree, tree.children(), temperature, generator)
        rows = torch.tensor([0] + [c + 1 for c in path])
        _keep_rows(cache, len(context), rows)
        aux_new = [new[:, rows.to(new.device)] for new in aux_verified]
        accepted_tokens = [tree.tokens[c] for c in path]
        gen.accepted.append(len(path))
        gen.contexts.append(len(context))
        context += [next_token] + accepted_tokens
        next_token = following
        gen.tokens += accepted_tokens + [next_token]
        if any(t in stop_ids for t in accepted_tokens):
            break
    gen.tokens = _cut(gen.tokens, max_new_tokens, stop_ids)
    return gen
