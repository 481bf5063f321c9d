"""The rules every Llama-EAGLE3 layout shares, as ``python -m specforge_lite.export --check`` reads a folder
(export/check.py, through llama.py's ``check_shared``): the weights' names and shapes the config implies, the norms'
flags against the norms' weights, the aux ids, P-EAGLE's mask slots, the activation. Each server's own rules are in
its format class (vllm.py, sglang.py, speculators.py), the one that also writes the format.
"""

from __future__ import annotations

import re

from ....formats import Report
from .layout import eagle_flag


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
