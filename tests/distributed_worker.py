"""Run by tests/test_distributed.py under ``torchrun --nproc_per_node 2``: a ZeRO-3 sharded target
against a whole copy of the same target in the same process, on each rank's own batch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specforge_lite.config import load_config  # noqa: E402
from specforge_lite.data.vocab import DraftVocab  # noqa: E402
from specforge_lite.pipeline import build_target  # noqa: E402
from specforge_lite.targets import Teacher  # noqa: E402
from specforge_lite.training.distributed import init_distributed  # noqa: E402


def sharded_target(preset: str, out: Path) -> None:
    config = load_config([f"model={preset}", "tracker=none", "trainer=zero2", "target.shard=zero3"])
    ctx = init_distributed(config.trainer)
    whole = build_target(load_config([f"model={preset}", "tracker=none"]))
    sharded = build_target(config, ctx=ctx)
    g = torch.Generator().manual_seed(100 + ctx.rank)  # every rank captures its own rows, as in training
    ids = torch.randint(0, whole.vocab_size, (2, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 25:] = 0
    vocab = DraftVocab(torch.linspace(0, whole.vocab_size - 1, 512).long().unique(), whole.vocab_size, float("nan"))
    a, b = whole.capture(ids, mask), sharded.capture(ids, mask)
    (ta, va), (tb, vb) = [Teacher(t, vocab.draft_to_target, vocab.t2d)(c) for t, c in ((whole, a), (sharded, b))]
    emb_param = sharded.family.embedding(sharded.model).weight
    emb = sharded.embedding_weight()
    result = {
        "rank": ctx.rank,
        "aux_max_diff": max(float((x - y).abs().max()) for x, y in zip(a.aux, b.aux)),
        "final_max_diff": float((a.final_hidden - b.final_hidden).abs().max()),
        "teacher_max_diff": float((ta - tb).abs().max()),
        "in_vocab_equal": bool(torch.equal(va, vb)),
        "embedding_equal": bool(torch.equal(emb, whole.embedding_weight())),
        "embedding_checksum": float(emb.double().sum()),
        "embedding_local_numel": emb_param.ds_tensor.numel(),  # this rank's partition
        "embedding_full_numel": emb.numel(),
        "sizes": [sharded.hidden_size, sharded.vocab_size, whole.hidden_size, whole.vocab_size],
    }
    gathered = [None] * ctx.world_size
    torch.distributed.all_gather_object(gathered, result)
    if ctx.is_main:
        out.write_text(json.dumps(gathered))
    ctx.barrier()


if __name__ == "__main__":
    sharded_target(sys.argv[1], Path(sys.argv[2]))
