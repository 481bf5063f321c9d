"""Save a tiny speculators 0.9.0 EAGLE3 draft the way speculators' trainer saves one (run with the peer venv:
``$(bash scripts/setup_peers.sh | tail -1) studies/peers/save_speculators_draft.py``).

Its own classes and save code throughout: Eagle3SpeculatorConfig (a Llama transformer_layer_config of two
layers, EAGLE 3.1 as its trainer defaults to for Llama drafts: norm_before_residual, norm_before_fc,
norm_output; explicit aux ids in its convention, the input of layer i; a speculators_config naming the
verifier), Eagle3DraftModel, load_vocab_mappings, and the save its SingleGPUCheckpointer.save_checkpoint makes
(save_pretrained of the state dict in bf16, then patch_config_dtype). Two departures, said here: the state dict
leaves out ``embed_tokens.weight``, the target's own table (vLLM takes the target's, and speculators lists it in
_keys_to_ignore_on_load_missing), which at this vocabulary would be 6 MiB of a 300 KiB fixture; and the copy of
speculators' config source that save_pretrained puts beside config.json is removed. The recorded
logits are its own forward's first TTT step (Eagle3DraftModel.forward, ttt_steps=1, sdpa, its default
position ids 1..T) read from its lm_head, on the saved (bf16-rounded) weights.
"""

from importlib.metadata import version

from _published import (DRAFT_VOCAB, SEED, describe, draft_vocab, forward_inputs, parse_args, perturb_norms,
                        save_forward, target_shape)

AUX_IDS = [1, 4, 7]  # inputs of layers 1, 4, 7 (not the servers' default ids)
VERIFIER = {"name_or_path": None, "architectures": ["LlamaForCausalLM"]}  # the tiny target has no hub id


def build(out, torch):
    from transformers import LlamaConfig

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    layer = LlamaConfig(**{**target_shape(), "num_hidden_layers": 2, "hidden_act": "silu"})
    layer._attn_implementation = "sdpa"  # its non-flex option (flex attention's block masks want a GPU)
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=DRAFT_VOCAB, norm_before_residual=True,
        norm_before_fc=True, fc_norm=False, norm_output=True, eagle_aux_hidden_state_layer_ids=AUX_IDS,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy", verifier=VerifierConfig(**VERIFIER)))
    torch.manual_seed(SEED)
    model = Eagle3DraftModel(config=config).float()
    model.load_vocab_mappings(*draft_vocab(out, layer.vocab_size))
    with torch.no_grad():  # its lm_head and embedding start as NaN until load_verifier_weights reads a target
        model.lm_head.weight.normal_(0.0, 0.02)
        model.embed_tokens.weight.normal_(0.0, 0.02)
    perturb_norms(model)
    return model


def save(model, out, torch) -> None:
    from speculators.train.checkpointer import convert_float_dtype, patch_config_dtype

    state = {k: v for k, v in model.state_dict().items() if k != "embed_tokens.weight"}
    model.save_pretrained(out, state_dict=convert_float_dtype(state, torch.bfloat16))
    patch_config_dtype(out / "config.json", torch.bfloat16)
    # save_pretrained also copies speculators' own config class source (config.py, for trust_remote_code loading):
    # the peer's code, read by no one here (vLLM and this project read config.json), so not kept in the fixture
    (out / "config.py").unlink(missing_ok=True)


def first_step_logits(model, aux, ids, torch):
    """Its forward at ttt_steps=1 returns draft tokens only: the logits are read from its lm_head."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda module, args, output: seen.append(output))
    T = ids.shape[1]
    model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros(1, T, dtype=torch.long), ttt_steps=1)
    hook.remove()
    return seen[0]


def main() -> None:
    a = parse_args(__doc__)
    import torch

    out = a.out / "speculators"
    out.mkdir(parents=True, exist_ok=True)
    model = build(a.out, torch)
    save(model, out, torch)
    model = model.to(torch.bfloat16).float().eval()  # the weights as saved
    H, V = model.hidden_size, model.verifier_vocab_size
    aux, ids = forward_inputs(H, V, len(AUX_IDS))
    with torch.no_grad():
        logits = first_step_logits(model, aux, ids, torch)
        embeds = model.embed_tokens(ids)
    save_forward(a.out, "speculators", version("speculators"),
                 "first TTT step of Eagle3DraftModel.forward (sdpa), fp32 on the saved bf16 weights",
                 aux=aux, input_ids=ids, inputs_embeds=embeds, position_ids=1 + torch.arange(ids.shape[1])[None],
                 logits=logits)
    print(describe(out))


if __name__ == "__main__":
    main()
