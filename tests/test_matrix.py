"""The path every GPU user takes, on CPU: every draft method and option that changes the computation x engine
(one process; DeepSpeed ZeRO-2 over gloo, 2 ranks) x precision (fp32; bf16 autocast over fp32 weights, what
trainer.precision=bf16 runs on a GPU; DeepSpeed bf16: bf16 weights, fp32 master copies). Each case trains 3
steps on one fixed batch of the tiny target: every loss is finite, the loss falls, and the first step's loss
agrees with the fp32 run of the same case within ``BF16_TOLERANCE`` (bf16 keeps 8 bits of mantissa: a relative
error of ~0.4% per rounding, a few roundings deep). The DeepSpeed cases' fp32 losses are checked against the
same case trained in one process on each rank's row (an independent engine).

Coverage: one process, every option x (fp32, bf16 autocast): the full product. DeepSpeed ZeRO-2, every option
in bf16 (the GPU user's engine and precision), and fp32 for ``DEEPSPEED_FP32`` only, the options whose step
differs most in what DeepSpeed sees (a plain EAGLE3 step, packed rows, the extra layer and norms, the four
methods other than EAGLE3): pairwise coverage of engine x precision and engine x option, which keeps the
DeepSpeed launch to about half the cases of the full product."""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys

import pytest

from conftest import ROOT
from matrix_cases import OPTIONS, case_losses

BF16_TOLERANCE = 0.03  # relative, first-step loss, bf16 against fp32
DEEPSPEED_FP32 = ("eagle3", "packing", "eagle31_two_layers", "peagle", "dflash", "dspark", "dflash2")
DEEPSPEED_CASES = [(o, "bf16") for o in OPTIONS] + [(o, "fp32") for o in DEEPSPEED_FP32]


@functools.cache
def one_process(option: str, precision: str, row: int | None = None) -> tuple[float, ...]:
    return tuple(case_losses(option, precision, row=row))


def _check(losses: list[float], what: str) -> None:
    assert all(math.isfinite(x) for x in losses), f"{what}: a loss is not finite: {losses}"
    assert losses[-1] < losses[0], f"{what}: the loss did not fall over the steps: {losses}"


@pytest.mark.parametrize("option", list(OPTIONS))
def test_one_process_fp32_and_bf16_autocast(option):
    fp32, bf16 = one_process(option, "fp32"), one_process(option, "bf16")
    _check(fp32, f"{option}, fp32")
    _check(bf16, f"{option}, bf16 autocast")
    assert abs(bf16[0] - fp32[0]) <= BF16_TOLERANCE * abs(fp32[0]), (option, fp32[0], bf16[0])


@pytest.fixture(scope="module")
def deepspeed_matrix(tmp_path_factory) -> list[dict]:
    """``DEEPSPEED_CASES`` under ZeRO-2 on 2 ranks, in one launch (DeepSpeed imported once)."""
    out = tmp_path_factory.mktemp("matrix") / "matrix.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "distributed_worker.py"), "matrix", ",".join(f"{o}:{p}" for o, p in DEEPSPEED_CASES),
           str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("option", list(OPTIONS))
def test_deepspeed_zero2_fp32_and_bf16(deepspeed_matrix, option):
    cases = [c for c in deepspeed_matrix if c["option"] == option]
    precisions = [p for o, p in DEEPSPEED_CASES if o == option]
    assert {(c["rank"], c["precision"]) for c in cases} == {(r, p) for r in (0, 1) for p in precisions}
    for c in cases:
        _check(c["losses"], f"{option}, ZeRO-2 rank {c['rank']}, {c['precision']}")
        reference = one_process(option, "fp32", row=c["rank"])[0]  # the same row, one process, fp32
        tolerance = 1e-4 if c["precision"] == "fp32" else BF16_TOLERANCE
        assert abs(c["losses"][0] - reference) <= tolerance * abs(reference), (option, c, reference)


def test_a_frozen_lm_head_keeps_the_targets_rows_while_the_rest_learns():
    """draft.freeze_lm_head (speculators' recipe): after training the head is still the target's rows, bit for
    bit, the optimizer holds nothing for it, and the other weights moved."""
    import torch

    from conftest import tiny_target, tiny_vocab
    from matrix_cases import STEPS, rows
    from specforge_lite.compose import load_config
    from specforge_lite.data.loader import collate
    from specforge_lite.methods import build_objective
    from specforge_lite.run import build_draft
    from specforge_lite.targets import Teacher
    from specforge_lite.training.distributed import DistributedContext
    from specforge_lite.training.engine import build_engine

    for frozen in (True, False):
        config = load_config(["model=llama3_tiny", "tracker=none", "draft.ttt_length=3", "trainer.lr=3e-3",
                              "trainer.warmup_ratio=0", f"draft.freeze_lm_head={str(frozen).lower()}"])
        target = tiny_target(aux_ids=[1, 3, 5])
        vocab = tiny_vocab(target, 128)
        draft = build_draft(config, target, vocab)
        fc_before = draft.fc.weight.detach().clone()
        engine = build_engine(draft, config.trainer, DistributedContext())
        teacher, objective = Teacher(target, vocab.draft_to_target, vocab.t2d), build_objective(config.draft)
        batch = collate([rows(10, 2)[0], rows(20, 2)[0]], 0)
        for _ in range(STEPS):
            engine.backward(objective(engine.forward, teacher, batch).loss)
            engine.step()
        target_rows = target.full_head()[0][vocab.draft_to_target].float()
        kept = torch.equal(draft.lm_head.weight.detach(), target_rows)
        assert kept == frozen, f"freeze_lm_head={frozen}: the head {'moved' if frozen else 'never moved'}"
        assert (draft.lm_head.weight in engine.optimizer.state) != frozen
        assert not torch.equal(draft.fc.weight.detach(), fc_before), "the rest of the draft did not learn"
