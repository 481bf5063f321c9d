"""One SpecForge 0.2.0 EAGLE3 draft training step (run with the peer venv, setup_peers.sh, or on a GPU machine
with .whl/peers installed: studies/peers/gpu_wheels.sh).

Its own classes throughout: LlamaForCausalLMEagle3 (one layer, embedding frozen as build_eagle3_draft
does), OnlineEagle3Model (its TTT loop) and Eagle3TrainStrategy.forward_loss (steps weighted 0.8**k),
then backward.
Default (CPU, fp32): attention_backend "sdpa" (its eager path with a [T, T] score matrix per step); its
LogSoftmaxLoss is a Triton kernel (GPU only), so its own reference specforge.core.loss._compute_loss
(same value, autograd backward) stands in, swapped at run time (--loss reference); the teacher comes as
target logits (target_repr "logits", made from final_hidden by its TargetHead outside the step).
--device cuda (what its trainer does on a GPU): attention_backend "flex_attention" (its training default:
compiled flex_attention + compiled create_block_mask over a DynamicCache growing to ttt*T keys), its Triton
LogSoftmaxLoss as shipped (--loss triton), the teacher as its 0.2 trainer gets it (offline and
disaggregated-online alike: target_repr "hidden_state", the target's final hidden state, which its frozen
TargetHead, bf16 as TargetHead.from_pretrained makes it, projects to full-vocabulary logits inside the
step, compact_teacher off as by default). --dtype bfloat16: the whole draft in bf16 (model.torch_dtype
defaults to bfloat16 and the model is cast to it; no autocast; its BF16Optimizer keeps fp32 masters only
in the optimizer, which is not timed).
Several --seq-len: the model (max_position_embeddings for the largest) and its TargetHead are built once,
then each length gets its own batch, warm-up and timed steps (see _common).
"""

import tempfile

from _common import STATE, each_length, load_inputs, parse_args, run, target_head, time_steps, vocab_map


def main() -> None:
    a = parse_args(__doc__)
    cuda = a.device == "cuda"
    a.attention = a.attention or ("flex_attention" if cuda else "sdpa")
    a.loss = a.loss or ("triton" if cuda else "reference")
    a.teacher = a.teacher or ("hidden_state" if cuda else "logits")
    if a.loss not in ("triton", "reference"):
        raise SystemExit(f"--loss {a.loss}: SpecForge has 'triton' (LogSoftmaxLoss) or 'reference' (_compute_loss)")
    if a.loss == "triton" and not cuda:
        raise SystemExit("--loss triton needs --device cuda (its LogSoftmaxLoss is a GPU Triton kernel)")
    import torch
    from transformers import LlamaConfig

    import specforge.algorithms.eagle3.model as eagle3_model
    from specforge.core import loss as sf_loss
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.modeling.target.target_head import TargetHead
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.strategies.base import Eagle3TrainStrategy

    if a.loss == "reference":
        class ReferenceLoss:  # the CPU stand-in for the Triton LogSoftmaxLoss: SpecForge's own reference
            apply = staticmethod(sf_loss._compute_loss)

        eagle3_model.LogSoftmaxLoss = ReferenceLoss
    s, H, V = a.shape, a.shape["hidden_size"], a.shape["vocab_size"]
    STATE["notes"] = f"attention_backend={a.attention}, loss {a.loss}, teacher {a.teacher}, {a.dtype} on {a.device}"
    config = LlamaConfig(architectures=["LlamaForCausalLMEagle3"], hidden_size=H,
                         intermediate_size=s["intermediate_size"], num_attention_heads=s["num_attention_heads"],
                         num_key_value_heads=s["num_key_value_heads"], head_dim=H // s["num_attention_heads"],
                         rms_norm_eps=s["rms_norm_eps"],
                         rope_parameters={"rope_type": "default", "rope_theta": s["rope_theta"]},
                         max_position_embeddings=max(8192, a.max_len + a.ttt + 32), vocab_size=V,
                         draft_vocab_size=a.draft_vocab, target_hidden_size=H, num_hidden_layers=1,
                         hidden_act="silu", pretraining_tp=1)
    draft = LlamaForCausalLMEagle3(config, attention_backend=a.attention)
    t2d, d2t = vocab_map(V, a.draft_vocab)
    with torch.no_grad():
        draft.t2d.copy_(t2d)
        draft.d2t.copy_(d2t)
        draft.embed_tokens.weight.normal_(0.0, 0.02)
    draft.freeze_embedding()
    draft = draft.to(device=a.device, dtype=a.torch_dtype)  # as build_eagle3_draft: .to(device, torch_dtype)
    model = eagle3_model.OnlineEagle3Model(draft_model=draft, length=a.ttt, attention_backend=a.attention)
    model = model.to(device=a.device, dtype=a.torch_dtype)
    model.train()

    # its TargetHead (frozen lm_head [V, H]; from_pretrained reads a checkpoint, so the config comes from a
    # scratch directory and the weight is the shared random head); bf16 on a GPU as from_pretrained casts it
    with tempfile.TemporaryDirectory() as tmp:
        LlamaConfig(hidden_size=H, vocab_size=V, num_hidden_layers=1, num_attention_heads=s["num_attention_heads"],
                    num_key_value_heads=s["num_key_value_heads"], intermediate_size=s["intermediate_size"]
                    ).save_pretrained(tmp)
        head = TargetHead(tmp)
    with torch.no_grad():
        head.fc.weight.copy_(target_head(V, H))
    head.freeze_weights()
    # with the logits teacher the head only makes each length's targets outside the step: it waits on the CPU
    # between lengths (as a single length had it deleted before the timing)
    head = head.eval().to(device=a.device if a.teacher == "hidden_state" else "cpu",
                          dtype=torch.bfloat16 if cuda else a.torch_dtype)
    if a.teacher == "hidden_state":
        strategy = Eagle3TrainStrategy(model, target_head=head)
    else:  # logits as an online capture would deliver them: shifted, projected outside the step
        strategy = Eagle3TrainStrategy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    STATE["notes"] += f"; {sum(p.numel() for p in params) / 1e6:.1f}M trainable"

    def measure() -> float:  # one length: its batch, then the warm-up and timed steps
        inputs = load_inputs(a)
        tensors = {"attention_mask": torch.ones(1, a.seq_len, dtype=torch.long, device=a.device),
                   "hidden_state": inputs["aux"].to(a.torch_dtype)}
        if a.teacher == "hidden_state":
            tensors.update(input_ids=inputs["input_ids"], loss_mask=inputs["loss_mask"], target=inputs["final_hidden"])
        else:
            head.to(a.device)
            with torch.no_grad():
                ids, hidden, mask = head.preprocess(inputs["input_ids"], inputs["final_hidden"], inputs["loss_mask"])
                tensors.update(input_ids=ids, loss_mask=mask, target=head(hidden.to(head.fc.weight.dtype)))
            del ids, hidden, mask
            head.to("cpu")
        del inputs
        batch = TrainBatch(sample_ids=["row0"], strategy="eagle3", metadata={"target_repr": a.teacher},
                           tensors=tensors)
        del tensors

        def step():
            loss = strategy.forward_loss(batch).loss
            loss.backward()
            return loss

        return time_steps("specforge", step, params, a)

    notes = (f"LlamaForCausalLMEagle3 + OnlineEagle3Model(attention_backend='{a.attention}', length={a.ttt}) + "
             f"Eagle3TrainStrategy.forward_loss + backward; {sum(p.numel() for p in params) / 1e6:.1f}M trainable "
             f"(lm_head included); loss: "
             + ("its Triton LogSoftmaxLoss" if a.loss == "triton" else "its reference _compute_loss for the Triton "
                "LogSoftmaxLoss")
             + "; teacher: "
             + ("target_repr hidden_state (its TargetHead makes the full-vocab logits inside the step)"
                if a.teacher == "hidden_state" else "target logits made outside the step")
             + f"; draft in {a.dtype} (no autocast); torch.compile as shipped; {a.device}"
             + ("" if cuda else f", {a.threads} threads"))
    each_length("specforge", a, params, measure, notes)


if __name__ == "__main__":
    run("specforge", main)
