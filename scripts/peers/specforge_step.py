"""One SpecForge 0.2.0 EAGLE3 draft training step on CPU, fp32 (run in the peer venv: setup_peers.sh).

Its own classes throughout: LlamaForCausalLMEagle3 (one layer, embedding frozen as build_eagle3_draft
does), OnlineEagle3Model (its TTT loop, attention_backend "sdpa": its eager path with a [T, T] score
matrix per step) and Eagle3TrainStrategy.forward_loss (steps weighted 0.8**k), then backward.
One substitution: its LogSoftmaxLoss is a Triton kernel (GPU only); its own reference
specforge.core.loss._compute_loss (same value, autograd backward) stands in, swapped at run time.
The teacher comes as target logits (target_repr="logits"); its t2d mapping and softmax run in the step.
"""

from _common import parse_args, report, time_steps, vocab_map


def main() -> None:
    a = parse_args(__doc__)
    import torch
    from transformers import LlamaConfig

    import specforge.algorithms.eagle3.model as eagle3_model
    from specforge.core import loss as sf_loss
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.strategies.base import Eagle3TrainStrategy

    class ReferenceLoss:  # the CPU stand-in for the Triton LogSoftmaxLoss: SpecForge's own reference
        apply = staticmethod(sf_loss._compute_loss)

    eagle3_model.LogSoftmaxLoss = ReferenceLoss
    s, T, H = a.shape, a.seq_len, a.shape["hidden_size"]
    config = LlamaConfig(architectures=["LlamaForCausalLMEagle3"], hidden_size=H,
                         intermediate_size=s["intermediate_size"], num_attention_heads=s["num_attention_heads"],
                         num_key_value_heads=s["num_key_value_heads"], head_dim=H // s["num_attention_heads"],
                         rms_norm_eps=s["rms_norm_eps"],
                         rope_parameters={"rope_type": "default", "rope_theta": s["rope_theta"]},
                         max_position_embeddings=max(8192, T + a.ttt + 32), vocab_size=s["vocab_size"],
                         draft_vocab_size=a.draft_vocab, target_hidden_size=H, num_hidden_layers=1,
                         hidden_act="silu", pretraining_tp=1)
    draft = LlamaForCausalLMEagle3(config, attention_backend="sdpa").float()
    t2d, d2t = vocab_map(s["vocab_size"], a.draft_vocab)
    with torch.no_grad():
        draft.t2d.copy_(t2d)
        draft.d2t.copy_(d2t)
        draft.embed_tokens.weight.normal_(0.0, 0.02)
    draft.freeze_embedding()
    model = eagle3_model.OnlineEagle3Model(draft_model=draft, length=a.ttt, attention_backend="sdpa").float()
    model.train()
    strategy = Eagle3TrainStrategy(model)
    batch = TrainBatch(sample_ids=["row0"], strategy="eagle3", metadata={"target_repr": "logits"}, tensors={
        "input_ids": torch.randint(0, s["vocab_size"], (1, T)), "attention_mask": torch.ones(1, T, dtype=torch.long),
        "loss_mask": torch.ones(1, T, 1, dtype=torch.long), "hidden_state": torch.randn(1, T, 3 * H),
        "target": torch.randn(1, T, s["vocab_size"])})
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        loss = strategy.forward_loss(batch).loss
        loss.backward()
        return loss

    seconds = time_steps("specforge", step, params, a.repeats)
    report("specforge", a, seconds,
           f"LlamaForCausalLMEagle3 + OnlineEagle3Model(attention_backend='sdpa', length={a.ttt}) + "
           f"Eagle3TrainStrategy.forward_loss + backward; {sum(p.numel() for p in params) / 1e6:.1f}M trainable "
           f"(lm_head included); its Triton LogSoftmaxLoss replaced by its reference _compute_loss; teacher as "
           f"target logits; torch.compile as shipped; fp32, {a.threads} threads")


if __name__ == "__main__":
    main()
