"""The shapes of the hub presets' models, for sizing a run (and the GPU benchmark's random targets) with nothing
downloaded.

``hub_shapes/<org>--<name>.json`` holds the architecture fields of that model's public config.json: enough to
build the model with fake weights and count its bytes (hub_shapes/README.md says where each comes from). A model
not listed is sized from its config.json (a local folder, the hub cache, or a download of that one file)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SHAPES_DIR = Path(__file__).resolve().parent / "hub_shapes"


def shape_fields(path: str) -> tuple[str, dict[str, Any]] | None:
    """(transformers model type, config fields) of the model at hub id ``path``, when its shape ships here."""
    file = SHAPES_DIR / f"{path.replace('/', '--')}.json" if path else None
    if file is None or not file.is_file():
        return None
    fields = {k: v for k, v in json.loads(file.read_text()).items() if not k.startswith("_")}
    return fields.pop("model_type"), fields


def known_config(path: str):
    """The transformers config of the model at hub id ``path`` from its shipped shape, or None."""
    shape = shape_fields(path)
    if shape is None:
        return None
    from transformers import AutoConfig

    return AutoConfig.for_model(shape[0], **shape[1])
