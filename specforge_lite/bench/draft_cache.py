"""Time of one chain drafting round at evaluation, with the draft's KV cache and without it.

    python -m specforge_lite.bench draft_cache [--shape smollm2|llama3_8b] [--contexts 512,2048,8192]
        [--k 3] [--commit 2] [--repeats 5]

A round drafts k tokens after a context of n tokens, of which ``--commit`` were committed by the last
round. "cached" keeps the draft's step-0 keys of the context (methods/eagle3/drafting.py DraftContext): the
round runs the draft's first step over the committed rows only. "recompute" runs the first step over
all n rows every round (evaluation before the cache). Random aux states, fp32, the target not run;
the median of --repeats rounds each, side by side in one process, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


@torch.no_grad()
def _round_seconds(draft, aux, context: list[int], k: int, commit: int, cached: bool, repeats: int) -> float:
    from ..methods.eagle3.drafting import DraftContext, draft_chain

    n, times = len(context) - 1, []  # the last token is the one drafted after
    for _ in range(repeats):
        drafted = DraftContext(draft)
        if cached:  # untimed: the rows committed before the last round are already in the cache
            drafted.open_round([a[:, : n - commit] for a in aux], context[: n - commit], context[n - commit])
        t0 = time.perf_counter()
        draft_chain(drafted, [a[:, drafted.rows:n] for a in aux], context[:n], context[n], k)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m specforge_lite.bench draft_cache", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2", help="smollm2 | llama3_8b | llama3_70b")
    p.add_argument("--contexts", default="512,2048,8192")
    p.add_argument("--k", type=int, default=3, help="draft tokens per round")
    p.add_argument("--commit", type=int, default=2, help="rows committed by the previous round")
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)

    from ..methods.eagle3.settings import Eagle3Settings
    from .shapes import SHAPES, synthetic_draft

    shape = SHAPES[a.shape]
    draft = synthetic_draft(shape, Eagle3Settings(), a.draft_vocab).eval()
    print(f"draft of {a.shape} shape, k={a.k}, {a.commit} rows committed per round, fp32, median of {a.repeats}")
    print("| context | recompute ms/round | cached ms/round | recompute / cached |\n|---|---|---|---|")
    for n in [int(x) for x in a.contexts.split(",")]:
        g = torch.Generator().manual_seed(n)
        aux = [torch.randn(1, n, shape["hidden_size"], generator=g) for _ in draft.spec.aux_layer_ids]
        context = torch.randint(0, draft.spec.draft_vocab_size, (n + 1,), generator=g).tolist()
        slow = _round_seconds(draft, aux, context, a.k, a.commit, False, a.repeats)
        fast = _round_seconds(draft, aux, context, a.k, a.commit, True, a.repeats)
        print(f"| {n} | {slow * 1e3:.1f} | {fast * 1e3:.1f} | {slow / fast:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
