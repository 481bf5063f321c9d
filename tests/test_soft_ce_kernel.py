"""The soft cross-entropy's Triton kernel (draft/soft_ce_kernel.py), run by Triton's interpreter on CPU tensors,
against an eager computation written here (log_softmax, softmax, autograd), and through the fused head + loss.

The checks run in one subprocess started with TRITON_INTERPRET=1: Triton reads it when it is first imported (its
own library functions, tl.max and tl.sum among them, are kernels decorated then), and this pytest process may
have imported Triton already (torch.compile does)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def test_kernel_under_triton_interpreter():
    if importlib.util.find_spec("triton") is None:  # (CI installs the dev extra: a missing Triton is a broken setup)
        pytest.fail("Triton is not installed: pip install -e '.[dev]' (docker/constraints.txt pins it)")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(root), os.environ.get(
        "PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("checked"), proc.stdout + proc.stderr


def test_kernel_is_not_the_default_on_cpu():
    from specforge_lite.draft import fused
    from specforge_lite.draft.head_loss import soft_ce_kernel_default

    with fused.compiled(True):
        assert not soft_ce_kernel_default(torch.device("cpu"))


def eager_soft_ce(z, teacher_logits, teacher_rows, row_weights):
    """(each row's -sum p log softmax(z), d sum(w * loss) / dz), p = softmax of the row's teacher logits."""
    logits = z.float().requires_grad_()
    p = torch.softmax(teacher_logits.float()[teacher_rows], -1)
    loss = -(p * torch.log_softmax(logits, -1)).sum(-1)
    (loss * row_weights).sum().backward()
    return loss.detach(), logits.grad


def rows_with_ties(n: int, vocab: int, dtype: torch.dtype, generator) -> torch.Tensor:
    """Random logits whose rows (vocab > 140) hold their maximum at columns 5, 133 and 250 (the same lane of two
    blocks of 128, and another lane)."""
    z = torch.randn(n, vocab, generator=generator)
    if vocab > 140:
        z[:, [5, 133, min(250, vocab - 1)]] = 9.0
    return z.to(dtype)


def test_the_bench_dry_run_times_the_eager_chain_at_tiny_shapes(tmp_path, capsys):
    import json

    from specforge_lite.bench.soft_ce import main

    main(["--dry-run", "--out", str(tmp_path / "soft_ce.json")])
    result = json.loads((tmp_path / "soft_ce.json").read_text())
    assert list(result["ways"]) == ["eager"] and result["ways"]["eager"]["loss_max_rel_diff"] == 0
    assert result["least_bytes"] == 16 * 3 * 300 * 2 * 3  # (bf16 logits and teacher rows read, gradient written)
    assert "x of the HBM limit" in capsys.readouterr().out


# (rows, draft vocabulary, columns a program reads at once, logits' dtype): one column; a vocabulary over 2 blocks
# and a part; one block with masked lanes
CASES = [(1, 1, None, torch.float32), (7, 300, 128, torch.bfloat16), (7, 300, None, torch.float32),
         (1, 300, 128, torch.float32)]


def check_kernel_matches_eager(n, vocab, block, dtype):
    from specforge_lite.draft import soft_ce_kernel as kernel

    g = torch.Generator().manual_seed(n * vocab)
    z = rows_with_ties(n, vocab, dtype, g)
    teacher = (4 * torch.randn(3, vocab, generator=g)).to(dtype)
    rows = torch.tensor([0, 2, 2, 1, 0, 2, 1][:n])  # (teacher rows shared by several rows, as TTT steps share them)
    weights = torch.rand(n, generator=g) + 0.5
    top = z.float().argmax(-1)  # (torch's tie rule: the first column of the maximum)
    want_loss, want_dz = eager_soft_ce(z, teacher, rows, weights)

    loss, correct, dz = kernel.soft_ce_rows(z, teacher, rows, top, weights, torch.float32, block)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dz, want_dz, rtol=1e-5, atol=1e-6)
    assert correct.tolist() == [True] * n
    if vocab > 140:  # a later column of the tied maximum is not the argmax
        assert kernel.soft_ce_rows(z, teacher, rows, torch.full((n,), 133), weights, None, block)[1].tolist() == \
            [False] * n

    loss_only, _, none = kernel.soft_ce_rows(z, teacher, rows, top, weights, None, block)
    assert none is None
    torch.testing.assert_close(loss_only, loss, rtol=0, atol=0)
    _, _, dz_bf16 = kernel.soft_ce_rows(z, teacher, rows, top, weights, torch.bfloat16, block)
    assert dz_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(dz_bf16.float(), want_dz, rtol=1e-2, atol=1e-3)


def check_head_loss_through_kernel_equals_eager_chain():
    from specforge_lite.draft.head_loss import head_soft_cross_entropy

    g = torch.Generator().manual_seed(0)
    h = torch.randn(7, 16, generator=g)
    w = torch.randn(300, 16, generator=g) / 4
    teacher = 4 * torch.randn(3, 300, generator=g)
    rows = torch.tensor([0, 2, 2, 1, 0, 2, 1])
    top = torch.where(torch.arange(7) < 4, (h @ w.t()).argmax(-1), teacher[rows].argmax(-1))  # (some rows right)
    weights = torch.rand(7, generator=g)
    outs = {}
    for use_kernel in (False, True):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        total, row_loss, row_correct = head_soft_cross_entropy(hh, ww, teacher, rows, top, weights, 4,
                                                               kernel=use_kernel)
        total.backward()
        outs[use_kernel] = (total.detach(), row_loss, row_correct, hh.grad, ww.grad)
    for got, want in zip(outs[True], outs[False]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":  # (test_kernel_under_triton_interpreter's subprocess)
    for case in CASES:
        print("case", case, flush=True)  # (which one failed, above the traceback)
        check_kernel_matches_eager(*case)
    check_head_loss_through_kernel_equals_eager_chain()
    print("checked")
