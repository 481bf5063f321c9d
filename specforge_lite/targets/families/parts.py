"""Single tensors read from a checkpoint's safetensors by name, without loading the rest."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


def _weight_map(folder: Path) -> dict[str, Path]:
    """Tensor name -> the file that holds it (sharded checkpoints: their index; else every file's keys)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no safetensors files: reading only the target's parts needs them "
                                "(save the checkpoint with save_pretrained(..., safe_serialization=True))")
    found = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            found.update({k: path for k in f.keys()})
    return found


def _checkpoint_key(name: str, keys: dict[str, Path]) -> str:
    """The checkpoint's name for the model parameter ``name``: the same, or the one key that ends with its
    longest tail (checkpoints of multimodal wrappers and converted models prefix names differently)."""
    if name in keys:
        return name
    parts = name.split(".")
    for start in range(1, len(parts) - 1):
        tail = "." + ".".join(parts[start:])
        hits = [k for k in keys if k.endswith(tail) or k == tail[1:]]
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            raise KeyError(f"the checkpoint has several tensors for {name}: {hits[:4]}")
    raise KeyError(f"the checkpoint has no tensor for {name}")


def load_named_tensors(location: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors of the model parameters ``names`` from the checkpoint folder ``location``."""
    keys = _weight_map(Path(location))
    out = {}
    for name in names:
        key = _checkpoint_key(name, keys)
        with safe_open(str(keys[key]), framework="pt") as f:
            out[name] = f.get_tensor(key)
    return out
