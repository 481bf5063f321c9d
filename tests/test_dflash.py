"""DFlash (methods/dflash/) against a naive reference written here: one anchor and one slot at a time, with
explicit key lists, the way vLLM's qwen3_dflash.py lays the context and the block out."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_target, tiny_vocab
from specforge_lite.draft.objective import UnrollInputs
from specforge_lite.methods import METHODS, draft_method, draft_spec
from specforge_lite.methods.dflash.model import DFlashContext, DFlashDraft, DFlashObjective
from test_ttt import rms, rope

MASK = 3


HEADS = ("markov_head.", "confidence_head.", "candidate_selector.")  # DSpark's and DFlash 2's heads


def tiny_block_draft(target, method: str = "dflash", layers: int = 2, seed: int = 0, draft_vocab: int | None = None,
                     **settings):
    """A block draft (DFlash, DSpark, DFlash 2) for the tiny target, ``settings`` its method's settings. Norms away
    from 1, so a norm left out or applied to the wrong tensor shows; layers whose attention moves the state as
    much as a trained one's; heads whose terms are not negligible. DFlash 2's convolutions stay the identity."""
    vocab = tiny_vocab(target, draft_vocab or target.vocab_size)
    spec = draft_spec(target.config, METHODS[method].settings(mask_token_id=MASK, num_layers=layers, **settings),
                      target.aux_layer_ids, target.convention, target.vocab_size, vocab.size,
                      target.hidden_size)
    torch.manual_seed(seed)
    draft = draft_method(method).model(spec)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    draft.set_embedding(target.embedding_weight())
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "_conv." in name:
                continue
            elif name.startswith("layers."):
                p.mul_(15.0)
            elif name.startswith(HEADS):
                p.mul_(30.0)
    return draft


def block_inputs(target, draft, teacher_scale: float = 1.0, T: int = 11) -> UnrollInputs:
    """One random row of the tiny target for a block draft's objective: its aux states, a random teacher, a
    3-token prompt out of the loss and a fifth of the teacher rows outside the draft vocabulary."""
    ids = torch.randint(0, target.vocab_size, (1, T))
    aux = target.capture(ids).aux
    teacher = torch.randn(1, T, draft.spec.draft_vocab_size) * teacher_scale
    loss_mask = torch.ones(1, T, dtype=torch.long)
    loss_mask[0, :3] = 0  # a prompt: those tokens are never predicted
    return UnrollInputs(aux, ids, teacher, torch.rand(1, T) > 0.2, loss_mask)


def naive_block(draft, aux, input_ids, anchor: int, k: int) -> list[torch.Tensor]:
    """Pre-norm states of the block after row ``anchor - 1``: slots [x[anchor], mask x k] at positions
    anchor.., each attending to the context rows < anchor (keys from hidden_norm(fc(aux)), no input norm)
    and to every slot of the block."""
    s = draft.spec
    theta, eps, d = s.rope_parameters["rope_theta"], s.rms_norm_eps, s.head_dim
    group = s.num_attention_heads // s.num_key_value_heads
    ctx = rms(torch.cat([a[0, :anchor] for a in aux], -1) @ draft.fc.weight.T, draft.hidden_norm.weight, eps)
    tokens = [int(input_ids[0, anchor])] + [MASK] * k
    h = draft.embed(torch.tensor(tokens))
    for layer in draft.layers:
        at = layer.self_attn

        def heads(x, w, n):
            return (x @ w.T).view(x.shape[0], n, d)

        ck = [rope(rms(v, at.k_norm.weight, eps), j, theta) for j, v in enumerate(heads(ctx, at.k_proj.weight,
                                                                                         s.num_key_value_heads))]
        cv = list(heads(ctx, at.v_proj.weight, s.num_key_value_heads))
        x = rms(h, layer.input_layernorm.weight, eps)
        q = heads(x, at.q_proj.weight, s.num_attention_heads)
        bk, bv = heads(x, at.k_proj.weight, s.num_key_value_heads), heads(x, at.v_proj.weight, s.num_key_value_heads)
        bk = [rope(rms(bk[i], at.k_norm.weight, eps), anchor + i, theta) for i in range(k + 1)]
        out = []
        for i in range(k + 1):
            qi = rope(rms(q[i], at.q_norm.weight, eps), anchor + i, theta)
            K = torch.stack(ck + bk).repeat_interleave(group, dim=1)
            V = torch.stack(cv + list(bv)).repeat_interleave(group, dim=1)
            w = torch.softmax((K * qi).sum(-1) / d ** 0.5, dim=0)
            out.append((w[..., None] * V).sum(0).reshape(-1) @ at.o_proj.weight.T + h[i])
        h = torch.stack(out)
        m = layer.mlp
        z = rms(h, layer.post_attention_layernorm.weight, eps)
        h = (F.silu(z @ m.gate_proj.weight.T) * (z @ m.up_proj.weight.T)) @ m.down_proj.weight.T + h
    return list(h)


def test_dflash_loss_and_drafting_equal_the_naive_block_forward():
    """Training: every anchor's block at once (blockwise causal context attention with the block's keys
    merged through its log-sum-exp) gives the naive per-anchor loss: slot j against the teacher at row
    a + j - 1, mean over valid anchors, weight decay ** (j - 1). Drafting (the kept context, one softmax
    over context and block) proposes the naive block's argmax. Fails with a causal block or with the
    context keys passed through the layer's input norm."""
    target = tiny_target()
    draft = tiny_block_draft(target)
    T, k, decay = 11, 3, 0.8
    x = block_inputs(target, draft, T=T)
    ids, aux, teacher, loss_mask, in_vocab = x.input_ids, x.aux, x.teacher_logits, x.loss_mask, x.in_vocab
    out = DFlashObjective(k, decay).unroll(draft, x)
    expected, blocks = 0.0, {}
    with torch.no_grad():
        for j in range(1, k + 1):
            losses = []
            for a in range(1, T - j):
                if not (loss_mask[0, a + j] and in_vocab[0, a + j - 1]):
                    continue
                state = blocks.setdefault(a, naive_block(draft, aux, ids, a, k))[j]
                p = torch.softmax(teacher[0, a + j - 1], -1)
                losses.append(float(-(p * torch.log_softmax(draft.compute_logits(state), -1)).sum()))
            assert int(out.steps[j - 1].valid) == len(losses)
            expected += decay ** (j - 1) * sum(losses) / max(len(losses), 1)
    assert abs(float(out.loss.detach()) - expected) < 1e-4 * max(1.0, expected)
    out.loss.backward()
    assert all(p.grad is not None for n, p in draft.named_parameters() if not n.startswith("lm_head"))

    # drafting after the whole row, in two rounds (the context's keys kept in between)
    drafted = DFlashContext(draft)
    drafted.propose([a[:, :5] for a in aux], ids[0, :5].tolist(), int(ids[0, 5]), k)
    got = drafted.block_states([a[:, 5:T - 1] for a in aux], ids[0, :T - 1].tolist(), int(ids[0, T - 1]), k)
    with torch.no_grad():
        ref = naive_block(draft, aux, ids, T - 1, k)  # anchor T-1: context rows < T-1, block [x[T-1], masks]
    for j, r in enumerate(ref):
        torch.testing.assert_close(got[0, j, 0], r, atol=1e-4, rtol=1e-4, msg=f"slot {j}")


def test_dflash_settings_refused_and_export_round_trip(tmp_path):
    from specforge_lite.compose import load_config
    from specforge_lite.settings import check_settings
    from specforge_lite.export import export_draft, load_export
    from specforge_lite.export.check import check_export
    from specforge_lite.formats import ExportRefused
    from specforge_lite.export.for_target import draft_from_weights

    with pytest.raises(ValueError, match="does not take draft.use_aux_norm"):
        check_settings(load_config(["draft=dflash", "draft.use_aux_norm=true", "tracker=none"]))
    with pytest.raises(ValueError, match="draft.block_size=3 proposes 2 tokens per block but is served with "
                                         "eval.num_draft_tokens=3: .* set draft.block_size=4 for k=3"):
        check_settings(load_config(["draft=dflash", "draft.block_size=3", "tracker=none"]))
    check_settings(load_config(["draft=dflash", "tracker=none"]))  # (its default block: the next token and k=3 masks)
    target = tiny_target(aux_ids=[2, 4, 6])
    draft = tiny_block_draft(target)
    out = export_draft(draft.trainable_state_dict(), draft.spec, "vllm", tmp_path / "v", num_speculative_tokens=3)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [1, 3, 5]}  # output-of-layer ids
    assert "eagle_config" not in cfg and "causal" not in cfg["dflash_config"]
    report = check_export(out)
    assert report.ok, report.text()
    assert any("layer 0's k_norm" in w for w in report.warnings)  # two layers: vLLM CPU's kernel
    spec, weights = load_export(out)
    back = draft_from_weights(spec, weights, target)
    ids = torch.randint(0, target.vocab_size, (1, 8))
    aux = target.capture(ids).aux
    proposals = [DFlashContext(d).propose(aux, ids[0].tolist(), 5, 3) for d in (draft, back)]
    assert proposals[0] == proposals[1]
    for fmt in ("sglang", "speculators"):
        with pytest.raises(ExportRefused, match="export.format=vllm"):
            export_draft(draft.trainable_state_dict(), draft.spec, fmt, tmp_path / fmt)
    cfg["dflash_config"]["causal"] = True
    (out / "config.json").write_text(json.dumps(cfg))
    assert any("runs the block causally" in w for w in check_export(out).warnings)


def test_the_block_size_is_recorded_and_every_tool_that_takes_a_k_refuses_another(tmp_path):
    """A DFlash block (the next token and k mask slots) is the draft's input: its size is in the spec and the
    export, and evaluation, the served check and the ranking refuse a k the draft was not trained for, with
    the reason, before anything is loaded or served."""
    from specforge_lite.compose import load_config
    from specforge_lite.evaluate.acceptance import evaluate_export
    from specforge_lite.evaluate.served import serve
    from specforge_lite.export import check_draft_tokens, export_draft

    target = tiny_target(aux_ids=[2, 4, 6])
    vocab = tiny_vocab(target, target.vocab_size)
    spec = draft_spec(target.config, METHODS["dflash"].settings(mask_token_id=MASK, block_size=4),
                      target.aux_layer_ids, target.convention, target.vocab_size, vocab.size,
                      target.hidden_size)
    assert spec.block_size == 4
    draft = DFlashDraft(spec)
    run = tmp_path / "run"
    out = export_draft(draft.trainable_state_dict(), spec, "vllm", run / "final", num_speculative_tokens=5)
    config = json.loads((out / "config.json").read_text())
    assert config["block_size"] == 4 and config["specforge_lite"]["spec"]["block_size"] == 4  # not the 5 asked
    check_draft_tokens(out, 3)
    with pytest.raises(ValueError, match="trained to propose k=3 tokens per block.*at k=3"):
        check_draft_tokens(out, 5)
    with pytest.raises(ValueError, match="propose k=3 tokens per block"):
        evaluate_export(load_config(["tracker=none", "eval.num_draft_tokens=5"]), None, None, None, out)
    (run / "eval_inputs.json").write_text(json.dumps({"num_draft_tokens": 5}))
    with pytest.raises(ValueError, match="propose k=3 tokens per block"):
        serve([run])  # (no serving environment needed: refused first)
    with pytest.raises(ValueError, match="propose k=3 tokens per block"):
        serve([run], k=2)
