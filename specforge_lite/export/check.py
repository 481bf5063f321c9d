"""``python -m specforge_lite.export --check DIR``: read any EAGLE3 draft folder (ours or anyone's) the
way the servers do, and say what each would do with it.

Findings are errors (a server refuses the folder, or loads it with another meaning than it was
trained with: ids that fall back to defaults, weights skipped in silence) or warnings (servers differ,
or a default is taken). The rules every Llama-draft layout shares are here; each server's own rules
are in its format class (vllm.py, sglang.py, speculators.py), the one that also writes the format.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..files import safetensors_problem
from .layout import PROVENANCE_KEY, PUBLISHED_READERS, eagle_flag
from .report import Report

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
    return report


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
    provenance = config.get(PROVENANCE_KEY) or {}
    trained, intended = provenance.get("aux_layer_ids"), server or provenance.get("format")
    if not provenance:  # a folder written elsewhere: trained on the ids its own layout's convention names
        own = next((fmt for name in PUBLISHED_READERS for fmt in readers if fmt.name == name), None)
        if own is None:
            return
        trained, intended = own.read_aux_ids(config), server or own.name
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


def check_layout(layer: dict, top: dict, shapes: dict, prefix: str, report: Report) -> None:
    """Shapes and names every Llama-draft layout shares; ``prefix`` is the decoder layer's weight prefix."""
    H = layer.get("hidden_size")
    heads, kv = layer.get("num_attention_heads"), layer.get("num_key_value_heads", layer.get("num_attention_heads"))
    head_dim = layer.get("head_dim") or (H // heads if H and heads else None)
    vocab, draft_vocab = layer.get("vocab_size"), top.get("draft_vocab_size")
    target_h = top.get("target_hidden_size") or H
    # (SGLang reads eagle_config's ids, vLLM the top-level ones: each server's check says what it makes of them)
    ids = top.get("eagle_aux_hidden_state_layer_ids") or (top.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids") or []
    n_aux = len(ids) or 3
    expected = {"fc.weight": (H, n_aux * target_h), "norm.weight": (H,), "lm_head.weight": (draft_vocab or vocab, H),
                f"{prefix}self_attn.q_proj.weight": (heads * head_dim, 2 * H),
                f"{prefix}self_attn.k_proj.weight": (kv * head_dim, 2 * H),
                f"{prefix}self_attn.v_proj.weight": (kv * head_dim, 2 * H),
                f"{prefix}self_attn.o_proj.weight": (H, heads * head_dim)}
    for i in range(1, layer.get("num_hidden_layers") or 1):  # layers 1..: H wide, named layers.{i}.*
        expected.update({f"layers.{i}.self_attn.q_proj.weight": (heads * head_dim, H),
                         f"layers.{i}.self_attn.o_proj.weight": (H, heads * head_dim),
                         f"layers.{i}.input_layernorm.weight": (H,)})
    if eagle_flag(top, "norm_before_fc"):
        expected["input_norm.weight"] = (n_aux * target_h,)
    elif "input_norm.weight" in shapes:
        report.errors.append("weight input_norm exists but norm_before_fc is not set: vLLM drops it in silence and "
                             "the draft runs without the norm it was trained with")
    if eagle_flag(top, "norm_before_fc") and (top.get("fc_norm") or top.get("use_aux_norm")):
        report.errors.append("norm_before_fc and fc_norm are both set: speculators refuses the pair and vLLM applies "
                             "both norms, one of which the draft was not trained with")
    extra_layers = sorted({int(m.group(1)) for k in shapes if (m := re.match(r"layers\.([1-9]\d*)\.", k))})
    if extra_layers and extra_layers[-1] >= (layer.get("num_hidden_layers") or 1):
        report.errors.append(f"weights of layer {extra_layers[-1]} exist but num_hidden_layers is "
                             f"{layer.get('num_hidden_layers') or 1}: servers would never run that layer")
    for name, shape in expected.items():
        if name not in shapes:
            if name != "lm_head.weight" or draft_vocab not in (None, vocab):
                report.errors.append(f"weight {name} is missing")
            continue
        if shapes[name][0] != shape:
            report.errors.append(f"{name} has shape {shapes[name][0]}, the config implies {shape}")
    if "t2d" in shapes and vocab is not None and shapes["t2d"][0] != (vocab,):
        report.errors.append(f"t2d has shape {shapes['t2d'][0]}, vocab_size {vocab} implies ({vocab},): the config "
                             "and the weights describe different target vocabularies")
    if draft_vocab is not None and vocab is not None and draft_vocab < vocab:
        if "d2t" not in shapes:
            report.errors.append(f"draft_vocab_size {draft_vocab} < vocab_size {vocab} but no d2t: servers would map "
                                 "draft ids to the first target ids")
        elif shapes["d2t"] != ((draft_vocab,), "I64"):
            report.errors.append(f"d2t is {shapes['d2t']}, expected int64 [{draft_vocab}] (target = draft + d2t)")
    n = top.get("norm_before_residual")
    if n is None:
        report.warnings.append("norm_before_residual is not written: vLLM's own loader takes false, its speculators "
                               "adapter true; write the value the draft was trained with")
    fc_norms = sorted(k for k in shapes if re.fullmatch(r"fc_norm\.\d+\.weight", k))
    flag = bool(top.get("fc_norm") or top.get("use_aux_norm"))
    if fc_norms and not flag:
        report.errors.append(f"weights {fc_norms} exist but fc_norm is not set: the per-aux norms would be skipped "
                             "(SGLang) or refused (vLLM)")
    if flag and len(fc_norms) != n_aux:
        report.errors.append(f"fc_norm is set but {len(fc_norms)} fc_norm.k weights exist for {n_aux} aux states")
    if not ids:
        report.errors.append("no eagle_aux_hidden_state_layer_ids: servers fall back to their default ids in silence "
                             "(the 1.2%-acceptance failure); write the ids the draft was trained on")
    elif list(ids) != sorted(ids):
        report.errors.append(f"eagle_aux_hidden_state_layer_ids {list(ids)} are not ascending: servers capture and "
                             "concatenate the aux states in layer order, so fc's input columns would be permuted")
    _check_parallel(top, shapes, n_aux * target_h, report)
    act = layer.get("hidden_act", "silu")
    if act != "silu":
        report.errors.append(f"hidden_act {act!r}: the servers' EAGLE3 draft is a Llama layer whose MLP runs silu only "
                             "(vLLM and SGLang refuse anything else); the draft must be trained with silu")


def _check_parallel(top: dict, shapes: dict, fc_input: int, report: Report) -> None:
    """P-EAGLE (parallel drafting): vLLM needs both the mask slots' token id and their state, mask_hidden."""
    parallel, has_mask = bool(top.get("parallel_drafting")), "mask_hidden" in shapes
    if parallel and not has_mask:
        report.errors.append("parallel_drafting is set but there is no mask_hidden weight: vLLM refuses the draft "
                             "('mask_hidden not found in weights')")
    if has_mask:
        if top.get("mask_token_id") is None and top.get("pard_token") is None:
            report.errors.append("mask_hidden exists but no mask_token_id: vLLM cannot run the mask slots")
        if shapes["mask_hidden"][0] not in ((1, fc_input), (fc_input,)):
            report.errors.append(f"mask_hidden has shape {shapes['mask_hidden'][0]}, fc's input is {fc_input} wide")
        if not parallel:
            report.warnings.append("mask_hidden exists but parallel_drafting is not written: serve it with "
                                   "speculative_config parallel_drafting=true, or vLLM skips mask_hidden and drafts "
                                   "step by step, which the draft was not trained for")
