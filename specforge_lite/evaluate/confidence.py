"""What a draft's confidences are worth to a server, from the rounds of our greedy chain decoding (each round:
how many draft tokens the target accepted, and the draft's confidence in each token it proposed: the
probability of the token under the draft, or DSpark's confidence head).

- ``calibration``: per position, how well the confidence predicts acceptance (expected calibration error).
- ``fitted_calibration``: a Platt fit, sigmoid(a * logit(confidence) + b), learned on half of the prompts'
  rounds and judged on the other half's; recorded in the export so that a server, or a user, can read
  calibrated values.
- ``adaptive_verification``: what sizing verification from the confidences buys, as vLLM's adaptive
  verification does it (the draft slots of a batch ranked by survival, the running product of a request's
  confidences, and the best ones verified within a budget), with every round a request of one batch.
"""

from __future__ import annotations

import math

import torch

def calibration(accepted_per_round: list[int], confidences: list[list[float]], k: int, bins: int = 10) -> dict:
    """How well the draft's probability of its token predicts that the token is accepted, per draft position,
    over the rounds that reached the position (every earlier token accepted; greedy verification accepts a
    token exactly when it is the target's). ece: the expected calibration error, the reached rounds binned
    by confidence into ``bins`` equal-width bins and each bin's |mean confidence - accepted share| weighted
    by its share of them; null for a position no round reached or whose confidences were not recorded."""
    ece, mean_confidence, reached = [], [], []
    for i in range(k):
        pairs = [(c[i], a > i) for a, c in zip(accepted_per_round, confidences) if a >= i and len(c) > i]
        reached.append(len(pairs))
        ece.append(_ece(pairs, bins))
        mean_confidence.append(sum(c for c, _ in pairs) / len(pairs) if pairs else None)
    return {"ece_per_position": ece, "mean_confidence_per_position": mean_confidence,
            "rounds_reached_per_position": reached, "bins": bins}


def _reached_pairs(accepted_per_round: list[int], confidences: list[list[float]],
                   rounds: range | list[int] | None = None) -> list[tuple[float, bool]]:
    """(confidence, accepted) of every draft position a round reached (every earlier token accepted)."""
    chosen = range(len(accepted_per_round)) if rounds is None else rounds
    return [(confidences[r][i], accepted_per_round[r] > i) for r in chosen
            for i in range(len(confidences[r])) if accepted_per_round[r] >= i]


def _ece(pairs: list[tuple[float, bool]], bins: int = 10) -> float | None:
    if not pairs:
        return None
    binned: dict[int, list[tuple[float, bool]]] = {}
    for conf, hit in pairs:
        binned.setdefault(min(int(conf * bins), bins - 1), []).append((conf, hit))
    return sum(abs(sum(c for c, _ in b) - sum(h for _, h in b)) for b in binned.values()) / len(pairs)


def _logit(p: float) -> float:
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


def platt(confidence: float, a: float, b: float) -> float:
    """The calibrated confidence: sigmoid(a * logit(confidence) + b)."""
    return 1.0 / (1.0 + math.exp(-(a * _logit(confidence) + b)))


def fitted_calibration(accepted_per_round: list[int], confidences: list[list[float]], prompts: list | None = None,
                       steps: int = 500) -> dict | None:
    """A Platt fit of the confidences to acceptance: (a, b) minimising the binary cross-entropy over the reached
    positions of half the prompts, and the expected calibration error before and after it on the other half
    (held out of the fit). ``prompts``: each round's prompt (any hashable); the prompts are taken in turn, in
    the order they first appear, so a prompt's rounds, which share its context, are all on one side (None:
    each round its own). None without enough positions on both sides."""
    recorded = [r for r in range(len(accepted_per_round)) if confidences[r]]
    prompts = list(range(len(accepted_per_round))) if prompts is None else list(prompts)
    order = {p: i for i, p in enumerate(dict.fromkeys(prompts[r] for r in recorded))}
    sides = [[r for r in recorded if order[prompts[r]] % 2 == side] for side in (0, 1)]
    fit, judge = (_reached_pairs(accepted_per_round, confidences, rounds) for rounds in sides)
    if len(fit) < 20 or len(judge) < 20 or len({h for _, h in fit}) < 2:
        return None
    x = torch.tensor([_logit(c) for c, _ in fit], dtype=torch.float64)
    y = torch.tensor([float(h) for _, h in fit], dtype=torch.float64)
    ab = torch.tensor([1.0, 0.0], dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([ab], max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(ab[0] * x + ab[1], y)
        loss.backward()
        return loss

    optimizer.step(closure)
    a, b = (float(v) for v in ab.detach())
    return {"kind": "platt", "a": a, "b": b, "fit_positions": len(fit), "judged_positions": len(judge),
            "fit_prompts": (len(order) + 1) // 2, "judged_prompts": len(order) // 2,
            "ece_before": _ece(judge), "ece_after": _ece([(platt(c, a, b), h) for c, h in judge])}


def adaptive_verification(accepted_per_round: list[int], confidences: list[list[float]], k: int,
                          budgets: tuple[float, ...] = (0.25, 0.5, 0.75)) -> dict | None:
    """Verification sized from the confidences, as vLLM's adaptive verification sizes it: every round is a
    request of one batch, each draft slot scored by its survival (the product of its round's confidences up to
    it), and the best ``budget`` share of all slots verified (a prefix of each round, since survival only falls
    along a round). A round then keeps min(accepted, verified) of its drafts. Against it, the same budget spent
    without confidences: every round its first slots, as evenly as the budget divides. Per budget: the accepted
    drafts per verified slot and the tokens per verification (the target's own token counted) of both. None
    when the rounds recorded no confidences."""
    rounds = [(a, c[:k]) for a, c in zip(accepted_per_round, confidences) if len(c) >= k]
    if not rounds:
        return None
    n, out = len(rounds), {}
    survival = torch.tensor([c for _, c in rounds], dtype=torch.float64).cumprod(dim=1)  # [rounds, k]
    accepted = torch.tensor([a for a, _ in rounds])
    for share in budgets:
        budget = max(1, round(share * n * k))
        admitted = torch.zeros(n * k, dtype=torch.bool)
        admitted[survival.flatten().topk(budget).indices] = True
        with_conf = admitted.view(n, k).sum(1)
        even = torch.full((n,), budget // n) + (torch.arange(n) < budget % n).long()  # the first slots of each
        out[f"{share:g}"] = {
            policy: {"accepted_per_verified_slot": float(torch.minimum(accepted, verified).sum()) / budget,
                     "tokens_per_verification": 1 + float(torch.minimum(accepted, verified).sum()) / n}
            for policy, verified in (("by_confidence", with_conf), ("without", even))}
    return {"rounds": n, "budgets": out}
