"""Bytes per token of our hidden-state store (final state or top-k teacher) vs SpecForge's per-sample
``torch.save`` layout.

    python -m specforge_lite.bench store [--model llama3_tiny] [--samples 64] [--dtype bfloat16] [overrides]

One run dumps a store of the preset's prepared data with ``python -m specforge_lite.offline dump``'s
code, then writes the same samples the way SpecForge's offline mode does (peers.md: one ``torch.save``
file per sample with input_ids, loss_mask, the final hidden state and the 3 aux states, at the same
dtype), and compares the bytes on disk of each per token. The store's one-off target parts (embedding,
final norm, draft rows) are reported separately: they do not grow with the data.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch


def _size(paths) -> int:
    return sum(p.stat().st_size for p in paths)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m specforge_lite.bench store", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3_tiny")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--topk", type=int, default=32, help="k of the store.teacher=topk variant")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)

    from ..compose import load_config
    from ..offline import StoreReader
    from ..offline.dump import dump
    from ..run import Run
    from ..targets.store import PARTS

    with tempfile.TemporaryDirectory() as tmp:
        sizes = {}
        for teacher in ("final", "topk"):
            folder = Path(tmp) / teacher
            config = load_config([f"model={a.model}", "recipe=none", "tracker=none", f"data.max_samples={a.samples}",
                                  f"store.path={folder}", f"store.dtype={a.dtype}", f"store.teacher={teacher}",
                                  f"store.topk={a.topk}", *a.overrides])
            dump(Run.online(config, log=lambda m: None), log=lambda m: None)
            reader = StoreReader(folder)
            sizes[teacher] = _size(folder / s["file"] for s in reader.manifest.shards)
        reader = StoreReader(Path(tmp) / "final")
        m = reader.manifest
        ours = sizes["final"]
        parts = (Path(tmp) / "final" / PARTS).stat().st_size
        theirs_dir = Path(tmp) / "specforge"
        theirs_dir.mkdir()
        for i in range(len(reader)):
            s = reader.sample(i)
            aux = s["aux"]  # [T, 3, H]
            torch.save({"input_ids": s["input_ids"].long(), "loss_mask": s["loss_mask"].long(),
                        "hidden_state": s["final"].clone(), "aux_hidden_state": aux.flatten(1).clone()},
                       theirs_dir / f"data_{i}.ckpt")
        theirs = _size(theirs_dir.glob("*.ckpt"))
    tokens, H = m.tokens, m.hidden_size
    print(f"{a.model}: {len(reader)} samples, {tokens} tokens, hidden {H}, {len(m.aux_layer_ids)} aux states + final, "
          f"{a.dtype}")
    print(f"  ours (safetensors shards):         {ours / tokens:10.1f} bytes/token  ({ours / 2**20:.2f} MiB)")
    print(f"  SpecForge layout (torch.save each): {theirs / tokens:10.1f} bytes/token  ({theirs / 2**20:.2f} MiB)")
    print(f"  ours, store.teacher=topk (k={a.topk}):  {sizes['topk'] / tokens:10.1f} bytes/token")
    print(f"  ratio ours/SpecForge: {ours / theirs:.3f}x (final state), {sizes['topk'] / theirs:.3f}x (top-{a.topk} "
          f"teacher); target parts kept once: {parts / 2**20:.2f} MiB")
    big = 2880  # gpt-oss-120b's hidden size, the model of SpecForge's 1.17 GB per 64k-token sample
    k_bytes = a.topk * (torch.tensor([], dtype=getattr(torch, a.dtype)).element_size() + 4)
    elt = torch.tensor([], dtype=getattr(torch, a.dtype)).element_size()
    theirs_big, ours_big = 4 * big * elt + 16, 3 * big * elt + k_bytes + 6
    print(f"  at hidden {big} the same layouts give {theirs_big} vs {4 * big * elt + 6} (final) / {ours_big} (top-k) "
          f"bytes/token: {ours_big / theirs_big:.2f}x with the top-k teacher")
    state = (len(m.aux_layer_ids) + 1) * H * torch.tensor([], dtype=getattr(torch, a.dtype)).element_size()
    print(f"  the states themselves are {state} bytes/token in both; ours adds 6 bytes/token (int32 ids, mask, "
          f"in-vocab flag), SpecForge's layout 16 (int64 ids and mask) plus per-file overhead")


if __name__ == "__main__":
    main()
