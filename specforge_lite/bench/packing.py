"""Training-step throughput with and without sequence packing, on the same micro-batches side by side.

    python -m specforge_lite.bench packing [--micro-batch 8] [--batches 4] [overrides]

Each micro-batch of real training conversations is run unpacked (right-padded rows) and packed into
rows of data.max_length (data.packing=true); the losses must agree, and the ratio of training tokens/s
is what packing buys. Default overrides: model=smollm2_135m recipe=none (the bundled conversations as
they are, no regeneration).
"""

from __future__ import annotations

import argparse
import time

import torch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m specforge_lite.bench packing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro-batch", type=int, default=8, help="conversations per micro-batch")
    p.add_argument("--batches", type=int, default=4, help="timed micro-batches (after one warm-up)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides (default: model=smollm2_135m recipe=none)")
    a = p.parse_args(argv)

    from ..compose import load_config
    from ..data.loader import collate, collate_packed
    from ..data import pad_id
    from ..run import Run

    config = load_config(["tracker=none", "model=smollm2_135m", "recipe=none", *a.overrides])
    run = Run.online(config, log=lambda m: None)
    draft = run.build_draft()
    pad, n = pad_id(run.tokenizer), a.micro_batch
    groups = [[run.train_data[i] for i in range(s, s + n)] for s in range(0, n * (a.batches + 1), n)]
    times = {"unpacked": 0.0, "packed": 0.0}
    cells = {"unpacked": 0, "packed": 0}
    tokens = 0
    for step, rows in enumerate(groups):
        losses = {}
        packed = collate_packed(rows, pad, config.data.max_length)
        for name, batch in (("unpacked", collate(rows, pad)), ("packed", packed)):
            batch = batch.to(run.target.device)
            t0 = time.perf_counter()
            out = run.objective(draft, run.teacher, batch)
            out.loss.backward()
            elapsed = time.perf_counter() - t0
            draft.zero_grad(set_to_none=True)
            losses[name] = float(out.loss.detach())
            if step > 0:  # the first micro-batch warms up allocators and kernels
                times[name] += elapsed
                cells[name] += batch.input_ids.numel()
        if abs(losses["packed"] - losses["unpacked"]) > 1e-3 * max(abs(losses["unpacked"]), 1.0):
            raise SystemExit(f"packed and unpacked losses differ: {losses}")
        if step > 0:
            tokens += sum(len(r["input_ids"]) for r in rows)
    print(f"target {config.model.name}; {a.batches} micro-batches of {n} conversations, {tokens} real tokens, "
          f"data.max_length {config.data.max_length}; {torch.get_num_threads()} threads")
    for name in times:
        print(f"  {name:9s} {tokens / times[name]:7.0f} training tokens/s; {cells[name]} token slots "
              f"({1 - tokens / cells[name]:.0%} padding)")
    print(f"packed / unpacked throughput: {times['unpacked'] / times['packed']:.2f}x (losses equal)")
