"""DFlash 2 (methods/dflash2/) against references written here: the convolution slot by slot, a fresh draft
against DFlash's proven forward, and the selector's loss and drafting walk with the scores written out.
(Against speculators' own DFlash 2 model and vLLM's own class: tests/test_serving.py.)"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_target, tiny_vocab
from specforge_lite.methods import METHODS, draft_spec
from specforge_lite.methods.dflash.model import DFlashDraft, DFlashObjective
from specforge_lite.methods.dflash2.model import DFlash2Context, DFlash2Draft, DFlash2Objective, grouped_causal_conv
from test_dflash import MASK, block_inputs, naive_block, tiny_block_draft
from test_ttt import rms


def test_the_convolution_slot_by_slot():
    """out[s] = sum over taps t <= s of (base[t] + delta[s, t, group]) * x[s - t], per channel group, inside each
    block only (written as a loop here)."""
    g = torch.Generator().manual_seed(0)
    B, S, A, H, taps, size = 2, 4, 3, 8, 3, 4
    x, base = torch.randn(B, S, A, H, generator=g), torch.randn(taps, H, generator=g)
    delta = torch.randn(B, S, A, taps, H // size, generator=g)
    got = grouped_causal_conv(x, delta, base, size)
    for b in range(B):
        for a in range(A):
            for s in range(S):
                want = torch.zeros(H)
                for t in range(min(taps, s + 1)):
                    want += (base[t] + delta[b, s, a, t].repeat_interleave(size)) * x[b, s - t, a]
                torch.testing.assert_close(got[b, s, a], want, atol=1e-5, rtol=1e-5)


def test_a_fresh_dflash2_draft_is_the_dflash_draft_of_its_weights_and_its_selector_loss_is_the_written_one():
    """Fresh convolutions are the identity: the token loss is DFlash's (tests/test_dflash.py proves it against a
    naive forward) on the same weights. The selector's term: per slot, the cross-entropy over the draft's top-k
    (the teacher's token put in last where absent) of unary logit + <pred[x[a + j - 1]] * P(normed state),
    succ[candidate]>, weighted like the slot's loss. Then drafting walks the block taking the best candidate
    after the one it took. Fails with the selector reading the pre-norm state or the predicted token."""
    target = tiny_target()
    T, k, decay, alpha = 11, 3, 0.8, 0.6
    draft = tiny_block_draft(target, "dflash2", selector_rank=8, selector_top_k=4, block_size=k + 1)
    x = block_inputs(target, draft, teacher_scale=3.0, T=T)
    ids, aux, teacher, loss_mask, in_vocab = x.input_ids, x.aux, x.teacher_logits, x.loss_mask, x.in_vocab
    out = DFlash2Objective(k, decay, loss_chunk_rows=5, selector_weight=alpha).unroll(draft, x)
    plain = DFlashDraft(draft.spec)
    plain.load_state_dict({n: t for n, t in draft.state_dict().items() if "_conv." not in n and "selector" not in n})
    plain.set_embedding(target.embedding_weight())
    token_loss = DFlashObjective(k, decay).unroll(plain, x).loss
    sel, spec = draft.candidate_selector, draft.spec
    expected = float(token_loss.detach())
    with torch.no_grad():
        for j in range(1, k + 1):
            terms = []
            for a in range(1, T - j):
                if not (loss_mask[0, a + j] and in_vocab[0, a + j - 1]):
                    continue
                normed = rms(naive_block(draft, aux, ids, a, k)[j], draft.norm.weight, spec.rms_norm_eps)
                logits = normed @ draft.lm_head.weight.T
                top = int(teacher[0, a + j - 1].argmax())
                cands = logits.topk(spec.selector_top_k).indices.tolist()
                if top not in cands:
                    cands[-1] = top
                edge = sel.predecessor_codebook[int(ids[0, a + j - 1])] * (normed @ sel.hidden_projection.weight.T)
                scores = torch.stack([logits[c] + edge @ sel.successor_codebook[c] for c in cands])
                terms.append(float(F.cross_entropy(scores[None], torch.tensor([cands.index(top)]))))
            expected += alpha * decay ** (j - 1) * sum(terms) / max(len(terms), 1)
    assert abs(float(out.loss.detach()) - expected) < 1e-4 * max(1.0, expected)
    out.loss.backward()
    assert all(p.grad is not None for p in draft.parameters())

    drafted = DFlash2Context(draft)
    got = drafted.propose([a[:, :T - 1] for a in aux], ids[0, :T - 1].tolist(), int(ids[0, T - 1]), k)
    with torch.no_grad():
        states, previous, walk = naive_block(draft, aux, ids, T - 1, k), int(ids[0, T - 1]), []
        for j in range(1, k + 1):
            normed = rms(states[j], draft.norm.weight, spec.rms_norm_eps)
            logits = normed @ draft.lm_head.weight.T
            edge = sel.predecessor_codebook[previous] * (normed @ sel.hidden_projection.weight.T)
            cands = logits.topk(spec.selector_top_k).indices.tolist()
            previous = max(cands, key=lambda c: float(logits[c] + edge @ sel.successor_codebook[c]))
            walk.append(previous)
    assert got == walk


def test_dflash2_settings_refused_export_checked_and_round_trip(tmp_path):
    from specforge_lite.compose import load_config
    from specforge_lite.export import check_draft_tokens, export_draft, load_export
    from specforge_lite.export.check import check_export
    from specforge_lite.export.for_target import draft_from_weights
    from specforge_lite.settings import check_settings

    base = ["draft=dflash2", "tracker=none"]
    with pytest.raises(ValueError, match="draft=dflash2 does not take draft.use_aux_norm"):
        check_settings(load_config([*base, "draft.use_aux_norm=true"]))
    with pytest.raises(ValueError, match="conv_kernel_size=5 is longer than the block"):
        check_settings(load_config([*base, "draft.conv_kernel_size=5"]))
    check_settings(load_config(base))
    target = tiny_target(aux_ids=[2, 4, 6])
    vocab = tiny_vocab(target, 96)
    reduced = draft_spec(target.config, METHODS["dflash2"].settings(mask_token_id=MASK),
                         target.aux_layer_ids, target.convention, target.vocab_size, vocab.size,
                         target.hidden_size)
    with pytest.raises(ValueError, match="keeps the whole target vocabulary"):  # (runs build it whole)
        DFlash2Draft(reduced)

    draft = tiny_block_draft(target, "dflash2", selector_rank=8, selector_top_k=4, block_size=4)
    out = export_draft(draft.trainable_state_dict(), draft.spec, "vllm", tmp_path / "v", num_speculative_tokens=3)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["block_size"] == 4
    assert config["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [1, 3, 5], "conv_kernel_size": 2,
                                       "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
    report = check_export(out)
    assert report.ok, report.text()
    check_draft_tokens(out, 3)
    with pytest.raises(ValueError, match="propose k=3 tokens per block"):
        check_draft_tokens(out, 4)
    spec, weights = load_export(out)
    back = draft_from_weights(spec, weights, target)
    ids = torch.randint(0, target.vocab_size, (1, 8))
    aux = target.capture(ids).aux
    assert DFlash2Context(draft).propose(aux, ids[0].tolist(), 5, 3) == DFlash2Context(back).propose(
        aux, ids[0].tolist(), 5, 3)
    del config["dflash_config"]["selector_rank"]
    (out / "config.json").write_text(json.dumps(config))
    assert any("lacks ['selector_rank']" in e for e in check_export(out).errors)
