"""The TTT unroll against a naive reference: one position and one step at a time, explicit key lists."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conftest import tiny_draft, tiny_target
from specforge_lite.draft.objective import Eagle3Objective, UnrollInputs
from specforge_lite.draft.ttt import TTTCache
from specforge_lite.evaluate.spec_decode import draft_chain


def rope(x, pos, theta):
    """Rotate-half RoPE for one vector [h, d] at integer position ``pos`` (written out here)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()]).float(), torch.cat([ang.sin(), ang.sin()]).float()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def naive_unroll(draft, aux, input_ids, steps):
    """Pre-norm outputs per step [steps][T, H] for batch row 0, computed position by position."""
    s, layer, attn = draft.spec, draft.midlayer, draft.midlayer.self_attn
    theta = s.rope_parameters["rope_theta"]
    T = input_ids.shape[1]
    hidden = draft.fc(torch.cat([a[0] for a in aux], -1))  # [T, H]
    keys, values, outs = [], [], []  # keys[k][t]: [kv_heads, d]
    for k in range(steps):
        tokens = [int(input_ids[0, t + 1 + k]) if t + 1 + k < T else 0 for t in range(T)]
        emb = draft.embedding_weight[tokens]
        x = torch.cat([rms(emb, layer.input_layernorm.weight, s.rms_norm_eps),
                       rms(hidden, layer.hidden_norm.weight, s.rms_norm_eps)], -1)
        q = (x @ attn.q_proj.weight.T).view(T, s.num_attention_heads, s.head_dim)
        kk = (x @ attn.k_proj.weight.T).view(T, s.num_key_value_heads, s.head_dim)
        vv = (x @ attn.v_proj.weight.T).view(T, s.num_key_value_heads, s.head_dim)
        keys.append([rope(kk[t], t + k, theta) for t in range(T)])
        values.append([vv[t] for t in range(T)])
        group = s.num_attention_heads // s.num_key_value_heads
        new_hidden = []
        for t in range(T):
            qt = rope(q[t], t + k, theta)
            # step-0 keys of positions <= t, then the same-position keys of steps 1..k
            ks = [keys[0][j] for j in range(t + 1)] + [keys[j][t] for j in range(1, k + 1)]
            vs = [values[0][j] for j in range(t + 1)] + [values[j][t] for j in range(1, k + 1)]
            K = torch.stack(ks).repeat_interleave(group, dim=1)  # [n, h, d]
            V = torch.stack(vs).repeat_interleave(group, dim=1)
            w = torch.softmax((K * qt).sum(-1) / s.head_dim ** 0.5, dim=0)  # [n, h]
            o = (w[..., None] * V).sum(0).reshape(-1)
            h = o @ attn.o_proj.weight.T + hidden[t]
            m = layer.mlp
            z = rms(h, layer.post_attention_layernorm.weight, s.rms_norm_eps)
            h = (F.silu(z @ m.gate_proj.weight.T) * (z @ m.up_proj.weight.T)) @ m.down_proj.weight.T + h
            new_hidden.append(h)
        hidden = torch.stack(new_hidden)
        outs.append(hidden)
    return outs


def vectorised_unroll(draft, aux, input_ids, steps):
    from specforge_lite.draft.ttt import shift_left

    T = input_ids.shape[1]
    hidden, cache, outs = draft.project_aux(aux), TTTCache(), []
    for k in range(steps):
        hidden = draft.step(shift_left(input_ids, 1 + k), hidden, torch.arange(T)[None] + k, cache)
        outs.append(hidden[0])
    return outs


def test_ttt_unroll_matches_naive_reference():
    target = tiny_target()
    draft = tiny_draft(target, use_aux_norm=False)
    ids = torch.randint(0, target.vocab_size, (1, 12))
    aux = target.capture(ids).aux
    with torch.no_grad():
        got = vectorised_unroll(draft, aux, ids, 4)
        ref = naive_unroll(draft, aux, ids, 4)
    for k, (g, r) in enumerate(zip(got, ref)):
        torch.testing.assert_close(g, r, atol=2e-5, rtol=1e-4, msg=f"step {k}")


def test_inference_chain_equals_training_unroll_at_the_last_row():
    """Drafting at serving time (one row, cache of step-0 keys) = the TTT unroll's last valid row."""
    target = tiny_target()
    draft = tiny_draft(target)
    ids = torch.randint(0, target.vocab_size, (1, 10))
    context, nxt = ids[0, :-1].tolist(), int(ids[0, -1])
    aux = target.capture(ids[:, :-1]).aux
    with torch.no_grad():
        proposals = draft_chain(draft, aux, context, nxt, k=3)
        # Training unroll over the same rows, feeding the draft's own proposals as the shifted tokens.
        seq = torch.tensor([context + [nxt] + proposals[:2]])
        n = len(context)
        hidden, cache = draft.project_aux(aux), TTTCache()
        expect = []
        for k in range(3):
            tokens = seq[:, 1 + k : 1 + k + n]
            hidden = draft.step(tokens, hidden, torch.arange(n)[None] + k, cache)
            expect.append(int(draft.draft_to_target(draft.compute_logits(hidden[0, -1]).argmax())))
    assert proposals == expect


def test_loss_alignment_and_normalisation():
    """Step k, row t: teacher row t+1+k, mask of the predicted token x[t+2+k], mean over valid rows."""
    target = tiny_target()
    draft = tiny_draft(target, draft_vocab_size=target.vocab_size)
    B, T, V = 2, 9, draft.spec.draft_vocab_size
    ids = torch.randint(0, target.vocab_size, (B, T))
    aux = target.capture(ids).aux
    teacher = torch.randn(B, T, V)
    in_vocab = torch.rand(B, T) > 0.2
    loss_mask = (torch.rand(B, T) > 0.3).long()
    out = Eagle3Objective(ttt_length=3, decay=0.8).unroll(draft, UnrollInputs(aux, ids, teacher, in_vocab, loss_mask))
    with torch.no_grad():  # the reference below reuses only the per-step outputs checked above
        per_step = vectorised_unroll_batched(draft, aux, ids, 3)
    expected_total = 0.0
    for k in range(3):
        num, den, correct = 0.0, 0, 0
        for b in range(B):
            for t in range(T):
                if t + 2 + k >= T or not loss_mask[b, t + 2 + k] or not in_vocab[b, t + 1 + k]:
                    continue
                logits = draft.compute_logits(per_step[k][b, t])
                p = torch.softmax(teacher[b, t + 1 + k], -1)
                num += float(-(p * torch.log_softmax(logits, -1)).sum().detach())
                den += 1
                correct += int(logits.argmax() == teacher[b, t + 1 + k].argmax())
        assert int(out.steps[k].valid) == den
        assert int(out.steps[k].correct) == correct
        expected_total += 0.8 ** k * num / max(den, 1)
    assert abs(float(out.loss.detach()) - expected_total) < 1e-3 * max(1.0, expected_total)


def vectorised_unroll_batched(draft, aux, ids, steps):
    from specforge_lite.draft.ttt import shift_left

    B, T = ids.shape
    hidden, cache, outs = draft.project_aux(aux), TTTCache(), []
    for k in range(steps):
        hidden = draft.step(shift_left(ids, 1 + k), hidden, torch.arange(T)[None].expand(B, T) + k, cache)
        outs.append(hidden)
    return outs


def test_aux_norm_adds_one_norm_per_aux_state():
    target = tiny_target()
    draft = tiny_draft(target, use_aux_norm=True)
    names = set(draft.trainable_state_dict())
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= names
    with torch.no_grad():
        draft.fc_norm[1].weight.mul_(3.0)
    ids = torch.randint(0, target.vocab_size, (1, 6))
    aux = target.capture(ids).aux
    scaled = [aux[0], aux[1] * 7.0, aux[2]]  # a per-aux RMSNorm removes each state's scale
    with torch.no_grad():
        base = draft.project_aux(aux)
        change_normed = (draft.project_aux(scaled) - base).norm() / base.norm()
        plain = draft.fc(torch.cat(aux, -1))
        change_plain = (draft.fc(torch.cat(scaled, -1)) - plain).norm() / plain.norm()
    assert change_normed < 0.01 < 0.5 < change_plain
