"""draft.compile: the step's elementwise chains (draft/fused.py) as torch.compile kernels, against transformers' own
modules and a plain autograd loss; a whole unroll compiled against the same unroll eager. CPU (Inductor's C++
kernels); on a GPU the same code compiles to Triton, measured by ``bench gpu_scale``'s ``+compile`` ways."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb

from conftest import EAGLE31, tiny_draft, tiny_target
from specforge_lite.draft import fused
from specforge_lite.draft.head_loss import head_soft_cross_entropy
from specforge_lite.draft.model import DraftMLP, DraftRMSNorm
from specforge_lite.methods.eagle3.objective import TTTObjective
from test_ttt import _packed_rows


def _gap(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)


def _grads(fn, *inputs):
    """fn's output and the gradients of a fixed random projection of it with respect to ``inputs``."""
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(5)
    sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs).backward()
    return outs, [x.grad for x in inputs]


@pytest.mark.parametrize("enabled", [False, True], ids=["eager", "compiled"])
def test_each_chain_equals_transformers_own_modules_with_gradients(enabled):
    """RMSNorm (fp32 rows; bf16 rows with the fp32 master weight, the draft's case under autocast, against a bf16
    model's norm, as a server holds it), rope and the MLP, eager and compiled, against transformers' LlamaRMSNorm,
    apply_rotary_pos_emb and LlamaMLP: outputs and input gradients in the reference's dtype, they and the weights'
    gradients within fp32 rounding (bf16 rows: within their own rounding)."""
    g = torch.Generator().manual_seed(0)
    H = 48
    ref_norm = LlamaRMSNorm(H, eps=1e-5)
    ours_norm = DraftRMSNorm(H, eps=1e-5)
    with torch.no_grad():
        ref_norm.weight.copy_(torch.rand(H, generator=g) + 0.5)
        ours_norm.weight.copy_(ref_norm.weight)
    served_norm = LlamaRMSNorm(H, eps=1e-5).to(torch.bfloat16)
    served_norm.load_state_dict(ref_norm.state_dict())
    config = LlamaConfig(hidden_size=H, intermediate_size=80, hidden_act="silu", num_attention_heads=4)
    torch.manual_seed(1)
    ref_mlp = LlamaMLP(config)
    ours_mlp = DraftMLP(config)
    ours_mlp.load_state_dict(ref_mlp.state_dict())
    q, k = torch.randn(2, 4, 9, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g)
    angles = torch.rand(2, 9, 8, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    cases = [("rms_norm fp32", ours_norm, ref_norm, (torch.randn(2, 9, H, generator=g) * 3,), 1e-5),
             ("rms_norm bf16 rows", ours_norm, served_norm, (torch.randn(2, 9, H, generator=g).bfloat16(),), 1e-2),
             ("mlp", ours_mlp, ref_mlp, (torch.randn(2, 9, H, generator=g),), 1e-5),
             ("rope", lambda a, b, c, s: fused.run(fused.rotary, a, b, c, s), apply_rotary_pos_emb,
              (q, k, cos, sin), 1e-5)]
    for name, ours, ref, inputs, tol in cases:
        modules = [m for m in (ours, ref) if isinstance(m, torch.nn.Module)]
        with fused.compiled(enabled):
            got, got_grads = _grads(ours, *inputs)
        want, want_grads = _grads(ref, *inputs)
        got_params = [p.grad for p in modules[0].parameters()] if modules else []
        want_params = [p.grad for p in modules[1].parameters()] if modules else []
        for m in modules:
            m.zero_grad(set_to_none=True)
        for a, b in zip([*got, *got_grads], [*want, *want_grads]):
            assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
        for a, b in zip([*got, *got_grads, *got_params], [*want, *want_grads, *want_params]):
            assert _gap(a, b) <= tol, (name, _gap(a, b))


def test_the_norm_keeps_for_its_backward_only_its_rows_and_one_scale_per_row():
    """bf16 rows and the fp32 master weight (the draft's norm under autocast): what the norm keeps until the
    backward is its rows (which the layer before holds anyway), its weight and one fp32 scale per row. Autograd
    through the ops of the chain keeps an fp32 copy of the rows and the scaled rows instead: three times the rows'
    bytes held per norm."""
    rows, H = 64, 256
    norm = DraftRMSNorm(H, eps=1e-5)
    x = torch.randn(rows, H).bfloat16().requires_grad_()
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = norm(x)
    assert sum(saved.values()) <= x.numel() * 2 + H * 4 + rows * 4, sum(saved.values())
    out.float().sum().backward()
    assert x.grad is not None and norm.weight.grad is not None


def test_the_compiled_loss_chunks_equal_a_plain_autograd_soft_cross_entropy():
    """The fused lm_head + soft cross-entropy with its chunk math compiled (fused.soft_ce_rows), in chunks that do
    not divide the rows and in one, against logits -> log_softmax -> autograd: total, rows' losses, argmax
    agreement and the gradients of rows and weight (fp32: 1e-5 of the largest entry)."""
    g = torch.Generator().manual_seed(3)
    N, H, V, R = 13, 16, 40, 30
    teacher = torch.randn(R, V, generator=g) * 3
    rows = torch.randint(0, R, (N,), generator=g)
    top = teacher[rows].argmax(-1)
    top[::3] = torch.randint(0, V, (len(top[::3]),), generator=g)
    weights = torch.rand(N, generator=g)
    h0, w0 = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    h_ref, w_ref = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    logits = h_ref @ w_ref.t()
    ref_rows = -(torch.softmax(teacher[rows], -1) * F.log_softmax(logits, -1)).sum(-1)
    (ref_rows * weights).sum().backward()
    for chunk_rows in (0, 5):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        with fused.compiled(True):
            total, row_loss, row_correct = head_soft_cross_entropy(h, w, teacher, rows, top, weights, chunk_rows)
        total.backward()
        torch.testing.assert_close(total, (ref_rows * weights).sum().detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(row_loss, ref_rows.detach(), rtol=1e-5, atol=1e-5)
        assert torch.equal(row_correct, logits.argmax(-1) == top)
        assert _gap(h.grad, h_ref.grad) <= 1e-5 and _gap(w.grad, w_ref.grad) <= 1e-5, chunk_rows


def test_a_compiled_unroll_gives_the_eager_unrolls_loss_and_gradients(monkeypatch):
    """draft.compile=true changes how the step runs, not what it computes: on packed rows, for EAGLE3 and a two-layer
    EAGLE 3.1 draft, with the loss in chunks, with checkpointed steps and with the acceptance loss's checkpointed
    chunks (a recomputation in backward runs compiled too, or it would not find the tensors the forward saved),
    the same loss, step statistics and gradients as the eager unroll (1e-5 of each gradient's largest entry); every
    chain of the step ran compiled."""
    monkeypatch.setattr(fused, "_compiled", {})
    target = tiny_target()
    for draft in (tiny_draft(target, draft_vocab_size=64), tiny_draft(target, draft_vocab_size=64, **EAGLE31)):
        inputs = _packed_rows(target, 64)

        def run(**options):
            draft.zero_grad()
            out = TTTObjective(ttt_length=3, loss_chunk_rows=7, **options).unroll(draft, inputs)
            out.loss.backward()
            return out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}

        for options in ({}, {"checkpointing": True}, {"loss": "acceptance"}):
            ref, ref_grads = run(**options)
            out, grads = run(compile=True, **options)
            assert torch.allclose(out.loss, ref.loss, rtol=1e-5, atol=1e-6), options
            assert [(int(s.correct), int(s.valid)) for s in out.steps] == \
                   [(int(s.correct), int(s.valid)) for s in ref.steps]
            assert grads.keys() == ref_grads.keys()
            for name, grad in ref_grads.items():
                assert _gap(grads[name], grad) <= 1e-5, (options, name, _gap(grads[name], grad))
    assert set(fused._compiled) == {fused.rms_norm, fused.rotary, fused.swiglu, fused.soft_ce_rows}
    assert not fused._enabled  # the switch ends with the unroll


def test_under_bf16_autocast_a_compiled_unroll_gives_the_eager_unrolls_results_within_bf16_rounding():
    """trainer.precision=bf16 (fp32 master weights under bf16 autocast, what a GPU and an avx512_bf16 CPU train in):
    the compiled chains keep their intermediates in fp32 where eager rounds some to bf16, so the two agree within
    bf16's rounding: loss 1e-2 relative, each gradient 3e-2 of its largest entry, for EAGLE3 and EAGLE 3.1 with
    checkpointed steps."""
    target = tiny_target()
    for draft in (tiny_draft(target, draft_vocab_size=64), tiny_draft(target, draft_vocab_size=64, **EAGLE31)):
        inputs = _packed_rows(target, 64)
        runs = []
        for compile in (False, True):
            draft.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = TTTObjective(ttt_length=3, loss_chunk_rows=7, checkpointing=True,
                                      compile=compile).unroll(draft, inputs)
            out.loss.backward()
            runs.append((out.loss.detach(), {n: p.grad.clone() for n, p in draft.named_parameters()
                                             if p.grad is not None}))
        (ref, ref_grads), (loss, grads) = runs
        assert abs(float(loss - ref)) <= 1e-2 * abs(float(ref))
        for name, grad in ref_grads.items():
            assert _gap(grads[name], grad) <= 3e-2, (name, _gap(grads[name], grad))


def test_a_compiled_block_draft_step_gives_the_eager_steps_loss_and_gradients(monkeypatch):
    """The block drafts (DFlash, DSpark with its heads, DFlash 2 with its selector) take draft.compile too: their
    norms, rope and MLP compiled, the same loss, step statistics and gradients as eager (1e-5 of each gradient's
    largest entry)."""
    from specforge_lite.methods import METHODS
    from specforge_lite.methods.dflash.model import DFlashObjective
    from specforge_lite.methods.dflash2.model import DFlash2Objective
    from specforge_lite.methods.dspark.model import DSparkObjective
    from test_dflash import block_inputs, tiny_block_draft

    monkeypatch.setattr(fused, "_compiled", {})
    target = tiny_target()
    cases = (("dflash", {}, DFlashObjective, {}), ("dspark", {"markov_rank": 8}, DSparkObjective, {}),
             ("dflash2", {}, DFlash2Objective, {"selector_weight": 0.5}))
    for method, settings, objective, options in cases:
        torch.manual_seed(0)
        draft = tiny_block_draft(target, method, **METHODS[method].steps_settings(3), **settings)  # (k=3)
        inputs = block_inputs(target, draft, teacher_scale=3.0)
        runs = []
        for compile in (False, True):
            draft.zero_grad()
            out = objective(3, loss_chunk_rows=5, compile=compile, **options).unroll(draft, inputs)
            out.loss.backward()
            runs.append((out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}))
        (ref, ref_grads), (out, grads) = runs
        assert torch.allclose(out.loss, ref.loss, rtol=1e-5, atol=1e-6), method
        assert [(int(s.correct), int(s.valid)) for s in out.steps] == \
               [(int(s.correct), int(s.valid)) for s in ref.steps]
        for name, grad in ref_grads.items():
            assert _gap(grads[name], grad) <= 1e-5, (method, name, _gap(grads[name], grad))
    assert {fused.rms_norm, fused.rotate, fused.swiglu} <= set(fused._compiled)


def test_draft_compile_without_a_cpp_compiler_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    """On a CPU, torch.compile builds its kernels with a C++ compiler: without one, draft.compile=true is refused
    with the fix, before the run folder or the target exist (not a compiler error minutes into the run)."""
    from specforge_lite.compose import load_config
    from specforge_lite.job import run

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(ValueError, match=r"draft.compile=true on a CPU needs the C\+\+ compiler .*no-such-compiler, "
                                         r"which is not found: point \$CXX at an installed one"):
        run(load_config(["model=llama3_tiny", "tracker=none", "draft.compile=true"]), tmp_path / "run",
            log=lambda m: None)
    assert not (tmp_path / "run").exists()


def _fake_compiler(tmp_path, name: str, body: str, executable: bool = True):
    """A stand-in for $CXX: a shell script that answers --version (torch's own probe) and then does ``body``."""
    path = tmp_path / name
    path.write_text(f'#!/bin/sh\ncase "$1" in --version) echo "fake 1.0"; exit 0;; esac\n{body}\n')
    path.chmod(0o755 if executable else 0o644)
    return path


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU draft.compile builds Triton kernels, no C++ compiler")
@pytest.mark.parametrize("name, body, executable, said", [
    pytest.param("not-executable", "exit 0", False, r"is not executable: make it executable \(chmod \+x\)",
                 id="not-executable"),
    pytest.param("exits-1", 'echo "fake: error: cannot find cc1plus" >&2; exit 1', True,
                 r"failed to compile a three-line C\+\+ file \(exit status 1: fake: error: cannot find cc1plus\)",
                 id="exits-1"),
    pytest.param("hangs", "sleep 30", True, r"did not compile a three-line C\+\+ file within 1 s", id="hangs"),
])
def test_draft_compile_with_a_cpp_compiler_that_does_not_work_is_refused_before_anything_is_built(
        name, body, executable, said, tmp_path, monkeypatch):
    """$CXX names a compiler that exists but cannot build torch.compile's kernels (not executable, failing, hung):
    the settings check tries it on a tiny file (within settings.COMPILER_CHECK_SECONDS, once per compiler) and
    refuses draft.compile=true in one line naming $CXX and the fix, before the run folder or the target exist.
    Failed: the check only looked the name up (a failing compiler passed it, to end the first step in an
    InductorError traceback; a hung one, in a wait without end)."""
    import time

    from specforge_lite import settings
    from specforge_lite.compose import load_config
    from specforge_lite.job import run

    compiler = _fake_compiler(tmp_path, name, body, executable)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setattr(settings, "COMPILER_CHECK_SECONDS", 1, raising=False)
    started = time.monotonic()
    with pytest.raises(ValueError, match=rf"draft.compile=true on a CPU needs the C\+\+ compiler torch.compile builds "
                                         rf"its kernels with: \$CXX={compiler} {said}.*or set draft.compile=false"):
        run(load_config(["model=llama3_tiny", "tracker=none", "draft.compile=true", "trainer.max_steps=1"]),
            tmp_path / "run", log=lambda m: None)
    assert not (tmp_path / "run").exists() and time.monotonic() - started < 15
