"""Capture throughput through a vLLM server (target.backend=vllm) against the in-process capture, on one machine.

    python -m specforge_lite.bench served_capture [--model smollm2_135m] [--seq-len 256] [--batch 4] \\
        [--batches 4] [--server-url URL] [hydra overrides]

The same batches of token ids (right-padded rows of lengths from T/2 to T) are captured by the target in this
process (target.backend=hf, and lean where the family has a lean forward) and by a vLLM server: the one the run
would start from the serving environment (started here, stopped at the end), or the one at ``--server-url``.
The first batch of each is a warm-up (it starts the server); the figures are the other batches' tokens over
their time. Printed: the CPU model, capture tokens/s of each backend, the server's against the best in-process
one, and the buffer's peak bytes (the server's files read and not yet deleted at once: one batch's at most).
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def batches(count: int, batch: int, seq_len: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    found = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (batch, seq_len), generator=g)
        mask = torch.zeros_like(ids)
        for r in range(batch):
            mask[r, : seq_len // 2 + (seq_len // 2) * r // max(batch - 1, 1)] = 1
        found.append((ids, mask))
    return found


def tokens_per_second(target, work: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    times = []
    for ids, mask in work:
        t0 = time.perf_counter()
        target.capture(ids, mask)
        times.append(time.perf_counter() - t0)
    return sum(int(m.sum()) for _, m in work[1:]) / sum(times[1:]) if len(work) > 1 else 0.0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m specforge_lite.bench served_capture", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2_135m", help="model preset")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--batches", type=int, default=4, help="batches per backend, the first a warm-up")
    p.add_argument("--server-url", default=None, help="a running vLLM server started with the extraction options "
                                                      "(default: start one from the serving environment)")
    p.add_argument("overrides", nargs="*", help="further Hydra overrides")
    a = p.parse_args(argv)

    from ..compose import load_config
    from ..targets import HFTarget, build_target
    from ..targets.served import served_target_problems

    # (no data is read: the batches are random token ids)
    base = [f"model={a.model}", "tracker=none", f"data.max_length={a.seq_len}", "data.regenerate=false", *a.overrides]
    served = [*base, "target.backend=vllm", *([f"target.server_url={a.server_url}"] if a.server_url else [])]
    config = load_config(served)
    problems = served_target_problems(config)
    if problems:
        raise SystemExit("error: " + "; ".join(problems))
    hf = build_target(load_config(base))
    work = batches(a.batches, a.batch, a.seq_len, hf.vocab_size)
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads; target {config.model.name} ({hf.dtype}), "
          f"aux ids {hf.aux_layer_ids}; {a.batches - 1} timed batches of {a.batch} rows up to {a.seq_len} tokens")
    rates = {"hf": tokens_per_second(hf, work)}
    lean = HFTarget(hf.model, hf.family, hf.aux_layer_ids, hf.location, backend="lean")
    if lean.lean is not None:
        rates["lean"] = tokens_per_second(lean, work)
    lean.close()
    hf.close()
    del hf, lean
    target = build_target(config, log=lambda m: None)
    try:
        rates["vllm server"] = tokens_per_second(target, work)
        peak = target.peak_buffer_bytes
    finally:
        target.close()
    best = max(v for k, v in rates.items() if k != "vllm server")
    for name, rate in rates.items():
        print(f"  {name:12s} {rate:9.1f} capture tokens/s")
    print(f"  server / best in-process: {rates['vllm server'] / best:.2f}x; buffer peak {peak / 2**20:.2f} MiB "
          f"({peak} bytes: the files of one batch at most)")


if __name__ == "__main__":
    main()
