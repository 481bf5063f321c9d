"""Per-rank bytes of the draft's parameters, gradients and optimizer state under each ZeRO stage,
read from the real DeepSpeed engine after a real training step.

    python -m specforge_lite.bench memory [--trainer zero0,zero1,zero2,zero3] [--model llama3_8b] [--nproc 2]

The draft is built at full size for the preset's target (Llama 3 8B: hidden 4096, vocab 128256, draft
vocabulary 32000), one micro-batch of random aux states is trained through ``deepspeed.initialize``
(bf16 weights, fp32 master copy and Adam moments, as on GPUs), and every tensor the engine holds is
counted once by storage: parameters (this rank's partition under ZeRO-3), gradients after the
boundary backward, optimizer state (fp32 master partitions + Adam moments) after the step. The
frozen embedding the draft reads is the target's and is not in the engine. Each stage runs in its
own ``torchrun`` launch; the table compares them side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

from .shapes import SHAPES, synthetic_draft

# Target shapes of hub presets whose config.json is not reachable offline (from their model cards): the
# targets whose ZeRO memory is worth measuring (a draft for a small target fits any device).
KNOWN_TARGETS = {name: SHAPES[name] for name in ("llama3_8b", "llama3_70b")}


def _storages(tensors) -> dict[int, int]:
    out = {}
    for t in tensors:
        if t is None or not torch.is_tensor(t) or t.numel() == 0:
            continue
        out[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return out


def _flatten(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _flatten(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _flatten(v)


def worker(trainer: str, model: str, seq_len: int, out_path: str) -> None:
    from ..compose import load_config
    from ..draft.objective import UnrollInputs
    from ..methods import build_objective
    from ..training.distributed import init_distributed
    from ..training.engine import DeepSpeedEngine

    config = load_config([f"model={model}", f"trainer={trainer}", "tracker=none", "trainer.precision=bf16",
                          "trainer.micro_batch_size=1"])
    ctx = init_distributed(config.trainer)
    shape = KNOWN_TARGETS[model]
    draft = synthetic_draft(shape, config.draft, config.draft.draft_vocab_size)
    spec = draft.spec
    engine = DeepSpeedEngine(draft, config.trainer, ctx)
    module, opt = engine.module, engine.engine.optimizer
    T, H, Vd = seq_len, shape["hidden_size"], spec.draft_vocab_size
    g = torch.Generator().manual_seed(ctx.rank)
    aux = [torch.randn(1, T, H, generator=g) for _ in spec.aux_layer_ids]
    ids = torch.randint(0, spec.vocab_size, (1, T), generator=g)
    teacher = torch.randn(1, T, Vd, generator=g)
    ones = torch.ones(1, T, dtype=torch.bool)
    out = engine.forward(UnrollInputs(aux, ids, teacher, ones, ones.long()), build_objective(config.draft))
    engine.engine.backward(out.loss)

    params = _storages(getattr(p, "ds_tensor", p) for p in module.parameters())
    grads = _storages(p.grad for p in module.parameters())
    grads.update(_storages(_flatten(getattr(opt, "averaged_gradients", {}))))  # ZeRO-1/2 partitions
    grads.update(_storages([getattr(opt, "grad_partitions_flat_buffer", None)]))  # ZeRO-3 partitions
    engine.engine.step()
    base = getattr(opt, "optimizer", opt)
    masters = _storages(p for group in base.param_groups for p in group["params"])
    # fp32 master partitions: ZeRO-3 hands them to the base optimizer only during its step
    masters.update(_storages(_flatten([getattr(opt, "fp32_partitioned_groups_flat", []),
                                       getattr(opt, "single_partition_of_fp32_groups", [])])))
    moments = _storages(_flatten(base.state))
    optimizer = {k: v for k, v in {**masters, **moments}.items() if k not in params}
    result = {"rank": ctx.rank, "world_size": ctx.world_size, "trainable_params": sum(
        int(getattr(p, "ds_numel", p.numel())) for p in module.parameters() if p.requires_grad),
        "parameters": sum(params.values()), "gradients": sum(grads.values()), "optimizer": sum(optimizer.values())}
    results = [None] * ctx.world_size
    torch.distributed.all_gather_object(results, result)
    if ctx.is_main:
        with open(out_path, "w") as fh:
            json.dump(results, fh)
    ctx.barrier()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m specforge_lite.bench memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", default="zero0,zero1,zero2,zero3", help="trainer presets to compare")
    p.add_argument("--model", default="llama3_8b", choices=sorted(KNOWN_TARGETS))
    p.add_argument("--nproc", type=int, default=2, help="ranks (processes) per launch")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--worker", nargs=2, metavar=("TRAINER", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return worker(a.worker[0], a.model, a.seq_len, a.worker[1])

    rows = {}
    for trainer in a.trainer.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(a.nproc),
                   "-m", "specforge_lite.bench", "memory", "--model", a.model, "--seq-len", str(a.seq_len),
                   "--worker", trainer, out]
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if proc.returncode != 0:
                sys.exit(f"{trainer} failed:\n{proc.stderr[-4000:]}")
            rows[trainer] = json.load(open(out))
            r = rows[trainer][0]
            print(f"{trainer}: done ({r['trainable_params'] / 1e6:.1f}M trainable draft parameters)", flush=True)
    gib = 2**30
    print(f"\n{a.model} EAGLE3 draft, {a.nproc} ranks, bf16 weights + fp32 master/Adam; GiB per rank (rank 0; max "
          f"over ranks)")
    print("| trainer | parameters | gradients | optimizer state | total | vs zero0 |")
    print("|---|---|---|---|---|---|")
    base = None
    for trainer, ranks in rows.items():
        r0 = ranks[0]
        total = max(r["parameters"] + r["gradients"] + r["optimizer"] for r in ranks)
        base = base or total
        print(f"| {trainer} | {r0['parameters'] / gib:.2f} | {r0['gradients'] / gib:.2f} | "
              f"{r0['optimizer'] / gib:.2f} | "
              f"{total / gib:.2f} | {total / base:.2f}x |")


if __name__ == "__main__":
    main()
