"""SGLang (``LlamaForCausalLMEagle3``, python/sglang/srt/models/llama_eagle3.py).

SGLang adds 1 to explicit ids ("id = output of layer i"), so a draft trained on the input of layer i
is written as i - 1. Newer builds add the 1 only when the first id is 1, which the default ids
[2, L//2, L-3] satisfy after translation; other choices are read differently across SGLang versions.
SGLang reads the ids from ``eagle_config``, keeps d2t even for a full draft vocabulary and skips
unknown weight names silently.

EAGLE 3.1: SGLang's Llama EAGLE3 draft is one layer. Builds of 2026 read ``norm_before_fc``
(``input_norm``), ``fc_norm`` and ``norm_output`` and refuse ``num_hidden_layers != 1``; older builds read
none of the three and name extra layers otherwise (``midlayers.{i}``, normed by ``hidden_norm``), so a
multi-layer draft is refused here and the flags are a warning in ``--check``. No build reads
``norm_before_residual``: a draft trained with it is refused.

A Llama-EAGLE3 folder another trainer wrote is read as the server it was written for serves it: eagle_config's
ids are SGLang's (SpecForge's) place, the top-level ones vLLM's (its layer inputs, and SGLang then captures its
default ids); one whose two places name different layers is refused, since which server it was trained for is
unknown. An absent ``norm_before_residual`` is false, as vLLM's Llama-EAGLE3 model takes it (SGLang never reads it).
"""

from __future__ import annotations

from ....formats import PROVENANCE_KEY, ExportRefused
from ..spec import Eagle3Spec
from .layout import eagle_flag
from .llama import LlamaEagle3Format
from .published import read_folder


class SGLangFormat(LlamaEagle3Format):
    name, server = "sglang", "SGLang"
    # (SpecForge writes for SGLang: a Llama-EAGLE3 folder without our provenance is read as SGLang reads it)
    published_as = "SpecForge's and SGLang's Llama layout (LlamaForCausalLMEagle3)"
    norm_before_residual_default = False  # (a published folder without the field: vLLM's model default)

    def refusals(self, draft) -> list[str]:
        problems = super().refusals(draft)  # (the shared ones first)
        if not problems and draft.num_layers != 1:
            problems.append(f"draft.num_layers={draft.num_layers}: SGLang's EAGLE3 draft is one layer (its builds "
                            "refuse more, or load them under other names); export this draft for vLLM "
                            "(export.format=vllm or speculators)")
        if not problems and draft.norm_before_residual:
            problems.append("draft.norm_before_residual=true: SGLang's EAGLE3 draft always takes the residual before "
                            "hidden_norm and does not read the flag, so it would serve another model than the one "
                            "trained; export this draft for vLLM (export.format=vllm or speculators), or train with "
                            "draft.norm_before_residual=false to serve on SGLang")
        return problems

    def write_config(self, spec: Eagle3Spec, dtype, verifier: dict, num_speculative_tokens: int, warn) -> dict:
        config = super().write_config(spec, dtype, verifier, num_speculative_tokens, warn)
        if spec.norm_before_fc or spec.norm_output:
            warn("norm_before_fc/norm_output (EAGLE 3.1): SGLang builds before 2026 ignore them and would serve the "
                 "draft without what it was trained with")
        return config

    def server_aux_ids(self, spec: Eagle3Spec, warn) -> list[int]:
        ids = list(spec.aux_layer_ids)
        if 0 in ids:
            raise ExportRefused("aux id 0 (the embedding output) cannot be expressed in SGLang's output-of-layer ids; "
                                "train with ids >= 1 to serve on SGLang")
        translated = [i - 1 for i in ids]
        if translated[0] != 1:
            warn(f"SGLang ids {translated}: builds before mid-2026 add 1 to every id (correct), newer builds only when "
                 "the first id is 1 (they would read these ids one layer early). Prefer aux ids starting at 2 for "
                 "SGLang.")
        if spec.target_num_layers in ids:
            warn("aux id == num_layers (pre-norm final state) is not a layer input SGLang captures in every build")
        return translated

    def with_vocab_maps(self, spec: Eagle3Spec) -> bool:
        return True

    def read_aux_ids(self, config: dict) -> list[int] | None:
        """SGLang reads eagle_config's ids as layer outputs (ours are one more), and nothing else: None without
        them, for it then captures its default ids (model_runner reads ``hf_config.eagle_config`` only)."""
        ids = _nested_ids(config)
        return [i + 1 for i in ids] if ids else None

    def published_aux_ids(self, config: dict) -> list[int] | None:
        """A Llama-EAGLE3 folder another trainer wrote was trained on what the server it was written for feeds:
        SGLang's reading of eagle_config's ids, else vLLM's of the top-level ones (layer inputs, ours as they are);
        both must name the same layers (top-level = eagle_config's + 1), or which server it was meant for is
        unknown and the folder is refused."""
        top, sglang = config.get("eagle_aux_hidden_state_layer_ids"), self.read_aux_ids(config)
        if top and sglang and list(top) != sglang:
            raise ValueError(
                f"its top-level eagle_aux_hidden_state_layer_ids {list(top)} (vLLM feeds the draft the inputs of "
                f"layers {list(top)}) and eagle_config's {_nested_ids(config)} (SGLang: layer outputs, the inputs of "
                f"layers {sglang}) name different layers, so one server feeds the draft states it was not trained on "
                "and the folder does not say which; delete the ids of the server it was not trained for (or write "
                "the top-level ones as eagle_config's + 1) and read it again")
        return sglang or (list(top) if top else None)

    def check(self, config: dict, shapes: dict, report) -> None:
        unknown = self.unknown_weights(shapes)
        if unknown:
            report.errors.append(f"unknown weight names {unknown[:5]}: SGLang skips them in silence (the weight "
                                 "stays random)")
        top, nested = config.get("eagle_aux_hidden_state_layer_ids"), _nested_ids(config)
        read = self.read_aux_ids(config)
        if top and nested and PROVENANCE_KEY in config and list(top) != nested:  # (ours writes one list twice)
            report.errors.append(f"top-level ids {top} and eagle_config ids {nested} differ: SGLang reads the "
                                 "eagle_config ones, vLLM the top-level ones")
        elif top and nested and PROVENANCE_KEY not in config and list(top) != read:  # (another trainer's)
            report.errors.append(f"top-level ids {top} and eagle_config ids {nested} name different layers: vLLM "
                                 f"captures the inputs of layers {list(top)}, SGLang those of {read} (its ids are "
                                 "layer outputs), so one of them feeds the draft states it was not trained on; keep "
                                 "the ids of the server it was trained for (or write the top-level ones as "
                                 "eagle_config's + 1)")
        if not nested and top:
            report.warnings.append("eagle_config.eagle_aux_hidden_state_layer_ids is missing: SGLang falls back to "
                                   "its default ids")
        layers = config.get("num_hidden_layers", 1)
        if layers != 1:  # a warning: the folder still serves on vLLM, which reads the same layout
            report.warnings.append(f"num_hidden_layers={layers}: SGLang cannot serve this draft (its EAGLE3 draft is "
                                   "one layer: 2026 builds refuse more, older ones look for midlayers.N and skip "
                                   "layers.N in silence); vLLM and speculators serve it")
        if any(eagle_flag(config, f) for f in ("norm_before_fc", "norm_output")):
            report.warnings.append("norm_before_fc/norm_output (EAGLE 3.1) are read by SGLang builds of 2026 only; "
                                   "older builds serve the draft without them")
        residual_normed = bool(config.get("norm_before_residual"))
        if residual_normed:  # a warning: vLLM and speculators read the flag
            report.warnings.append("norm_before_residual=true: SGLang cannot serve this draft (it always takes the "
                                   "first layer's residual before hidden_norm and does not read the flag); vLLM and "
                                   "speculators serve it")
        if config.get("draft_vocab_size") is None:
            report.warnings.append("draft_vocab_size is missing: SGLang then takes the target's lm_head")
        if layers != 1:
            report.servers[self.server] = f"cannot serve it: {layers} layers, SGLang loads one"
        elif residual_normed:
            report.servers[self.server] = "cannot serve it: trained with norm_before_residual, which SGLang ignores"
        elif nested:
            report.servers[self.server] = (
                f"reads ids {list(nested)} as layer outputs, i.e. the inputs of layers {read}"
                + (" (newer builds add the 1 only when the first id is 1)" if nested[0] != 1 else ""))
        else:
            report.servers[self.server] = ("captures its default ids [2, L//2, L-3] of the target (no eagle_config "
                                           "ids; it never reads the top-level ones)")

    def read_published(self, folder, config: dict, tensors: dict) -> tuple[Eagle3Spec, dict]:
        return read_folder(self, folder, config, tensors)


def _nested_ids(config: dict) -> list[int] | None:
    """eagle_config's aux ids (SGLang's place), as written."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids else None
