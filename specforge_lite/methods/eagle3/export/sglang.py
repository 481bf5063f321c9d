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
"""

from __future__ import annotations

from ....formats import ExportFormat, ExportRefused
from ....formats.layout import eagle_flag
from ..spec import Eagle3Spec
from .published import read_folder


class SGLangFormat(ExportFormat):
    name, server = "sglang", "SGLang"
    # (SpecForge writes for SGLang: a Llama-EAGLE3 folder without our provenance is read as SGLang reads it)
    published_as = "SpecForge's and SGLang's Llama layout (LlamaForCausalLMEagle3)"

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
        """SGLang reads eagle_config's ids (else the top-level ones) as layer outputs: ours are one more."""
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or \
            config.get("eagle_aux_hidden_state_layer_ids")
        return [i + 1 for i in ids] if ids else None

    def check(self, config: dict, shapes: dict, report) -> None:
        unknown = self.unknown_weights(shapes)
        if unknown:
            report.errors.append(f"unknown weight names {unknown[:5]}: SGLang skips them in silence (the weight "
                                 "stays random)")
        top = config.get("eagle_aux_hidden_state_layer_ids")
        nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if top and nested and list(top) != list(nested):
            report.errors.append(f"top-level ids {top} and eagle_config ids {nested} differ: SGLang reads the "
                                 "eagle_config ones, vLLM the top-level ones")
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
        ids = nested or top
        if layers != 1:
            report.servers[self.server] = f"cannot serve it: {layers} layers, SGLang loads one"
        elif residual_normed:
            report.servers[self.server] = "cannot serve it: trained with norm_before_residual, which SGLang ignores"
        elif ids:
            report.servers[self.server] = (
                f"reads ids {list(ids)} as layer outputs, i.e. the inputs of layers {[i + 1 for i in ids]}"
                + (" (newer builds add the 1 only when the first id is 1)" if ids[0] != 1 else ""))

    def read_published(self, folder, config: dict, tensors: dict) -> tuple[Eagle3Spec, dict]:
        return read_folder(self, folder, config, tensors)
