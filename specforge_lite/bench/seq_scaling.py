"""Peak memory and tokens/s of one draft training step (capture excluded) as rows grow long.

    python -m specforge_lite.bench seq_scaling [--shape smollm2|llama3_8b] [--seq-lens 2048,8192,32768]
        [--ttt 7] [--max-gib 20] [--ways dense,blockwise,blockwise+ckpt]
    torchrun --nproc_per_node 2 -m specforge_lite.bench seq_scaling --sequence-parallel 2 ...

One step = the TTT unroll, its loss and the backward, on one row of T tokens with random aux states and
teacher logits (the target is not run). Three ways, measured side by side in one process:
"dense" (every step's [T, T] scores held, the lm_head + loss in one chunk: the attention before
draft.ttt_attention=blockwise), "blockwise" (the defaults: attention in query blocks merged through the
log-sum-exp, the fused lm_head + loss in row chunks) and "blockwise+ckpt" (draft.checkpointing=true as
well). A way whose estimated memory exceeds --max-gib is skipped and says so. The growth per 4x of T
is printed per way; the last line names the memory ratio of the two longest rows 4x apart.

``--sequence-parallel N`` (under a launcher with N processes, gloo): each rank runs its share of every
row (draft/sequence_parallel.py, DeepSpeed's all-to-all); the memory printed is rank 0's, the tokens/s
the group's. The same step timed against the peers' own code: ``python -m studies step_speed`` (a checkout).
"""

from __future__ import annotations

import argparse
import time

import torch

WAYS = {"dense": dict(attention="dense", loss_chunk_rows=0), "blockwise": dict(attention="blockwise"),
        "blockwise+ckpt": dict(attention="blockwise", checkpointing=True)}


def _dense_bytes(shape: dict, T: int, ttt: int) -> int:
    """What dense attention alone keeps for backward: scores and probabilities of every step, fp32."""
    return 2 * ttt * shape["num_attention_heads"] * T * T * 4


def _sequence_shard(size: int):
    """(this rank's SequenceShard or None, a print that only rank 0 speaks through)."""
    if size == 1:
        return None, print
    import deepspeed

    from ..training.distributed import launcher_env, with_sequence_parallel

    deepspeed.init_distributed(dist_backend="gloo")
    ctx = with_sequence_parallel(launcher_env(), size)
    return ctx.sequence_shard(), (lambda *args, **kw: print(*args, **kw) if ctx.is_main else None)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m specforge_lite.bench seq_scaling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2", help="smollm2 | llama3_8b (a Llama-3-8B-shaped draft) | llama3_70b")
    p.add_argument("--seq-lens", default="2048,8192,32768")
    p.add_argument("--ttt", type=int, default=7, help="TTT unroll steps")
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--max-gib", type=float, default=20.0, help="skip a way whose estimate exceeds this")
    p.add_argument("--ways", default=",".join(WAYS), help="which of " + ", ".join(WAYS))
    p.add_argument("--sequence-parallel", type=int, default=1, help="ranks sharing each row (under torchrun)")
    a = p.parse_args(argv)
    shard, say = _sequence_shard(a.sequence_parallel)

    from ..methods.eagle3.settings import Eagle3Settings
    from ..methods.eagle3.objective import TTTObjective
    from .memory import peak_bytes
    from .shapes import SHAPES, synthetic_draft, synthetic_row

    shape = SHAPES[a.shape]
    draft = synthetic_draft(shape, Eagle3Settings(), a.draft_vocab)
    H, Vd, device = shape["hidden_size"], a.draft_vocab, torch.device("cpu")
    say(f"draft of {a.shape} shape: hidden {H}, {shape['num_attention_heads']} heads, draft vocab {Vd}, "
        f"TTT {a.ttt}, fp32, one row per step"
        + (f", each row shared by {a.sequence_parallel} ranks (per-rank memory)" if shard else ""))
    ways = {w: WAYS[w] for w in a.ways.split(",")}
    results: dict[str, dict[int, tuple[float, float]]] = {w: {} for w in ways}
    say("| T | way | peak MiB | tokens/s |\n|---|---|---|---|")
    for T in [int(x) for x in a.seq_lens.split(",")]:
        inputs = synthetic_row(shape, T, Vd)
        for way, options in ways.items():
            if way == "dense" and _dense_bytes(shape, T, a.ttt) > a.max_gib * 2**30:
                say(f"| {T} | {way} | skipped: its scores alone need "
                    f"{_dense_bytes(shape, T, a.ttt) / 2**30:.0f} GiB | |", flush=True)
                continue
            objective = TTTObjective(a.ttt, **options, sequence=shard)

            def step():
                objective.unroll(draft, inputs).loss.backward()
                draft.zero_grad(set_to_none=True)

            peak = peak_bytes(step, device)  # (also the warm-up of the timed run)
            t0 = time.perf_counter()
            step()
            results[way][T] = (peak / 2**20, T / (time.perf_counter() - t0))
            say(f"| {T} | {way} | {results[way][T][0]:.0f} | {results[way][T][1]:.0f} |", flush=True)
    say()
    last = None
    for way, by_t in results.items():
        ts = sorted(by_t)
        for lo, hi in zip(ts, ts[1:]):
            if hi == 4 * lo:
                ratio = by_t[hi][0] / by_t[lo][0]
                say(f"{way}: memory x{ratio:.2f} from T={lo} to T={hi} (linear: x4, quadratic: x16)")
                if way != "dense":
                    last = (way, lo, hi, ratio)
    if last:
        say(f"memory ratio {last[2]}/{last[1]} ({last[0]}): {last[3]:.2f}")


if __name__ == "__main__":
    main()
