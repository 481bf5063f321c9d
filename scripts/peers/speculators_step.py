"""One speculators 0.9.0 EAGLE3 draft training step on CPU, fp32 (run in the peer venv: setup_peers.sh).

The call its Trainer.train_epoch makes: Eagle3DraftModel(...)(hidden_states, input_ids, document_ids,
loss_mask, position_ids, verifier_last_hidden_states, ttt_steps, ttt_step_loss_decay, loss_config), then
backward, minus autocast, clipping and the optimizer. The model is built as from_training_args builds
it with the trainer's defaults (Llama layer, norm_before_residual / norm_before_fc / norm_output, the
embedding and lm_head frozen as speculators keeps them); random weights stand in for the verifier's.
Attention "sdpa" (its non-flex option; flex attention compiles per shape), loss kl_div "eager" (its
"fused" loss is Triton only). Its teacher (verifier norm + lm_head, no grad) runs inside the step.
"""

from _common import parse_args, report, time_steps, vocab_map


def main() -> None:
    a = parse_args(__doc__)
    import torch
    from transformers import LlamaConfig

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    s, T, H = a.shape, a.seq_len, a.shape["hidden_size"]
    layer = LlamaConfig(architectures=["LlamaForCausalLM"], hidden_size=H, intermediate_size=s["intermediate_size"],
                        num_attention_heads=s["num_attention_heads"], num_key_value_heads=s["num_key_value_heads"],
                        head_dim=H // s["num_attention_heads"], rms_norm_eps=s["rms_norm_eps"],
                        rope_parameters={"rope_type": "default", "rope_theta": s["rope_theta"]},
                        max_position_embeddings=max(8192, (a.ttt + 1) * T + 32), vocab_size=s["vocab_size"],
                        num_hidden_layers=1, hidden_act="silu")
    layer._attn_implementation = "sdpa"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=a.draft_vocab, norm_before_residual=True,
        norm_before_fc=True, fc_norm=False, norm_output=True, embed_requires_grad=False,
        eagle_aux_hidden_state_layer_ids=[1, 15, 26],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=a.ttt)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None,
                                                                      architectures=["LlamaForCausalLM"])))
    model = Eagle3DraftModel(config=config).float()
    t2d, d2t = vocab_map(s["vocab_size"], a.draft_vocab)
    model.load_vocab_mappings(t2d, d2t)
    with torch.no_grad():  # in place of load_verifier_weights(), which reads a checkpoint
        model.embed_tokens.weight.normal_(0.0, 0.02)
        head = torch.randn(s["vocab_size"], H) * 0.02
        model.lm_head.weight.copy_(head[t2d])
        model.verifier_lm_head.weight.copy_(head[t2d])
    model.train()
    loss_config = resolve_loss_config("kl_div", "eager")
    inputs = dict(hidden_states=torch.randn(1, T, 3 * H), input_ids=torch.randint(0, s["vocab_size"], (1, T)),
                  document_ids=torch.zeros(1, T, dtype=torch.long), loss_mask=torch.ones(1, T, dtype=torch.bool),
                  position_ids=torch.arange(1, T + 1)[None], verifier_last_hidden_states=torch.randn(1, T, H))
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        _, loss, _ = model(**inputs, ttt_steps=a.ttt, ttt_step_loss_decay=1.0, loss_config=loss_config)
        loss.backward()
        return loss

    seconds = time_steps("speculators", step, params, a.repeats)
    report("speculators", a, seconds,
           f"Eagle3DraftModel.forward(ttt_steps={a.ttt}) + backward; {sum(p.numel() for p in params) / 1e6:.1f}M "
           f"trainable (lm_head frozen, as speculators keeps it: no lm_head weight gradient); attention sdpa over a "
           f"key cache growing to {a.ttt}T; loss kl_div eager; its teacher head inside the step; fp32, "
           f"{a.threads} threads")


if __name__ == "__main__":
    main()
