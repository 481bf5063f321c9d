"""What both peer drivers share: their arguments, the vocabulary map, the timing loop and the JSON line.

A driver times one EAGLE3 draft training step of a peer's own code (its TTT unroll, its loss, then
backward) in fp32 on CPU: no target model, no optimizer step. It prints one JSON line on stdout
(peer, version, seq_len, ttt, median_s, tokens_per_s, peak_rss_mib, notes); details go to stderr.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore")


def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--shape", default='{"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, '
                   '"num_key_value_heads": 3, "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 100000.0}',
                   help="the target's Llama config fields, as JSON (default: SmolLM2-135M)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    a.shape = json.loads(a.shape)
    import torch

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    return a


def vocab_map(vocab_size: int, draft_vocab_size: int):
    """(t2d [V] bool, d2t [Vd]) for a fixed random choice of draft tokens, the same in both drivers."""
    import torch

    g = torch.Generator().manual_seed(1234)
    draft_ids = torch.randperm(vocab_size, generator=g)[:draft_vocab_size].sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return t2d, draft_ids - torch.arange(draft_vocab_size)


def time_steps(name: str, step, params, repeats: int) -> float:
    """Median seconds of ``step()`` (forward + backward) over ``repeats`` runs after a warm-up, grads
    dropped before each run outside the timing."""
    times = []
    for i in range(repeats + 1):
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
        if i == 0:
            print(f"[{name}] warm-up {times[0]:.2f}s loss {float(loss):.4f}", file=sys.stderr)
    print(f"[{name}] step seconds {[round(t, 3) for t in times[1:]]}", file=sys.stderr)
    return statistics.median(times[1:])


def report(peer: str, a: argparse.Namespace, seconds: float, notes: str) -> None:
    from importlib.metadata import version

    print(json.dumps({"peer": peer, "version": version(peer), "seq_len": a.seq_len, "ttt": a.ttt,
                      "median_s": seconds, "tokens_per_s": a.seq_len / seconds,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "notes": notes}))
