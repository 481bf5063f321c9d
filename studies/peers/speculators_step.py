"""One speculators 0.9.0 EAGLE3 draft training step (run with the peer venv, setup_peers.sh, or on a GPU machine
with .whl/peers installed: studies/peers/gpu_wheels.sh).

The call its Trainer.train_epoch makes: Eagle3DraftModel(...)(hidden_states, input_ids, document_ids,
loss_mask, position_ids, verifier_last_hidden_states, ttt_steps, ttt_step_loss_decay, loss_config), then
backward, minus clipping and the optimizer. The model is built as from_training_args builds it with the
trainer's defaults (Llama layer, norm_before_residual / norm_before_fc / norm_output, the embedding and
lm_head frozen as speculators keeps them); random weights stand in for the verifier's (its lm_head rows
are the shared random target head's draft rows). Its teacher (verifier norm + lm_head, no grad) runs
inside the step, on final_hidden (so its verifier_norm, weight 1, normalizes it once more).
Default (CPU, fp32): attention "sdpa" (its non-flex option), loss kl_div "eager".
--device cuda (what its trainer does on a GPU): draft_attn_impl "simple_flex_attention" (its default:
block masks from create_block_mask, extended per TTT step), loss kl_div "fused" (its Triton kernel, its
default), and Eagle3DraftModel.forward torch.compiled as speculators does itself whenever CUDA is
available (conditional_torch_compile at import). --dtype bfloat16: as its trainer, fp32 master weights
with the forward under torch.autocast(dtype=bfloat16) (hidden_states_dtype) and bf16 hidden-state inputs.
On torch 2.11 the compiled forward cannot trace its fused loss kernels (a Dynamo bug, fixed upstream in
pytorch/pytorch#177874); that fix is applied to torch at run time (see dynamo_triton_fix).
Several --seq-len: the model (max_position_embeddings for the largest) is built once, then each length gets
its own inputs, warm-up (any recompile for the new shape included) and timed steps (see _common).
"""

import inspect

from _common import STATE, each_length, load_inputs, parse_args, run, target_head, time_steps, vocab_map


def dynamo_triton_fix() -> bool:
    """torch 2.11's Dynamo registers an autotuned Triton kernel's ``configs`` list for mutation once per call in a
    trace (``VariableBuilder._wrap``), so a compiled forward that launches speculators' fused loss kernels (their
    two autotuners share one configs list, and the unroll calls them again) fails with "ListVariable ... is
    already tracked for mutation". PyTorch fixed it (pytorch/pytorch#177874) by routing through
    ``VariableBuilder.__call__``; the same one-line fix is applied here at run time where the old code is found.
    The peer's code and kernels are untouched. Returns whether it was applied."""
    from torch._dynamo.variables import functions as dynamo_functions

    cls = getattr(dynamo_functions, "DynamoTritonHOPifier", None)
    if cls is None or "._wrap(user_obj)" not in inspect.getsource(cls.wrap_user_defined_obj):
        return False

    def wrap_user_defined_obj(self, user_obj, tx, variable, name):
        from torch._dynamo.source import AttrSource
        from torch._dynamo.variables.builder import VariableBuilder

        return VariableBuilder(tx, AttrSource(variable.kernel_source, f"{name}"))(user_obj)

    cls.wrap_user_defined_obj = wrap_user_defined_obj
    return True


def main() -> None:
    a = parse_args(__doc__)
    cuda = a.device == "cuda"
    a.attention = a.attention or ("simple_flex_attention" if cuda else "sdpa")
    a.loss = a.loss or ("fused" if cuda else "eager")
    if a.loss == "fused" and not cuda:
        raise SystemExit("--loss fused needs --device cuda (its fused loss is a GPU Triton kernel)")
    import contextlib

    import torch
    from transformers import LlamaConfig

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    fixed = cuda and torch.cuda.is_available() and dynamo_triton_fix()
    s, H, V = a.shape, a.shape["hidden_size"], a.shape["vocab_size"]
    STATE["notes"] = f"draft_attn_impl={a.attention}, loss kl_div {a.loss}, {a.dtype} on {a.device}"
    layer = LlamaConfig(architectures=["LlamaForCausalLM"], hidden_size=H, intermediate_size=s["intermediate_size"],
                        num_attention_heads=s["num_attention_heads"], num_key_value_heads=s["num_key_value_heads"],
                        head_dim=H // s["num_attention_heads"], rms_norm_eps=s["rms_norm_eps"],
                        rope_parameters={"rope_type": "default", "rope_theta": s["rope_theta"]},
                        max_position_embeddings=max(8192, (a.ttt + 1) * a.max_len + 32), vocab_size=V,
                        num_hidden_layers=1, hidden_act="silu")
    layer._attn_implementation = a.attention  # as from_training_args sets it from draft_attn_impl
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=a.draft_vocab, norm_before_residual=True,
        norm_before_fc=True, fc_norm=False, norm_output=True, embed_requires_grad=False,
        eagle_aux_hidden_state_layer_ids=[1, 15, 26],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=a.ttt)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None,
                                                                      architectures=["LlamaForCausalLM"])))
    model = Eagle3DraftModel(config=config).float()  # fp32 master weights, as its trainer keeps them
    t2d, d2t = vocab_map(V, a.draft_vocab)
    model.load_vocab_mappings(t2d, d2t)
    with torch.no_grad():  # in place of load_verifier_weights(), which reads a checkpoint
        model.embed_tokens.weight.normal_(0.0, 0.02)
        head = target_head(V, H)
        model.lm_head.weight.copy_(head[t2d])
        model.verifier_lm_head.weight.copy_(head[t2d])
        del head
    model.to(a.device)  # Trainer.setup_model: self.model.to(self.local_rank)
    model.train()
    loss_config = resolve_loss_config("kl_div", a.loss)
    params = [p for p in model.parameters() if p.requires_grad]
    STATE["notes"] += f"; {sum(p.numel() for p in params) / 1e6:.1f}M trainable"
    autocast = (lambda: torch.autocast(a.device, dtype=a.torch_dtype)) if a.dtype != "float32" \
        else contextlib.nullcontext

    def measure() -> float:  # one length: its inputs, then the warm-up and timed steps
        inputs, T = load_inputs(a), a.seq_len
        step_inputs = dict(hidden_states=inputs["aux"], input_ids=inputs["input_ids"],
                           document_ids=torch.zeros(1, T, dtype=torch.long, device=a.device),
                           loss_mask=inputs["loss_mask"].bool(),
                           position_ids=torch.arange(1, T + 1, device=a.device)[None],
                           verifier_last_hidden_states=inputs["final_hidden"])
        del inputs

        def step():
            with autocast():  # Trainer.train_epoch: the forward under autocast, backward outside it
                _, loss, _ = model(**step_inputs, ttt_steps=a.ttt, ttt_step_loss_decay=1.0, loss_config=loss_config)
            loss.backward()
            return loss

        return time_steps("speculators", step, params, a)

    compiled = "forward torch.compiled by speculators (CUDA available)" if torch.cuda.is_available() \
        else "forward eager (no CUDA: speculators compiles only when CUDA is available)"
    notes = (f"Eagle3DraftModel.forward(ttt_steps={a.ttt}) + backward; {sum(p.numel() for p in params) / 1e6:.1f}M "
             f"trainable (lm_head frozen, as speculators keeps it: no lm_head weight gradient); attention "
             f"{a.attention} over a key cache growing to {a.ttt}T; loss kl_div {a.loss}; its teacher head inside the "
             f"step; {compiled}; fp32 weights"
             + (f" under autocast {a.dtype}" if a.dtype != "float32" else "") + f"; {a.device}"
             + ("" if cuda else f", {a.threads} threads")
             + ("; torch Dynamo fix pytorch#177874 applied at run time (configs list tracked once)" if fixed else ""))
    each_length("speculators", a, params, measure, notes)


if __name__ == "__main__":
    run("speculators", main)
