"""``python -m specforge_lite.export --check DIR``: read any draft folder of a registered method (ours or anyone's)
the way the servers do, and say what each would do with it.

Findings are errors (a server refuses the folder, or loads it with another meaning than it was
trained with: ids that fall back to defaults, weights skipped in silence) or warnings (servers differ,
or a default is taken). Every registered format that reads the folder checks it: the rules its layout
shares (``check_shared``: the Llama-EAGLE3 one's are methods/eagle3/export/check.py), then its own (its class, in
its method's folder: methods/<name>/export), the class that also writes the format.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..files import safetensors_problem
from ..formats import PROVENANCE_KEY, Report

# the decoder sizes every layout's weights are checked against
SIZES = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
# how a damaged draft folder is written again
AGAIN = ("export it again (python -m specforge_lite.export --run-dir RUN --out DIR), or fetch or copy the folder "
         "again")


def _shapes(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


def check_export(folder: str | Path, server: str | None = None) -> Report:
    """``server``: the export format (FORMATS) the folder is meant for; None: the one its provenance names."""
    from . import FORMATS

    if server is not None and server not in FORMATS:
        raise ValueError(f"--server {server!r}: choose one of {sorted(FORMATS)}")
    folder = Path(folder)
    report = Report(folder)
    if not (folder / "config.json").is_file():
        report.errors.append("no config.json")
        return report
    config = _read_config(folder / "config.json", report)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        report.errors.append("no *.safetensors weights (servers read safetensors; a .bin is not checked here)")
    damaged = [problem for f in files if (problem := safetensors_problem(f))]
    report.errors += [f"{problem}: {AGAIN}" for problem in damaged]
    if config is None or not files or damaged:
        return report
    shapes: dict = {}
    for f in files:
        shapes.update(_shapes(f))
    readers = [fmt for fmt in FORMATS.values() if fmt.reads(config)]
    if not readers:
        report.errors.append(f"architectures {config.get('architectures')} is read by none of the formats "
                             f"{sorted(FORMATS)} (nor is it a speculators config: speculators_model_type)")
        return report
    report.format = f"{readers[0].layout} ({', '.join(fmt.server for fmt in readers)})"
    layer = readers[0].layer_config(config, report)
    if layer is None or not _sizes_read(layer, report):
        return report
    readers[0].check_shared(layer, config, shapes, report)
    for fmt in readers:
        fmt.check(config, shapes, report)
    _check_trained_ids(config, readers, server, report)
    _check_vocab_maps(files, shapes, int(layer["vocab_size"]), report)
    return report


def _check_vocab_maps(files: list[Path], shapes: dict, vocab: int, report: Report) -> None:
    """d2t's and t2d's values, once their shapes pass: each draft id sent to a token of its own inside the target's
    vocabulary, and t2d marking those (a server indexes the vocabulary with them)."""
    from safetensors import safe_open

    from .published import vocab_map_problem

    if "d2t" not in shapes or any(("d2t" in e or "t2d" in e) for e in report.errors):
        return
    maps = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            maps.update({k: handle.get_tensor(k) for k in ("d2t", "t2d") if k in handle.keys()})
    problem = vocab_map_problem(maps, int(maps["d2t"].numel()), vocab)
    if problem:
        report.errors.append(f"{problem}: servers would index the target's vocabulary with it; {AGAIN}")


def _read_config(path: Path, report: Report) -> dict | None:
    """config.json as a JSON object; None after reporting why it is not one."""
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        report.errors.append(f"{path} is not a JSON object (it does not parse: {e}): {AGAIN}")
        return None
    if not isinstance(config, dict):
        report.errors.append(f"{path} is not a JSON object (it holds a {type(config).__name__}): {AGAIN}")
        return None
    return config


def _sizes_read(layer: dict, report: Report) -> bool:
    """The decoder's sizes as the servers read them: one the config leaves out is transformers' default for its
    model type (servers read the file through that class: warned, and the weights are checked against it); one
    that is not a whole number is an error (False: nothing else can be checked)."""
    from transformers import AutoConfig

    for key in SIZES:
        if key not in layer:
            try:
                layer[key] = AutoConfig.for_model(layer.get("model_type") or "llama").to_dict()[key]
            except (ValueError, KeyError):
                report.errors.append(f"config.json lacks {key}, and its model_type {layer.get('model_type')!r} has "
                                     "no default a server could take; write the draft's own (export the run again)")
                return False
            report.warnings.append(f"config.json lacks {key}: servers take transformers' default {key}={layer[key]}; "
                                   f"write the draft's own (export the run again)")
        elif not isinstance(layer[key], int) or isinstance(layer[key], bool) or layer[key] < 1:
            report.errors.append(f"config.json: {key}={layer[key]!r} is not a size (a whole number); write the "
                                 "draft's own (export the run again)")
            return False
    return True


def _check_trained_ids(config: dict, readers: list, server: str | None, report: Report) -> None:
    """The aux ids each server will capture against the ids the draft was trained on (our provenance block,
    in our convention): a shift means the server feeds the draft other layers than it learned from. An
    error for the server the folder is meant for (``server``, else the format the provenance names), a
    warning for the others (another server may read the folder, but not as trained)."""
    from . import published_formats

    provenance = config.get(PROVENANCE_KEY) or {}
    trained, intended = provenance.get("aux_layer_ids"), server or provenance.get("format")
    if not provenance:  # a folder written elsewhere: trained on the ids its own layout's convention names
        own = next((fmt for fmt in published_formats() if fmt in readers), None)
        if own is None:
            return
        try:
            trained, intended = own.published_aux_ids(config), server or own.name
        except ValueError:  # (its id places name different layers: which it was trained on is unknown, and the
            return  # format's own check says so)
    if not trained:
        return
    if server is not None and server not in {fmt.name for fmt in readers}:
        report.errors.append(f"--server {server}: no {server} loader reads this folder (it is a {report.format} "
                             f"draft); export the run with export.format={server}")
    for fmt in readers:
        read = fmt.read_aux_ids(config)
        if read is None or list(read) == list(trained):
            continue
        shifts = sorted({r - t for r, t in zip(read, trained)})
        shift = (f"shifted by {shifts[0]:+d} layer{'s' if abs(shifts[0]) != 1 else ''}" if len(shifts) == 1
                 and len(read) == len(trained) else "a different set")
        message = (f"{fmt.server} would capture aux ids {list(read)} (the inputs of those layers), the draft was "
                   f"trained on {list(trained)} ({shift}): it would be fed other layers than it learned from. "
                   f"Export the run with export.format={fmt.name} for {fmt.server}")
        (report.errors if fmt.name == intended else report.warnings).append(message)
