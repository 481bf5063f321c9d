"""Training throughput and where the time goes, plus the memory of our capture vs output_hidden_states.

    python -m specforge_lite.bench train_step [--seq-len 512] [--steps 4] [--precisions fp32,bf16] [overrides]

Everything is measured in one process, side by side, and reported as ratios (the machine is noisy).
"""

from __future__ import annotations

import argparse
import time

import torch


def _fixed_length_batch(dataset, seq_len: int, pad: int):
    """Real training conversations concatenated to exactly ``seq_len`` tokens (with their loss masks)."""
    from ..data.loader import collate

    ids, mask = [], []
    for row in dataset:
        ids += row["input_ids"]
        mask += row["loss_mask"]
        if len(ids) >= seq_len:
            break
    if len(ids) < seq_len:
        raise ValueError(f"the dataset holds fewer than {seq_len} tokens")
    return collate([{"input_ids": ids[:seq_len], "loss_mask": mask[:seq_len]}], pad)


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m specforge_lite.bench train_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=4, help="timed steps per precision (after one warm-up step)")
    p.add_argument("--precisions", default="fp32,bf16", help="draft precisions to compare, e.g. fp32,bf16")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=smollm2_135m draft.ttt_length=7")
    a = p.parse_args(argv)

    from ..compose import load_config
    from ..draft.objective import UnrollInputs
    from ..data import pad_id
    from ..run import Run
    from ..training.distributed import use_bf16
    from ..training.optim import build_optimizer
    from .memory import peak_bytes

    config = load_config(["tracker=none", *a.overrides])
    run = Run.online(config, log=lambda m: None)
    target, vocab, objective = run.target, run.vocab, run.objective
    batch = _fixed_length_batch(run.train_data, a.seq_len, pad_id(run.tokenizer)).to(target.device)
    n_tok = batch.num_tokens
    print(f"target {config.model.name} ({target.num_layers} layers, {target.dtype}) on {target.device}; "
          f"draft vocab {vocab.size}, {run.method.name} scoring {run.method.scored_steps(config.draft)} steps; "
          f"batch 1 x {a.seq_len} tokens, "
          f"{int(batch.loss_mask.sum())} with loss; {torch.get_num_threads()} threads")

    results = {}
    for precision in a.precisions.split(","):
        draft = run.build_draft()
        opt = build_optimizer(draft.named_parameters(), config.trainer)
        split = {"target": 0.0, "draft_fwd": 0.0, "draft_bwd": 0.0, "optimizer": 0.0}
        for step in range(a.steps + 1):
            cap, t_cap = _timed(lambda: target.capture(batch.input_ids, batch.attention_mask))
            needed = objective.teacher_positions(batch.loss_mask)
            (teacher, in_vocab), t_teach = _timed(lambda: run.teacher(cap, needed))

            def forward():
                with torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=use_bf16(precision)):
                    return objective.unroll(draft, UnrollInputs(cap.aux, batch.input_ids, teacher, in_vocab,
                                                                batch.loss_mask))

            out, t_fwd = _timed(forward)
            _, t_bwd = _timed(lambda: out.loss.backward())
            _, t_opt = _timed(lambda: (opt.step(), opt.zero_grad(set_to_none=True)))
            if step > 0:  # step 0 warms up allocators and kernels
                for k, v in zip(split, (t_cap + t_teach, t_fwd, t_bwd, t_opt)):
                    split[k] += v
        total = sum(split.values())
        results[precision] = a.steps * n_tok / total
        print(f"\n[{precision} draft] {results[precision]:.0f} training tokens/s; time split: "
              + ", ".join(f"{k} {v / total:.0%}" for k, v in split.items()))
    if len(results) > 1:
        names = list(results)
        ratios = [f"{n}/{names[0]} = {results[n] / results[names[0]]:.2f}x" for n in names[1:]]
        print("\nthroughput ratios: " + ", ".join(ratios))

    ids = batch.input_ids
    ours = peak_bytes(lambda: target.capture(ids), target.device)
    with torch.no_grad():
        theirs = peak_bytes(lambda: target.model(input_ids=ids, output_hidden_states=True, use_cache=False),
                            target.device)
    aux_bytes = sum(t.numel() * t.element_size() for t in target.capture(ids).aux)
    print(f"\npeak memory at {a.seq_len} tokens: our capture {ours / 2**20:.1f} MiB vs output_hidden_states=True "
          f"{theirs / 2**20:.1f} MiB -> ratio {ours / max(theirs, 1):.2f} (the aux states themselves: "
          f"{aux_bytes / 2**20:.1f} MiB)")
