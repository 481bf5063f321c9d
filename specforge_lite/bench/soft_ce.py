"""The draft's soft cross-entropy against the memory-bandwidth limit: python -m specforge_lite.bench soft_ce

Times the loss of one unroll's rows (tokens x TTT steps rows of draft-vocabulary logits, in chunks of
draft.loss_chunk_rows, each row's teacher row read through its index as draft/head_loss.py does) three ways on a
GPU: the eager chain, the compiled chain (draft.compile) and the Triton kernel (draft/soft_ce_kernel.py). Each
way moves at least the logits (read), each row's teacher row (read) and the logits' gradient (written); those
bytes over its seconds, against the device's copy bandwidth (one large tensor copy in the same run: the HBM limit
in practice), say how far it is from memory-bound. On a CPU (or with --dry-run) the eager chain alone runs at tiny
shapes: a check that the command runs."""

from __future__ import annotations

import argparse
import json

import torch

from ..draft import fused
from ..draft.head_loss import chunk_soft_ce
from .timing import measure

WAYS = ("eager", "compiled", "kernel")


def loss_inputs(tokens: int, steps: int, vocab: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Random logits [tokens x steps, vocab], the teacher's logits [tokens, vocab] (every step's row i reads
    teacher row i), its argmax per row and the rows' weights (each step's rows weigh 1 / tokens)."""
    g = torch.Generator(device=device).manual_seed(0)
    teacher = 4 * torch.randn(tokens, vocab, generator=g, device=device, dtype=dtype)
    rows = torch.arange(tokens, device=device).repeat(steps)
    return {"z": torch.randn(tokens * steps, vocab, generator=g, device=device, dtype=dtype), "teacher": teacher,
            "rows": rows, "top": teacher.argmax(-1)[rows],
            "weights": torch.full((tokens * steps,), 1 / tokens, device=device)}


def loss_over_chunks(way: str, inputs: dict, chunk_rows: int):
    """A call computing every row's loss and logit gradient ``way``'s way, chunk by chunk (each chunk's gradient
    dropped once made, as the head turns it at once into its rows' gradients); it returns the rows' losses."""
    z, chunk = inputs["z"], chunk_soft_ce(way == "kernel")

    def run() -> torch.Tensor:
        losses = torch.empty(z.shape[0], device=z.device)
        with fused.compiled(way == "compiled"):
            for s in range(0, z.shape[0], chunk_rows):
                part = slice(s, s + chunk_rows)
                losses[part] = chunk(z[part], inputs["teacher"], inputs["rows"][part], inputs["top"][part],
                                     inputs["weights"][part], z.dtype)[0]
        return losses
    return run


def least_bytes(inputs: dict) -> int:
    """Bytes every way moves at least: the logits and each row's teacher row read once, the gradient written once."""
    z, teacher = inputs["z"], inputs["teacher"]
    return z.numel() * z.element_size() * 2 + z.numel() * teacher.element_size()


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes per second of one tensor copy of ``nbytes`` (read and written: twice its size moved)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return 2 * src.nbytes / measure(lambda: dst.copy_(src), device, repeats)["seconds"]


def measure_ways(tokens: int, steps: int, vocab: int, chunk_rows: int, repeats: int, dtype: torch.dtype,
                 device: torch.device, ways: tuple[str, ...], copy_bytes: int) -> dict:
    """Each way's milliseconds, bytes per second and fraction of the copy bandwidth, and the largest relative
    difference of its rows' losses from the eager chain's."""
    inputs = loss_inputs(tokens, steps, vocab, dtype, device)
    copy = copy_bandwidth(device, copy_bytes, repeats)
    moved = least_bytes(inputs)
    reference = loss_over_chunks("eager", inputs, chunk_rows)()
    measured = {}
    for way in ways:
        run = loss_over_chunks(way, inputs, chunk_rows)
        losses = run()  # (also the warm-up: compiles)
        seconds = measure(run, device, repeats, warm_up=False)["seconds"]
        diff = float(((losses - reference).abs() / reference.abs().clamp_min(1e-6)).max())
        measured[way] = {"ms": seconds * 1e3, "bytes_per_s": moved / seconds, "of_copy": moved / seconds / copy,
                         "loss_max_rel_diff": diff}
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "tokens": tokens,
            "steps": steps, "draft_vocab": vocab, "chunk_rows": chunk_rows, "dtype": str(dtype).removeprefix("torch."),
            "least_bytes": moved, "copy_bytes_per_s": copy, "ways": measured}


def report(result: dict) -> str:
    lines = [f"soft cross-entropy on {result['device']}: {result['tokens']} tokens x {result['steps']} steps, "
             f"draft vocab {result['draft_vocab']}, {result['dtype']} logits, chunks of {result['chunk_rows']} rows; "
             f"{result['least_bytes'] / 1e9:.2f} GB moved at least; copy bandwidth "
             f"{result['copy_bytes_per_s'] / 1e12:.2f} TB/s"]
    for way, m in result["ways"].items():
        lines.append(f"  {way:9s} {m['ms']:9.2f} ms  {m['bytes_per_s'] / 1e12:6.2f} TB/s  {m['of_copy']:5.2f}x of "
                     f"the HBM limit  (loss: max rel diff from eager {m['loss_max_rel_diff']:.1e})")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m specforge_lite.bench soft_ce", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--steps", type=int, default=7, help="TTT steps: rows = tokens x steps")
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--chunk-rows", type=int, default=4096, help="draft.loss_chunk_rows (a GPU's default)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes, the eager chain only (so on a CPU)")
    p.add_argument("--out", default=None, help="also write the results here as JSON")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        shape = (a.tokens, a.steps, a.draft_vocab, a.chunk_rows, a.repeats)
        ways, copy_bytes = WAYS, 2 << 30
    else:
        shape, ways, copy_bytes = (16, 3, 300, 32, 1), ("eager",), 1 << 20
    result = measure_ways(*shape, torch.bfloat16, device, ways, copy_bytes)
    print(report(result))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
