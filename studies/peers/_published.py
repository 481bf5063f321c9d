"""What the published-draft fixture scripts share: the tiny target's shape, the draft vocabulary, the recorded
forward inputs and where the fixture goes.

Each script builds a tiny EAGLE3 draft with a peer's own classes for the shape of
``specforge_lite/conf/model/llama3_tiny.yaml`` (the tiny target the tests train against), gives it weights that a
wrong mapping cannot hide (every norm perturbed, not left at ones), saves it with the peer's own save code into
``OUT/<peer>/`` and records, in ``OUT/<peer>.forward.safetensors``, the inputs of one draft step and the logits the
peer's own forward gives for them. The tests (tests/test_published_drafts.py) load the folder with specforge_lite
and compare.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRESET = ROOT / "specforge_lite" / "conf" / "model" / "llama3_tiny.yaml"
DRAFT_VOCAB = 256
SEQ_LEN = 8
SEED = 0


def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "published",
                   help="the fixture folder: the draft goes to OUT/<peer>/, its forward to "
                   "OUT/<peer>.forward.safetensors")
    return p.parse_args()


def target_shape() -> dict:
    """The tiny target's Llama config fields, read from its preset (the one source of the numbers)."""
    import yaml

    return dict(yaml.safe_load(PRESET.read_text())["tiny"]["config"])


def draft_vocab(out: Path, vocab_size: int):
    """(t2d [V] bool, d2t [Vd]): the tokens of OUT/draft_vocab.json (published_vocab.py), in the peers' own maps."""
    import torch

    path = out / "draft_vocab.json"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run .venv/bin/python studies/peers/published_vocab.py --out {out} first")
    ids = torch.tensor(json.loads(path.read_text())["ids"])
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return t2d, ids - torch.arange(len(ids))


def perturb_norms(model) -> None:
    """Every RMSNorm weight drawn from [0.5, 1.5] instead of ones, so that swapped or skipped norms change the
    logits (a draft fresh from its init would hide them)."""
    import torch

    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))


def forward_inputs(hidden_size: int, vocab_size: int, num_aux: int = 3):
    """One step's inputs: the fused aux states [1, T, n*H] and T distinct token ids [1, T]."""
    import torch

    g = torch.Generator().manual_seed(SEED + 2)
    aux = torch.randn(1, SEQ_LEN, num_aux * hidden_size, generator=g)
    ids = torch.randperm(vocab_size, generator=g)[:SEQ_LEN][None]
    return aux, ids


def save_forward(out: Path, peer: str, version: str, note: str, **tensors) -> Path:
    """The recorded step: ``tensors`` (aux, input_ids, inputs_embeds, position_ids, logits) and who made them."""
    from safetensors.torch import save_file

    path = out / f"{peer}.forward.safetensors"
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(path),
              metadata={"peer": peer, "version": version, "note": note})
    return path


def describe(folder: Path) -> str:
    sizes = {f.name: f.stat().st_size for f in sorted(folder.iterdir())}
    return f"{folder}: " + ", ".join(f"{name} {size / 1024:.0f} KiB" for name, size in sizes.items()) + \
        f"; config {json.loads((folder / 'config.json').read_text()).get('architectures')}"
