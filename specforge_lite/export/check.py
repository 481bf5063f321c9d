"""``python -m specforge_lite.export --check DIR``: read any EAGLE3 draft folder (ours or anyone's) the
way the servers do, and say what each would do with it.

Findings are errors (a server refuses the folder, or loads it with another meaning than it was
trained with: ids that fall back to defaults, weights skipped in silence) or warnings (servers differ,
or a default is taken). The contract is eagle3-contracts.md as implemented in vllm.py, sglang.py and
speculators.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

LLAMA_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
_LAYER = r"(?:self_attn\.(?:q|k|v|o)_proj|mlp\.(?:gate|up|down)_proj)\.weight|(?:input_layernorm|hidden_norm|post_attention_layernorm)\.weight"


@dataclass
class Report:
    path: Path
    format: str = "unknown"
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    servers: dict[str, str] = field(default_factory=dict)  # server -> what it would do

    @property
    def ok(self) -> bool:
        return not self.errors

    def text(self) -> str:
        lines = [f"{self.path}: {self.format} EAGLE3 draft -> {'OK' if self.ok else 'NOT SERVABLE AS TRAINED'}"]
        lines += [f"  error: {e}" for e in self.errors] + [f"  warning: {w}" for w in self.warnings]
        lines += [f"  {server}: {what}" for server, what in self.servers.items()]
        return "\n".join(lines)


def _shapes(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


def check_export(folder: str | Path) -> Report:
    folder = Path(folder)
    report = Report(folder)
    if not (folder / "config.json").is_file():
        report.errors.append("no config.json")
        return report
    config = json.loads((folder / "config.json").read_text())
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        report.errors.append("no *.safetensors weights (servers read safetensors; a .bin is not checked here)")
        return report
    shapes: dict = {}
    for f in files:
        shapes.update(_shapes(f))
    if config.get("speculators_model_type") is not None:
        report.format = "speculators"
        _check_speculators(config, shapes, report)
    elif any(a in LLAMA_ARCHS for a in config.get("architectures") or []):
        report.format = "llama-eagle3 (vLLM/SGLang)"
        _check_llama(config, shapes, report)
    else:
        report.errors.append(f"architectures {config.get('architectures')} is neither {LLAMA_ARCHS} (vLLM/SGLang) nor "
                             "a speculators config (speculators_model_type)")
    return report


def _common(layer: dict, top: dict, shapes: dict, prefix: str, report: Report) -> None:
    """Shapes and names shared by both layouts; ``prefix`` is the decoder layer's weight prefix."""
    H = layer.get("hidden_size")
    heads, kv = layer.get("num_attention_heads"), layer.get("num_key_value_heads", layer.get("num_attention_heads"))
    head_dim = layer.get("head_dim") or (H // heads if H and heads else None)
    vocab, draft_vocab = layer.get("vocab_size"), top.get("draft_vocab_size")
    target_h = top.get("target_hidden_size") or H
    ids = top.get("eagle_aux_hidden_state_layer_ids") or []
    n_aux = len(ids) or 3
    expected = {"fc.weight": (H, n_aux * target_h), "norm.weight": (H,), "lm_head.weight": (draft_vocab or vocab, H),
                f"{prefix}self_attn.q_proj.weight": (heads * head_dim, 2 * H),
                f"{prefix}self_attn.k_proj.weight": (kv * head_dim, 2 * H),
                f"{prefix}self_attn.v_proj.weight": (kv * head_dim, 2 * H),
                f"{prefix}self_attn.o_proj.weight": (H, heads * head_dim)}
    for name, shape in expected.items():
        if name not in shapes:
            if name != "lm_head.weight" or draft_vocab not in (None, vocab):
                report.errors.append(f"weight {name} is missing")
            continue
        if shapes[name][0] != shape:
            report.errors.append(f"{name} has shape {shapes[name][0]}, the config implies {shape}")
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
    act = layer.get("hidden_act", "silu")
    if act != "silu":
        report.errors.append(f"hidden_act {act!r}: the servers' EAGLE3 draft is a Llama layer whose MLP runs silu only "
                             "(vLLM and SGLang refuse anything else); the draft must be trained with silu")


def _known(name: str, prefix: str) -> bool:
    return bool(re.fullmatch(rf"fc\.weight|norm\.weight|lm_head\.weight|d2t|t2d|embed_tokens\.weight|input_norm\.weight"
                             rf"|fc_norm\.\d+\.weight|{re.escape(prefix)}(?:{_LAYER})", name))


def _check_llama(config: dict, shapes: dict, report: Report) -> None:
    _common(config, config, shapes, "midlayer.", report)
    unknown = [k for k in shapes if not _known(k, "midlayer.")]
    if unknown:
        report.errors.append(f"unknown weight names {unknown[:5]}: vLLM refuses them, SGLang skips them in silence "
                             "(the weight stays random)")
    top = config.get("eagle_aux_hidden_state_layer_ids")
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if top and nested and list(top) != list(nested):
        report.errors.append(f"top-level ids {top} and eagle_config ids {nested} differ: vLLM reads the first, "
                             "SGLang the second")
    if not nested and top:
        report.warnings.append("eagle_config.eagle_aux_hidden_state_layer_ids is missing: SGLang falls back to its "
                               "default ids")
    if config.get("num_hidden_layers", 1) != 1:
        report.warnings.append("num_hidden_layers > 1: older SGLang builds load one layer only")
    vocab, draft = config.get("vocab_size"), config.get("draft_vocab_size")
    if draft is None:
        report.warnings.append("draft_vocab_size is missing: SGLang then takes the target's lm_head, vLLM assumes "
                               "the full vocabulary")
    if draft == vocab and "d2t" in shapes:
        report.warnings.append("d2t with a full draft vocabulary: vLLM builds that want none may refuse it")
    ids = top or nested
    if ids:
        L = "L"
        sg = [i + 1 for i in (nested or ids)]
        report.servers["vLLM"] = (f"captures the input of layers {list(ids)} (id {L} = pre-norm final state), "
                                  f"norm_before_residual={config.get('norm_before_residual', False)}, "
                                  f"fc_norm={bool(config.get('fc_norm'))}")
        report.servers["SGLang"] = (f"reads ids {list(nested or ids)} as layer outputs, i.e. the inputs of layers "
                                    f"{sg}" + (" (newer builds add the 1 only when the first id is 1)"
                                               if (nested or ids)[0] != 1 else ""))


def _check_speculators(config: dict, shapes: dict, report: Report) -> None:
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        report.errors.append("speculators config lacks transformer_layer_config")
        return
    if config.get("speculators_model_type") != "eagle3":
        report.errors.append(f"speculators_model_type {config.get('speculators_model_type')!r}, expected 'eagle3'")
    _common(layer, config, shapes, "layers.0.", report)
    unknown = [k for k in shapes if not _known(k, "layers.0.")]
    if unknown:
        report.errors.append(f"unknown weight names {unknown[:5]} (speculators names the decoder layer layers.0.*)")
    if config.get("fc_norm") and config.get("norm_before_fc"):
        report.errors.append("fc_norm and norm_before_fc are mutually exclusive")
    sc = config.get("speculators_config") or {}
    if not (sc.get("verifier") or {}).get("architectures"):
        report.warnings.append("speculators_config.verifier names no architectures: the verifier cannot be checked")
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        report.servers["speculators / vLLM"] = (
            f"captures the input of layers {list(ids)}, norm_before_residual="
            f"{config.get('norm_before_residual', True)} (true when absent), fc_norm={bool(config.get('fc_norm'))}")
