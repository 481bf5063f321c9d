"""vLLM (``Eagle3LlamaForCausalLM``, architecture name ``LlamaForCausalLMEagle3`` accepted).

vLLM captures "aux id i" as the input of layer i, id == num_layers as the pre-norm last state: our
convention, so ids are written as they are. Its loader is strict (an unknown weight name raises) and,
with a full draft vocabulary, wants no d2t/t2d.
"""

from __future__ import annotations

from .layout import eagle_flag
from .llama import LlamaEagle3Format


class VLLMFormat(LlamaEagle3Format):
    name, server = "vllm", "vLLM"
    writes_mask_slots = True  # served with speculative_config parallel_drafting=true

    def check(self, config: dict, shapes: dict, report) -> None:
        unknown = self.unknown_weights(shapes)
        if unknown:
            report.errors.append(f"unknown weight names {unknown[:5]}: vLLM refuses them")
        vocab, draft = config.get("vocab_size"), config.get("draft_vocab_size")
        if draft is None:
            report.warnings.append("draft_vocab_size is missing: vLLM assumes the full vocabulary")
        if draft == vocab and "d2t" in shapes:
            report.warnings.append("d2t with a full draft vocabulary: vLLM builds that want none may refuse it")
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        if not ids and (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"):
            report.warnings.append("the aux ids are in eagle_config only (SGLang's and SpecForge's place): vLLM reads "
                                   "the top-level eagle_aux_hidden_state_layer_ids and, without them, captures its "
                                   "default ids; for vLLM, python -m specforge_lite.evaluate --export DIR --run-dir "
                                   "OUT model=... writes it as vLLM reads it in OUT/final")
        if not ids:
            report.servers[self.server] = "captures its default ids [2, L//2, L-3] of the target (no top-level ids)"
        else:
            report.servers[self.server] = (
                f"captures the input of layers {list(ids)} (id L = pre-norm final state), "
                f"norm_before_residual={config.get('norm_before_residual', False)}, "
                f"fc_norm={bool(config.get('fc_norm'))}, norm_before_fc={eagle_flag(config, 'norm_before_fc')}, "
                f"norm_output={bool(config.get('norm_output'))}, layers={config.get('num_hidden_layers', 1)}"
                + (f"; parallel drafting (P-EAGLE): serve with method=eagle3, parallel_drafting=true, mask token "
                   f"{config.get('mask_token_id')}" if config.get("parallel_drafting") else ""))
