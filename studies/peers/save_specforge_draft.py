"""Save a tiny SpecForge 0.2.0 EAGLE3 draft the way SpecForge publishes one (run with the peer venv:
``$(bash scripts/setup_peers.sh | tail -1) studies/peers/save_specforge_draft.py``).

Its own classes and save code throughout: the draft config file is read by AutoDraftModelConfig.from_file, the
draft (LlamaForCausalLMEagle3, one layer) built by AutoDraftModel.from_config, its weights put in a training
state as its CheckpointManager writes one (``strategy`` and ``draft_state_dict`` without the embedding), and
exported by specforge.export.export_to_sglang, the exporter behind its ``--to sglang`` (bf16, save_pretrained,
the legacy rope fields mirrored). The aux ids are written in eagle_config in SpecForge's own convention
(0-based layer outputs). The recorded logits are its training forward's first TTT step (project_hidden_states,
embed_input_ids, backbone with the sdpa backend's cache, compute_logits) on the saved (bf16-rounded) weights.
"""

import json
import tempfile
from importlib.metadata import version
from pathlib import Path

from _published import (SEED, DRAFT_VOCAB, describe, draft_vocab, forward_inputs, parse_args, perturb_norms,
                        save_forward, target_shape)

AUX_IDS = [1, 3, 5]  # SpecForge's convention: the outputs of layers 1, 3, 5 (not the servers' default ids)


def draft_config() -> dict:
    """The draft config file a SpecForge user writes (as its configs/*-eagle3.json), for the tiny target."""
    shape = target_shape()
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **shape, "num_hidden_layers": 1,
            "hidden_act": "silu", "draft_vocab_size": DRAFT_VOCAB, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_IDS, "use_aux_hidden_state": True}}


def first_step_logits(model, aux, ids):
    """The logits of the first TTT step, as OnlineEagle3Model.forward computes them (sdpa backend)."""
    import torch

    T = ids.shape[1]
    hidden = model.project_hidden_states(aux)
    mask = model.prepare_decoder_attention_mask(attention_mask=torch.ones(1, T, dtype=torch.bool),
                                                hidden_states=hidden, batch_size=1, seq_length=T,
                                                past_key_values_length=0)
    positions = torch.arange(T)[None]
    embeds = model.embed_input_ids(ids).to(hidden.dtype)
    out = model.backbone(input_embeds=embeds, hidden_states=hidden, cache_hidden=[[], []], attention_mask=mask,
                         position_ids=positions, past_key_values=None, use_cache=True)
    return embeds, positions, model.compute_logits(out)


def main() -> None:
    a = parse_args(__doc__)
    import torch

    from specforge.export import export_to_sglang
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    out = a.out / "specforge"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "draft_config.json"
        config_path.write_text(json.dumps(draft_config(), indent=2))
        torch.manual_seed(SEED)
        model = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(str(config_path)))
        t2d, d2t = draft_vocab(a.out, model.vocab_size)
        with torch.no_grad():
            model.t2d.copy_(t2d)
            model.d2t.copy_(d2t)
        perturb_norms(model)
        state = {"strategy": "eagle3",
                 "draft_state_dict": {k: v for k, v in model.state_dict().items() if "embed" not in k.lower()}}
        torch.save(state, Path(tmp) / "training_state.pt")
        export_to_sglang(str(Path(tmp) / "training_state.pt"), str(config_path), str(out))
    model = model.to(torch.bfloat16).float().eval()  # the weights as saved
    aux, ids = forward_inputs(model.config.hidden_size, model.vocab_size)
    with torch.no_grad():
        embeds, positions, logits = first_step_logits(model, aux, ids)
    save_forward(a.out, "specforge", version("specforge"),
                 "first TTT step of OnlineEagle3Model's calls (sdpa), fp32 on the saved bf16 weights",
                 aux=aux, input_ids=ids, inputs_embeds=embeds, position_ids=positions, logits=logits)
    print(describe(out))


if __name__ == "__main__":
    main()
