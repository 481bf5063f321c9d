"""The TTT unroll against a naive reference: one position and one step at a time, explicit key lists."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import EAGLE31, tiny_draft, tiny_target
from specforge_lite.draft.objective import UnrollInputs
from specforge_lite.methods.eagle3.objective import TTTObjective
from specforge_lite.methods.eagle3.ttt import TTTCache
from specforge_lite.methods.eagle3.drafting import DraftContext, draft_chain


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
        normed = rms(hidden, layer.hidden_norm.weight, s.rms_norm_eps)
        residual = normed if s.norm_before_residual else hidden  # (vLLM's llama_eagle3, speculators' Eagle3)
        x = torch.cat([rms(emb, layer.input_layernorm.weight, s.rms_norm_eps), normed], -1)
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
            h = o @ attn.o_proj.weight.T + residual[t]
            m = layer.mlp
            z = rms(h, layer.post_attention_layernorm.weight, s.rms_norm_eps)
            h = (F.silu(z @ m.gate_proj.weight.T) * (z @ m.up_proj.weight.T)) @ m.down_proj.weight.T + h
            new_hidden.append(h)
        hidden = torch.stack(new_hidden)
        outs.append(hidden)
    return outs


def vectorised_unroll(draft, aux, input_ids, steps):
    from specforge_lite.draft.objective import shift_left

    T = input_ids.shape[1]
    hidden, cache, outs = draft.project_aux(aux), TTTCache(), []
    for k in range(steps):
        hidden = draft.step(shift_left(input_ids, 1 + k), hidden, torch.arange(T)[None] + k, cache)
        outs.append(hidden[0])
    return outs


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_ttt_unroll_matches_naive_reference(norm_before_residual):
    target = tiny_target()
    draft = tiny_draft(target, use_aux_norm=False, norm_before_residual=norm_before_residual)
    with torch.no_grad():  # a hidden_norm weight away from 1, so that where the residual is taken shows
        draft.midlayer.hidden_norm.weight.uniform_(0.5, 1.5)
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
        proposals = draft_chain(DraftContext(draft), aux, context, nxt, k=3)
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
    out = TTTObjective(ttt_length=3, decay=0.8).unroll(draft, UnrollInputs(aux, ids, teacher, in_vocab, loss_mask))
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
    from specforge_lite.draft.objective import shift_left

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


def _naive_ttt_attention(q, keys, values, q_offset, scale, segments):
    """One query at a time over an explicit list of the keys it sees: the step-0 keys at rows <= its own
    (in its own conversation), then its own row's key of every later step."""
    B, h, Tq, _ = q.shape
    groups = h // keys[0].shape[1]
    out = []
    for b in range(B):
        heads = []
        for head in range(h):
            kv = head // groups
            rows = []
            for i in range(Tq):
                r = q_offset + i
                seen = [j for j in range(r + 1) if segments is None or segments[b, j] == segments[b, r]]
                ks = [keys[0][b, kv, j] for j in seen] + [k[b, kv, i] for k in keys[1:]]
                vs = [values[0][b, kv, j] for j in seen] + [v[b, kv, i] for v in values[1:]]
                p = torch.softmax(torch.stack([q[b, head, i] @ k for k in ks]) * scale, dim=0)
                rows.append(sum(w * v for w, v in zip(p, vs)))
            heads.append(torch.stack(rows))
        out.append(torch.stack(heads))
    return torch.stack(out)


def test_blockwise_ttt_attention_equals_the_naive_one_with_gradients(monkeypatch):
    """The blockwise attention (query blocks, log-sum-exp merge of the same-row keys, recomputing backward)
    against a naive per-query softmax written here: outputs and the gradients of q and every key and value,
    over several query blocks, grouped-query heads, packed rows and a query offset. Tolerance 1e-5 (fp32:
    only the order of the sums differs). The dense and SDPA implementations are held to the same reference."""
    from specforge_lite.draft import attention

    monkeypatch.setattr(attention, "QUERY_BLOCK", 3)  # T=10: four blocks, the last one short
    g = torch.Generator().manual_seed(0)
    B, h, kvh, T, d, steps = 2, 4, 2, 10, 8, 3
    segments = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 3, 3, 3], [1] * 10])
    for packed, q_offset in ((False, 0), (True, 0), (True, 6)):
        Tq = T - q_offset
        leaves = [torch.randn(B, h, Tq, d, generator=g)]
        leaves += [torch.randn(B, kvh, T if s == 0 else Tq, d, generator=g) for s in range(steps) for _ in "kv"]
        results = []
        for impl in ("naive", "blockwise", "dense", "sdpa"):
            xs = [x.clone().requires_grad_() for x in leaves]
            q, keys, values = xs[0], xs[1::2], xs[2::2]
            seg = segments if packed else None
            if impl == "naive":
                out = _naive_ttt_attention(q, keys, values, q_offset, 0.3, seg)
            else:
                cache = TTTCache(seg, attention=impl)
                for k, v in zip(keys, values):
                    cache.append(k, v)
                out = cache.attend(q, q_offset, 0.3)
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            results.append([out.detach()] + [x.grad for x in xs])
        for impl, got in zip(("blockwise", "dense", "sdpa"), results[1:]):
            for i, (a, b) in enumerate(zip(got, results[0])):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{impl} tensor {i}: {m}")


def test_the_same_row_merge_runs_as_many_kernels_at_the_seventh_unroll_step_as_at_the_third():
    """The same-row keys of every later step are merged in a few batched products, forward and backward: on a GPU
    each eager op is a kernel and a pass over the queries, and an op per step and key made the merge of a TTT-7
    unroll 21 of them at every layer (15 ms of an 8k row's step at Llama-3-8B's shape on an H200)."""
    g = torch.Generator().manual_seed(0)
    counts = {}
    for steps in (3, 7):  # (from the third: a single same-row key needs no reordering of its gradient)
        leaves = [torch.randn(1, 4, 12, 8, generator=g)] + [torch.randn(1, 2, 12, 8, generator=g) for _ in
                                                             range(2 * steps)]
        xs = [x.requires_grad_() for x in leaves]
        cache = TTTCache(attention="blockwise")
        for k, v in zip(xs[1::2], xs[2::2]):
            cache.append(k, v)
        with _Dispatched() as seen:
            cache.attend(xs[0], 0, 0.3).sum().backward()
        counts[steps] = len(seen.kernels())
    assert counts[7] == counts[3], counts


def test_grouped_query_heads_share_their_keys_without_a_copy_kept_for_the_backward():
    """Four query heads per key head (Llama-3-8B's 32 / 8): the blockwise TTT attention keeps for its backward
    no copy of the keys or values per query head, only what it was given (queries, keys, values), its step-0
    output and per-row scalars. A copy per query head would add (h / kv - 1) times the keys and values of every
    step, at every layer and unroll step, until the backward: the largest per-token term of a long row's peak."""
    B, h, kvh, T, d, steps = 1, 8, 2, 64, 32, 3
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, h, T, d, generator=g, requires_grad=True)
    kv = [torch.randn(B, kvh, T, d, generator=g, requires_grad=True) for _ in range(2 * steps)]
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cache = TTTCache(attention="blockwise")
        for k, v in zip(kv[::2], kv[1::2]):
            cache.append(k, v)
        out = cache.attend(q, 0, d ** -0.5)
    given = q.numel() * 4 + sum(x.numel() * 4 for x in kv)
    step0_output = q.numel() * 4
    per_row_scalars = B * h * T * 4 * 4 * (steps + 2)  # log-sum-exp, same-row scores, weights (fp32 and copies)
    assert sum(saved.values()) <= given + step0_output + per_row_scalars, (sum(saved.values()), given)
    out.sum().backward()


def _is_view(func) -> bool:
    """Whether an aten op returns a view of an input (a reshape, a transpose, detach): no kernel of its own."""
    alias = func._schema.returns[0].alias_info if func._schema.returns else None
    return alias is not None and not alias.is_write


class _Dispatched(TorchDispatchMode):
    """Every aten op run inside it: the op, its tensor arguments' dtypes, its output's dtype and shape."""

    Op = collections.namedtuple("Op", "op dtypes out_dtype out_shape view")
    PRODUCTS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_, torch.ops.aten.bmm)

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(self.Op(func.overloadpacket, [a.dtype for a in args if isinstance(a, torch.Tensor)],
                                getattr(out, "dtype", None), tuple(getattr(out, "shape", ())), _is_view(func)))
        return out

    def kernels(self) -> list:
        """The ops that run a kernel (on a GPU, a launch and a pass over memory): all but views of their input."""
        return [o for o in self.ops if not o.view]

    def products(self) -> list:
        """The dtype each matrix product ran in (its last operand's: the one an fp32 accumulation keeps)."""
        return [o.dtypes[-1] for o in self.ops if o.op in self.PRODUCTS]


def test_under_autocast_the_blockwise_attention_backward_runs_its_products_in_bf16(monkeypatch):
    """Under bf16 autocast (trainer.precision=bf16) the blockwise attention's forward products run in bf16, and
    its backward's must too, as FlashAttention's do: outside autocast (a backward is) they ran in fp32, which a
    GPU runs at a fraction of bf16's rate. Gradients stay within bf16's tolerance of the fp32 computation."""
    from specforge_lite.draft import attention

    monkeypatch.setattr(attention, "QUERY_BLOCK", 4)
    g = torch.Generator().manual_seed(1)
    leaves = [torch.randn(1, 2, 10, 16, generator=g) for _ in "qkv"]
    weights = torch.linspace(-1, 1, 1 * 2 * 10 * 16).view(1, 2, 10, 16)
    grads = {}
    for autocast in (False, True):
        q, k, v = (x.clone().requires_grad_() for x in leaves)
        with _Dispatched() as seen:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out, lse = attention.causal_attention_lse(q, k, v, 0.25)
            ((out.float() * weights).sum() + lse.sum()).backward()
        grads[autocast] = [x.grad for x in (q, k, v)]
        if autocast:
            assert seen.products() and set(seen.products()) == {torch.bfloat16}, seen.products()
    for got, want in zip(grads[True], grads[False]):
        assert float((got - want).abs().max()) <= 3e-2 * float(want.abs().max())


def test_under_autocast_every_product_of_a_whole_unroll_runs_in_bf16():
    """trainer.precision=bf16 (fp32 master weights under bf16 autocast): every matrix product of an unroll, forward
    and backward, runs in bf16 in every attention way, with checkpointed steps and with either loss in chunks, for
    EAGLE3 and a two-layer EAGLE 3.1 draft. A product left in fp32 (a custom backward runs outside autocast; an
    in-place accumulation is not autocast) runs on a GPU at a fraction of bf16's rate."""
    target, V = tiny_target(), 64
    inputs = _packed_rows(target, V)
    for draft in (tiny_draft(target, draft_vocab_size=V), tiny_draft(target, draft_vocab_size=V, **EAGLE31)):
        for options in ({}, {"attention": "dense"}, {"attention": "sdpa"},
                        {"checkpointing": True, "loss_chunk_rows": 5}, {"loss": "acceptance", "loss_chunk_rows": 4}):
            with _Dispatched() as seen:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = TTTObjective(ttt_length=3, **options).unroll(draft, inputs)
                out.loss.backward()
            draft.zero_grad()
            fp32 = [o for o in seen.ops if o.op in _Dispatched.PRODUCTS and torch.float32 in o.dtypes]
            assert seen.products() and not fp32, (options, fp32)


def test_under_autocast_each_draft_step_computes_what_its_bf16_weights_compute_as_a_server_holds_them():
    """trainer.precision=bf16 trains fp32 master weights under bf16 autocast; a server runs the export's weights in
    bf16. Every unroll step under autocast gives exactly the state and keys of the same draft with its weights cast
    to bf16, run without autocast (RMSNorm in fp32, cast back, times the bf16 weight: vLLM's order), for EAGLE3
    and a two-layer EAGLE 3.1, whose fed-back state is its final norm's output. The residual stream, the state fed
    forward and the keys stay in bf16: an fp32 norm weight times bf16 rows would promote them all to fp32 (twice
    the memory and traffic, and numbers a server does not compute)."""
    from specforge_lite.draft.objective import shift_left

    target = tiny_target()
    ids = torch.randint(0, target.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    aux = [a.bfloat16() for a in target.capture(ids).aux]  # (a bf16 target's states)
    positions = torch.arange(12).expand(2, 12)

    def unrolled(model, autocast: bool):
        cache = TTTCache()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            hidden, states = model.project_aux(aux), []
            for k in range(3):
                hidden = model.step(shift_left(ids, 1 + k), hidden, positions + k, cache)
                states.append(hidden)
            states.append(model.norm(hidden))  # (what the lm_head reads)
        return states + cache.keys + cache.values

    for options in ({}, EAGLE31):
        draft = tiny_draft(target, draft_vocab_size=64, **options)
        served = copy.deepcopy(draft)
        for p in served.parameters():
            p.data = p.data.bfloat16()
        served.set_embedding(draft.embedding_weight.bfloat16())
        for got, want in zip(unrolled(draft, autocast=True), unrolled(served, autocast=False), strict=True):
            assert got.dtype == want.dtype == torch.bfloat16, (options, got.dtype)
            assert torch.equal(got, want), (options, float((got.float() - want.float()).abs().max()))


def test_flex_ttt_attention_equals_the_naive_one_and_its_block_mask_covers_the_pattern(monkeypatch):
    """draft.ttt_attention=flex (the step-0 attention through flex attention, CUDA's way) against the naive
    per-query softmax: outputs over grouped-query heads, packed rows and a query offset (CPU runs flex
    attention's eager reference, which reads only the element mask, and has no backward: the compiled kernel's
    gradients are checked against the blockwise way on a GPU by ``bench gpu_scale``). The block structure
    the kernel skips by is checked on its own against the element pattern written here: every block holding a
    visible key is listed, and every block listed as full holds only visible keys."""
    import warnings

    from specforge_lite.draft import attention

    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    monkeypatch.setattr(attention, "FLEX_BLOCK", 3)  # T=10: four blocks, the last one short
    g = torch.Generator().manual_seed(0)
    B, h, kvh, T, d, steps = 2, 4, 2, 10, 8, 3
    segments = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 3, 3, 3], [1] * 10])
    for packed, q_offset in ((False, 0), (True, 0), (True, 6), (False, 4)):
        Tq, seg = T - q_offset, segments if packed else None
        q = torch.randn(B, h, Tq, d, generator=g)
        keys = [torch.randn(B, kvh, T if s == 0 else Tq, d, generator=g) for s in range(steps)]
        values = [torch.randn_like(k) for k in keys]
        cache, blockwise = TTTCache(seg, attention="flex"), TTTCache(seg, attention="blockwise")
        for k, v in zip(keys, values):  # each unroll step (one block mask, made at the first)
            cache.append(k, v)
            blockwise.append(k, v)
            got = cache.attend(q, q_offset, 0.3)
            torch.testing.assert_close(got, blockwise.attend(q, q_offset, 0.3), atol=1e-5, rtol=1e-5)
        want = _naive_ttt_attention(q, keys, values, q_offset, 0.3, seg)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        rows = torch.arange(Tq)[:, None] + q_offset
        seen = (torch.arange(T)[None, :] <= rows).expand(B, Tq, T)
        if packed:
            seen = seen & (segments[:, rows[:, 0], None] == segments[:, None, :])
        blocks = attention.causal_block_mask(Tq, T, q_offset, seg, torch.device("cpu"))
        listed = blocks.to_dense()[:, 0].bool().expand(B, -1, -1)  # [B, nq, nk]: partial or full (B 1: every row)
        full = torch.zeros_like(listed)
        n_full, idx_full = (t[:, 0].expand(B, *t.shape[2:])
                            for t in (blocks.full_kv_num_blocks, blocks.full_kv_indices))
        for b in range(B):
            for i in range(listed.shape[1]):
                full[b, i, idx_full[b, i, : n_full[b, i]].long()] = True
        for b in range(B):
            for i in range(listed.shape[1]):
                for j in range(listed.shape[2]):
                    cell = seen[b, 3 * i : 3 * i + 3, 3 * j : 3 * j + 3]
                    assert listed[b, i, j] or not cell.any(), (packed, q_offset, b, i, j)
                    assert not full[b, i, j] or (cell.all() and cell.shape[1] == 3), (packed, q_offset, b, i, j)


def test_checkpointed_steps_and_chunked_loss_give_the_same_loss_and_gradients():
    """draft.checkpointing (each step recomputed in backward, the key cache cut back for it) and
    draft.loss_chunk_rows (lm_head + loss in row chunks: fused for soft_ce, recomputed for the acceptance
    loss) and draft.ttt_attention=dense change memory, not results: the same loss, step statistics and
    gradients as the plain unroll (tolerance 1e-5 of each gradient's largest entry), on packed rows, for
    both losses; and for an EAGLE 3.1 draft of two layers (each layer's key cache cut back)."""
    target = tiny_target()
    for draft in (tiny_draft(target, draft_vocab_size=target.vocab_size),
                  tiny_draft(target, draft_vocab_size=target.vocab_size, **EAGLE31)):
        _same_results_whatever_the_memory_options(target, draft)


def test_loss_chunks_left_null_are_4096_rows_on_a_gpu_and_512_elsewhere():
    """draft.loss_chunk_rows=null (the default): 4096 rows per chunk on CUDA (each chunk adds the whole lm_head
    weight gradient once more), 512 on a CPU; a number is taken as it is, 0 for all rows at once. (A CUDA tensor
    made by fake tensors: no GPU needed.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from specforge_lite.draft.objective import chunk_size

    with FakeTensorMode():
        on_gpu = torch.empty(10000, 8, device="cuda")
    on_cpu = torch.empty(10000, 8)
    assert (chunk_size(None, on_gpu), chunk_size(None, on_cpu)) == (4096, 512)
    assert (chunk_size(7, on_gpu), chunk_size(0, on_cpu)) == (7, 10000)


def _packed_rows(target, draft_vocab_size: int) -> UnrollInputs:
    """Two rows of 12 tokens, the first packing two conversations, random teacher and masks (seeded)."""
    g = torch.Generator().manual_seed(1)
    B, T = 2, 12
    ids = torch.randint(0, target.vocab_size, (B, T), generator=g)
    positions = torch.tensor([list(range(7)) + list(range(5)), list(range(12))])
    return UnrollInputs(target.capture(ids).aux, ids, torch.randn(B, T, draft_vocab_size, generator=g),
                        torch.rand(B, T, generator=g) > 0.2, (torch.rand(B, T, generator=g) > 0.3).long(), positions)


def test_the_host_waits_for_the_device_only_before_the_unrolls_first_product():
    """Which rows each unroll step scores is found for every step before the draft's first kernel: finding them
    makes the host wait for the device (a nonzero's count, a tensor read on the host), and a wait inside the
    unroll would let a GPU idle while the host queues the next kernels (7 waits in a TTT-7 unroll before)."""
    target, V = tiny_target(), 64
    draft = tiny_draft(target, draft_vocab_size=V)
    inputs = _packed_rows(target, V)
    waits = {torch.ops.aten.nonzero, torch.ops.aten._local_scalar_dense, torch.ops.aten.item}
    for options in ({}, {"checkpointing": True}):
        with _Dispatched() as seen:
            TTTObjective(ttt_length=7, **options).unroll(draft, inputs).loss.backward()
        ops = [o.op for o in seen.ops]
        first_product = next(i for i, op in enumerate(ops) if op in _Dispatched.PRODUCTS)
        assert [op for op in ops[first_product:] if op in waits] == [], options


def _same_results_whatever_the_memory_options(target, draft):
    inputs = _packed_rows(target, draft.spec.draft_vocab_size)

    def run(**options):
        draft.zero_grad()
        out = TTTObjective(ttt_length=3, **options).unroll(draft, inputs)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}

    for loss, chunks in (("soft_ce", 5), ("acceptance", 4)):  # fused chunks; checkpointed chunks
        ref, ref_grads = run(loss=loss)
        for options in ({"checkpointing": True}, {"loss_chunk_rows": chunks}, {"attention": "dense"},
                        {"checkpointing": True, "loss_chunk_rows": chunks}):
            out, grads = run(loss=loss, **options)
            assert torch.allclose(out.loss, ref.loss, rtol=1e-5, atol=1e-6), options
            counts = [(int(s.correct), int(s.valid)) for s in out.steps]
            assert counts == [(int(s.correct), int(s.valid)) for s in ref.steps]
            for name, grad in ref_grads.items():
                gap = float((grads[name] - grad).abs().max()) / float(grad.abs().max())
                assert gap <= 1e-5, (options, name, gap)  # of the gradient's largest entry: fp32 summation order


def test_fused_head_loss_equals_logits_then_log_softmax_with_gradients():
    """draft/head_loss.py (lm_head + soft cross-entropy in row chunks, gradients made in the forward)
    against the plain autograd computation: the weighted total, each row's loss and argmax agreement, and
    the gradients of the rows and the weight (fp32: 1e-5 relative; bf16 weights and rows: 2e-2 of the
    largest entry, the reference's own bf16 rounding), for one chunk and for chunks that do not divide the
    rows, and with the weight frozen."""
    from specforge_lite.draft.head_loss import head_soft_cross_entropy

    g = torch.Generator().manual_seed(3)
    N, H, V, R = 11, 16, 40, 30
    teacher = torch.randn(R, V, generator=g) * 3
    rows = torch.randint(0, R, (N,), generator=g)
    top = teacher[rows].argmax(-1)
    top[::3] = torch.randint(0, V, (len(top[::3]),), generator=g)  # some rows disagree with the teacher
    weights = torch.rand(N, generator=g)
    h0, w0 = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        h_ref, w_ref = h0.to(dtype).clone().requires_grad_(), w0.to(dtype).clone().requires_grad_()
        logits = (h_ref @ w_ref.t()).float()
        ref_rows = -(torch.softmax(teacher[rows].float(), -1) * torch.log_softmax(logits, -1)).sum(-1)
        (2.5 * (ref_rows * weights).sum()).backward()
        for chunk_rows, frozen in ((0, False), (4, False), (5, True)):
            h, w = h0.to(dtype).clone().requires_grad_(), w0.to(dtype).clone().requires_grad_(not frozen)
            total, row_loss, row_correct = head_soft_cross_entropy(h, w, teacher, rows, top, weights, chunk_rows)
            (2.5 * total).backward()
            torch.testing.assert_close(total, (ref_rows * weights).sum().detach(), rtol=tol, atol=tol)
            torch.testing.assert_close(row_loss, ref_rows.detach(), rtol=tol, atol=tol)
            assert torch.equal(row_correct, logits.argmax(-1) == top)
            assert (w.grad is None) == frozen
            for got, want in ((h.grad, h_ref.grad), (None if frozen else w.grad, w_ref.grad)):
                if got is not None:
                    gap = float((got.float() - want.float()).abs().max()) / float(want.float().abs().max())
                    assert gap <= tol, (dtype, chunk_rows, gap)


def test_under_autocast_every_product_of_the_fused_head_loss_runs_in_bf16():
    """trainer.precision=bf16 keeps fp32 master weights under bf16 autocast. The lm_head's weight gradient is
    the largest product of a step ([draft vocab, rows] x [rows, hidden]); accumulated in place over the chunks
    it ran in fp32 (addmm_ is not autocast), 40% of a GPU step at Llama-3-8B's shape. Every matrix product of
    the fused head + loss must run in bf16 there, as nn.Linear's own weight gradient does."""
    from specforge_lite.draft.head_loss import head_soft_cross_entropy

    g = torch.Generator().manual_seed(5)
    h = torch.randn(10, 16, generator=g, requires_grad=True)
    w = torch.randn(40, 16, generator=g, requires_grad=True)  # fp32 master weight
    teacher, rows = torch.randn(12, 40, generator=g), torch.randint(0, 12, (10,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16), _Dispatched() as seen:
        total, _, _ = head_soft_cross_entropy(h, w, teacher, rows, teacher[rows].argmax(-1),
                                              torch.rand(10, generator=g), 4)
    total.backward()
    products = seen.products()
    assert len(products) == 9 and set(products) == {torch.bfloat16}, products  # 3 chunks x 3 products
    assert w.grad.dtype == torch.float32 and torch.isfinite(w.grad).all()
    # the master weight is cast to bf16 once per call: autocast caches the cast of a parameter but not of a view of
    # it (weight.t()), which cast all of it again in each chunk (a [32000, 4096] weight: 0.8 GB of traffic a chunk)
    casts = [o for o in seen.ops if o.op is torch.ops.aten._to_copy and o.dtypes[0] == torch.float32
             and o.out_dtype == torch.bfloat16 and o.out_shape in ((40, 16), (16, 40))]
    assert len(casts) == 1, casts


def test_the_fused_head_loss_does_no_gradient_work_under_no_grad(monkeypatch):
    """Held-out evaluation runs the objective under torch.no_grad: the fused lm_head + loss must then do its
    logits' matmul only, not the row and weight gradients it makes in the forward when training (an autograd
    Function is told its inputs require grad even under no_grad); the values are the same."""
    from specforge_lite.draft import head_loss

    g = torch.Generator().manual_seed(4)
    h, w = torch.randn(9, 16, generator=g, requires_grad=True), torch.randn(40, 16, generator=g, requires_grad=True)
    teacher, rows = torch.randn(12, 40, generator=g), torch.randint(0, 12, (9,), generator=g)
    args = (teacher, rows, teacher[rows].argmax(-1), torch.rand(9, generator=g), 4)
    calls = []
    real_matmul = torch.matmul
    monkeypatch.setattr(head_loss.torch, "matmul", lambda *a: calls.append(1) or real_matmul(*a))
    trained = head_loss.head_soft_cross_entropy(h, w, *args)
    with_grad = len(calls)
    calls.clear()
    with torch.no_grad():
        evaluated = head_loss.head_soft_cross_entropy(h, w, *args)
    # 3 chunks: their logits only, against logits, row gradients and the first weight gradient (addmm_ after)
    assert len(calls) == 3 and with_grad == 7
    torch.testing.assert_close(evaluated[0], trained[0].detach())


def test_settings_no_run_can_use_are_refused_before_anything_is_built(tmp_path):
    """draft.ttt_length=0 once ended in 'stack expects a non-empty TensorList'; trainer.max_steps=-1 trained
    nothing, exited 0 and exported an untrained draft. Both are refused, naming the setting and the values it
    may take, before the run folder or the target exist; so is every other number out of its range (zero or
    negative batch sizes, accumulation steps, vocabulary size, a ratio past 1, a nan) and both aux-norm kinds
    at once."""
    import sys

    import pytest

    from conftest import ROOT
    from specforge_lite.compose import load_config

    sys.path.insert(0, str(ROOT))
    from specforge_lite.job import run

    for overrides, message in ((["draft.ttt_length=0"], r"draft.ttt_length=0: allowed \[1, inf\)"),
                               (["trainer.max_steps=-1"], r"trainer.max_steps=-1: allowed \[1, inf\)"),
                               (["draft.num_layers=0"], r"draft.num_layers=0: allowed \[1, inf\)"),
                               (["trainer.micro_batch_size=0", "trainer.grad_accum_steps=-2"],
                                r"trainer.micro_batch_size=0: allowed \[1, inf\); trainer.grad_accum_steps=-2"),
                               (["draft.draft_vocab_size=0"], r"draft.draft_vocab_size=0: allowed \[1, inf\)"),
                               (["trainer.warmup_ratio=1.5"], r"trainer.warmup_ratio=1.5: allowed \[0, 1\]"),
                               (["data.generation.top_p=0"], r"data.generation.top_p=0.0: allowed \(0, 1\]"),
                               (["trainer.lr=nan"], "trainer.lr=nan: allowed"),
                               (["draft.norm_before_fc=true", "draft.use_aux_norm=true"], "not both")):
        with pytest.raises(ValueError, match=message):
            run(load_config(["model=llama3_tiny", "tracker=none", *overrides]), tmp_path / "run", log=lambda m: None)
        assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="ttt_length=0"):
        TTTObjective(ttt_length=0)


# ---- P-EAGLE (parallel drafting) --------------------------------------------------------------------------
def naive_parallel_forward(draft, aux, input_ids, t, depth):
    """The pre-norm state of the last slot of the one forward a server runs for a parallel draft after row
    t (written out here, as vLLM lays it out): rows 0..t read (x[j+1], fused aux h[j]), then ``depth`` mask
    slots read (mask token, mask_hidden fused through the same norms and fc), every position attending
    causally over the whole sequence; positions 0..t+depth."""
    s, layer, attn = draft.spec, draft.midlayer, draft.midlayer.self_attn
    theta, eps, n_aux = s.rope_parameters["rope_theta"], s.rms_norm_eps, len(aux)

    def fuse(parts):  # [n, H_t] x n_aux -> [n, H]
        if s.norm_before_fc:
            return rms(torch.cat(parts, -1), draft.input_norm.weight, eps) @ draft.fc.weight.T
        return torch.cat(parts, -1) @ draft.fc.weight.T

    context = fuse([a[0, : t + 1] for a in aux])
    mask_state = fuse(list(draft.mask_hidden.reshape(n_aux, -1)[:, None]))  # [1, H]
    hidden = torch.cat([context, mask_state.expand(depth, -1)])
    tokens = [int(input_ids[0, j + 1]) for j in range(t + 1)] + [s.mask_token_id] * depth
    emb = draft.embedding_weight[tokens]
    x = torch.cat([rms(emb, layer.input_layernorm.weight, eps), rms(hidden, layer.hidden_norm.weight, eps)], -1)
    n, group = len(tokens), s.num_attention_heads // s.num_key_value_heads
    q = torch.stack([rope(v, p, theta) for p, v in enumerate((x @ attn.q_proj.weight.T).view(n, -1, s.head_dim))])
    k = torch.stack([rope(v, p, theta) for p, v in enumerate((x @ attn.k_proj.weight.T).view(n, -1, s.head_dim))])
    v = (x @ attn.v_proj.weight.T).view(n, -1, s.head_dim)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    w = torch.softmax((q[-1][None] * k).sum(-1) / s.head_dim ** 0.5, dim=0)  # the last slot sees every position
    h = (w[..., None] * v).sum(0).reshape(-1) @ attn.o_proj.weight.T + hidden[-1]
    m, z = layer.mlp, rms(h, layer.post_attention_layernorm.weight, eps)
    return (F.silu(z @ m.gate_proj.weight.T) * (z @ m.up_proj.weight.T)) @ m.down_proj.weight.T + h


def test_parallel_draft_unroll_is_the_servers_one_forward_over_mask_slots():
    """P-EAGLE: the objective's unroll step d at row t equals the server's single causal forward over the
    context and d mask slots; the loss is the soft cross-entropy of those states (decay**d, mean per step).
    Fails when a mask slot reads the previous step's token or state (plain EAGLE3)."""
    from specforge_lite.draft.objective import shift_left

    target = tiny_target()
    for options in ({}, {"norm_before_fc": True}):
        draft = tiny_draft(target, draft_vocab_size=target.vocab_size, parallel_drafting=True, mask_token_id=7,
                           **options)
        B, T, steps = 1, 9, 3
        ids = torch.randint(0, target.vocab_size, (B, T))
        aux = target.capture(ids).aux
        teacher = torch.randn(B, T, draft.spec.draft_vocab_size)
        loss_mask = torch.ones(B, T, dtype=torch.long)
        in_vocab = torch.ones(B, T, dtype=torch.bool)
        out = TTTObjective(ttt_length=steps, decay=0.8).unroll(draft, UnrollInputs(aux, ids, teacher, in_vocab,
                                                                                     loss_mask))
        with torch.no_grad():
            state, cache, got = draft.project_aux(aux), TTTCache(), []
            for k in range(steps):
                step_ids = shift_left(ids, 1 + k)
                if k:
                    step_ids, state = draft.next_step_inputs(step_ids, state)
                state = draft.step(step_ids, state, torch.arange(T)[None] + k, cache)
                got.append(state[0])
            expected_total = 0.0
            for k in range(steps):
                losses = []
                for t in range(T - 2 - k):  # rows whose predicted token x[t+2+k] exists
                    ref = naive_parallel_forward(draft, aux, ids, t, k)
                    torch.testing.assert_close(got[k][t], ref, atol=2e-5, rtol=1e-4, msg=f"step {k}, row {t}")
                    p = torch.softmax(teacher[0, t + 1 + k], -1)
                    losses.append(float(-(p * torch.log_softmax(draft.compute_logits(ref), -1)).sum()))
                expected_total += 0.8 ** k * sum(losses) / len(losses)
        assert abs(float(out.loss.detach()) - expected_total) < 1e-4 * max(1.0, expected_total)
        out.loss.backward()
        assert draft.mask_hidden.grad is not None and float(draft.mask_hidden.grad.abs().sum()) > 0
