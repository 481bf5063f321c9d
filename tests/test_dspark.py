"""DSpark (methods/dspark/) against a naive reference written here: one anchor and one slot at a time, the block
from test_dflash's naive forward, the Markov bias and the confidence head written out, and the loss as DSpark
defines it. (Against speculators' own DSpark model and vLLM's own class: tests/test_serving.py.)"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_target
from specforge_lite.methods.dspark.model import DSparkContext, DSparkObjective
from test_dflash import MASK, block_inputs, naive_block, tiny_block_draft
from test_ttt import rms


def naive_slot(draft, state: torch.Tensor, previous: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(Markov-biased logits [Vd], confidence logit) of one slot state, written out."""
    s = draft.spec
    normed = rms(state, draft.norm.weight, s.rms_norm_eps)
    e = draft.markov_head.markov_w1.weight[previous]
    logits = normed @ draft.lm_head.weight.T + e @ draft.markov_head.markov_w2.weight.T
    w, b = draft.confidence_head.proj.weight, draft.confidence_head.proj.bias
    return logits, (torch.cat([normed, e]) @ w[0] + b[0])


def test_dspark_loss_and_drafting_equal_the_naive_forward():
    """Training: anchor a's block [x[a], masks] at positions a..a+k-1, slot s scored against the teacher at
    row a + s (it predicts x[a + s + 1]) with the Markov bias of x[a + s]; per slot the mean over valid
    anchors of 0.1 soft CE + 0.9 TV + the confidence BCE against the overlap sum_v min(p, q), weighted
    decay ** s. Drafting: one forward over the block, the tokens chosen left to right, each slot biased by
    the token drafted before it, the confidences the head's sigmoid. Fails with DFlash's layout (slot s
    predicting x[a + s]), with the bias taken from the predicted token, or with the confidence head fed the
    pre-norm state."""
    target = tiny_target()
    T, k, decay, alpha = 11, 3, 0.8, 0.7
    draft = tiny_block_draft(target, "dspark", markov_rank=8, block_size=k)
    x = block_inputs(target, draft, teacher_scale=3.0, T=T)
    ids, aux, teacher, loss_mask, in_vocab = x.input_ids, x.aux, x.teacher_logits, x.loss_mask, x.in_vocab
    out = DSparkObjective(k, decay, loss_chunk_rows=5, confidence_weight=alpha).unroll(draft, x)
    expected = 0.0
    with torch.no_grad():
        for s in range(k):
            terms = []
            for a in range(1, T - s - 1):
                if not (loss_mask[0, a + s + 1] and in_vocab[0, a + s]):
                    continue
                state = naive_block(draft, aux, ids, a, k - 1)[s]
                logits, confidence = naive_slot(draft, state, int(ids[0, a + s]))
                p, q = torch.softmax(teacher[0, a + s], -1), torch.softmax(logits, -1)
                overlap = torch.minimum(p, q).sum()
                token = 0.1 * float(-(p * torch.log_softmax(logits, -1)).sum()) + 0.9 * float(1 - overlap)
                terms.append(token + alpha * float(F.binary_cross_entropy_with_logits(confidence, overlap)))
            assert int(out.steps[s].valid) == len(terms)
            expected += decay ** s * sum(terms) / max(len(terms), 1)
    assert abs(float(out.loss.detach()) - expected) < 1e-4 * max(1.0, expected)
    out.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in draft.named_parameters()
               if not n.startswith("lm_head")), "a weight DSpark trains got no gradient"

    # drafting after the row, in two rounds (the context's keys kept in between)
    drafted = DSparkContext(draft)
    drafted.propose([a[:, :5] for a in aux], ids[0, :5].tolist(), int(ids[0, 5]), k)
    got = drafted.propose([a[:, 5:T - 1] for a in aux], ids[0, :T - 1].tolist(), int(ids[0, T - 1]), k)
    with torch.no_grad():
        states = naive_block(draft, aux, ids, T - 1, k - 1)  # context rows < T - 1, block [x[T - 1], masks]
        previous, tokens, confidences = int(ids[0, T - 1]), [], []
        for s in range(k):
            logits, confidence = naive_slot(draft, states[s], previous)
            previous = int(draft.draft_to_target(logits.argmax()))
            tokens.append(previous)
            confidences.append(float(torch.sigmoid(confidence)))
    assert got == tokens
    assert drafted.confidences == pytest.approx(confidences, abs=1e-5)


def test_dspark_settings_refused_export_checked_and_round_trip(tmp_path):
    from specforge_lite.compose import load_config
    from specforge_lite.export import check_draft_tokens, export_draft, load_export
    from specforge_lite.export.check import check_export
    from specforge_lite.export.for_target import draft_from_weights
    from specforge_lite.settings import check_settings

    base = ["draft=dspark", "tracker=none"]
    with pytest.raises(ValueError, match="draft=dspark does not take draft.norm_output"):
        check_settings(load_config([*base, "draft.norm_output=true"]))
    with pytest.raises(ValueError, match="draft=dspark does not take draft.loss"):
        check_settings(load_config([*base, "draft.loss=tv"]))
    with pytest.raises(ValueError, match="markov_rank=0"):
        check_settings(load_config([*base, "draft.markov_rank=0"]))
    with pytest.raises(ValueError, match="draft.block_size=4 proposes 4 tokens per block .* set draft.block_size=3"):
        check_settings(load_config([*base, "draft.block_size=4"]))  # (DSpark's block: k slots, every one predicting)
    check_settings(load_config(base))
    if not torch.cuda.is_available():  # vLLM's CPU build cannot serve DSpark: said before training, not after
        with pytest.raises(ValueError, match="eval.serve=vllm with draft=dspark: vLLM 0.32 serves"):
            check_settings(load_config([*base, "eval.serve=vllm"]))

    target = tiny_target(aux_ids=[2, 4, 6])
    draft = tiny_block_draft(target, "dspark", draft_vocab=96, markov_rank=8, block_size=4)
    assert draft.spec.block_size == 4  # k slots: the next token's and k - 1 masks, every one a prediction
    out = export_draft(draft.trainable_state_dict(), draft.spec, "vllm", tmp_path / "v", num_speculative_tokens=4)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DSparkDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [1, 3, 5]}
    assert (config["block_size"], config["markov_rank"], config["sample_from_anchor"]) == (4, 8, True)
    assert config["enable_confidence_head"] and config["confidence_head_with_markov"]
    report = check_export(out)
    assert report.ok, report.text()
    check_draft_tokens(out, 4)
    with pytest.raises(ValueError, match="propose k=4 tokens per block"):
        check_draft_tokens(out, 3)
    spec, weights = load_export(out)
    back = draft_from_weights(spec, weights, target)
    ids = torch.randint(0, target.vocab_size, (1, 8))
    aux = target.capture(ids).aux
    contexts = [DSparkContext(d) for d in (draft, back)]
    assert contexts[0].propose(aux, ids[0].tolist(), 5, 4) == contexts[1].propose(aux, ids[0].tolist(), 5, 4)
    assert contexts[0].confidences == pytest.approx(contexts[1].confidences)

    # the check names a head vLLM would build with another shape, and a missing one
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(out / "model.safetensors"))
    tensors["markov_head.markov_w2.weight"] = tensors["markov_head.markov_w2.weight"][:, :4].contiguous()
    del tensors["confidence_head.proj.bias"]
    save_file(tensors, str(out / "model.safetensors"))
    errors = check_export(out).errors
    assert any("markov_head.markov_w2.weight has shape (96, 4)" in e for e in errors), errors
    assert any("confidence_head.proj.bias is missing" in e for e in errors), errors
