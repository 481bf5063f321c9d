"""DeepSpeed on CPU: two processes over gloo (torchrun), checked against one-process references.

Every run here is ``train.py`` (or tests/distributed_worker.py) under a real launcher, as users run it.
The draft vocabulary is the whole vocabulary so that every position of the random tiny target counts
(its argmax is then always in the draft vocabulary) and the losses are not trivially zero.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT

COMMON = ["model=llama3_tiny", "recipe=none", "tracker=none", "data.max_length=96", "data.max_samples=24",
          "data.heldout_samples=4", "draft.draft_vocab_size=49152", "draft.ttt_length=3", "trainer.save_every=2",
          "trainer.log_every=1", "trainer.progress_bar=false", "trainer.precision=fp32", "trainer.lr=1e-3",
          "trainer.warmup_ratio=0", "trainer.micro_batch_size=1", "eval.enabled=false"]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def launch(args: list[str], nproc: int | None, background: bool = False):
    """``torchrun --nproc_per_node nproc train.py args`` (plain ``python train.py`` when nproc is None)."""
    cmd = [sys.executable, "train.py", *args] if nproc is None else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
        "train.py", *args]
    if background:
        return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_trajectory(a: list[dict], b: list[dict], rel: float = 1e-5):
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm", "acc_0", "lr"):
            assert abs(x[key] - y[key]) <= rel * max(abs(y[key]), 1.0), (x["step"], key, x[key], y[key])
        assert x["tokens_seen"] == y["tokens_seen"]


@pytest.fixture(scope="module")
def one_process_reference(tmp_path_factory) -> list[dict]:
    """4 steps of a global batch of 2 rows in one process (plain PyTorch, 2 micro-batches of 1 accumulated)."""
    out = tmp_path_factory.mktemp("one_process")
    launch([*COMMON, "trainer.max_steps=4", "trainer.grad_accum_steps=2", f"output_dir={out}"], None)
    return metrics(out)


@pytest.fixture(scope="module")
def zero2_two_ranks(tmp_path_factory) -> Path:
    """4 steps of ZeRO-2 on 2 ranks x 1 row, started as users start DeepSpeed: ``deepspeed --num_gpus 2
    train.py ...``, whose launcher appends --local_rank=N (train.py takes it before Hydra)."""
    out = tmp_path_factory.mktemp("zero2")
    cmd = [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", "2", "--master_port", "29517", "train.py",
           *COMMON, "trainer.max_steps=4", "trainer=zero2", f"output_dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_zero2_on_two_ranks_follows_the_one_process_trajectory(zero2_two_ranks, one_process_reference):
    """Same global batch of 2 rows: one process accumulating 2 micro-batches of 1 (plain PyTorch) vs
    two ranks with 1 row each under ZeRO-2. Tolerance 1e-5 relative: the ranks' gradients are averaged
    by an all-reduce instead of summed in place, which only reorders fp32 additions."""
    one, two = one_process_reference, metrics(zero2_two_ranks)
    assert len(two) == 4 and two[-1]["loss"] < two[0]["loss"]
    assert_same_trajectory(two, one)
    # only rank 0 writes: one line per step, one export
    assert (zero2_two_ranks / "final" / "model.safetensors").is_file()


def test_zero3_with_compiled_chains_follows_the_one_process_eager_trajectory(tmp_path, one_process_reference):
    """draft.compile=true under ZeRO-3 with checkpointed steps: the compiled chains (draft/fused.py) read the weights
    DeepSpeed gathers for each module's call, in the forward and in the backward's recomputation. Two ranks of 1 row
    follow one eager process of 2 accumulated rows (1e-5 relative)."""
    launch([*COMMON, "trainer.max_steps=4", "trainer=zero3", "draft.compile=true", "draft.checkpointing=true",
            f"output_dir={tmp_path}"], 2)
    assert_same_trajectory(metrics(tmp_path), one_process_reference)


def test_zero3_killed_and_resumed_equals_an_uninterrupted_run_and_exports_the_engine_weights(tmp_path):
    steps = ["trainer.max_steps=12", "trainer.save_every=4", "trainer=zero3"]
    launch([*COMMON, *steps, "trainer.deepspeed.native_checkpoint=true", f"output_dir={tmp_path / 'straight'}"], 2)

    killed = tmp_path / "killed"
    proc = launch([*COMMON, *steps, f"output_dir={killed}"], 2, background=True)
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "step_00000004").is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "final").exists(), "the run finished before it could be killed"
    launch([*COMMON, *steps, f"output_dir={killed}"], 2)

    straight = load_file(tmp_path / "straight" / "final" / "model.safetensors")
    resumed = load_file(killed / "final" / "model.safetensors")
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    assert_same_trajectory(metrics(killed), metrics(tmp_path / "straight"), rel=0.0)

    # the export equals what DeepSpeed itself reconstructs from the engine's ZeRO-3 shards
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    engine = get_fp32_state_dict_from_zero_checkpoint(
        str(tmp_path / "straight" / "checkpoints" / "step_00000012" / "deepspeed"), tag="state")
    for name, tensor in straight.items():
        assert torch.equal(tensor, engine[name].to(tensor.dtype)), name


def test_resuming_with_another_number_of_ranks(tmp_path, one_process_reference, zero2_two_ranks):
    """2 ranks x 1 row stopped at step 2, resumed on 1 rank accumulating 2 rows: the same global batches, so
    all 4 steps match the one-process run of the same global batches (within 1e-5, as above). ZeRO-0
    (replicated state) and ZeRO-2 (optimizer state and gradients partitioned over the 2 ranks, consolidated
    in the checkpoint and re-split for 1 rank)."""
    run = tmp_path / "switch"
    launch([*COMMON, "trainer.max_steps=4", "trainer=zero0", "trainer.stop_at_step=2", f"output_dir={run}"], 2)
    out = launch([*COMMON, "trainer.max_steps=4", "trainer=zero0", "trainer.grad_accum_steps=2",
                  f"output_dir={run}"], 1)
    assert "written by 2 ranks, now 1" in out.stdout + out.stderr
    assert_same_trajectory(metrics(run), one_process_reference)

    zero2 = tmp_path / "zero2"  # the 2-rank ZeRO-2 run, taken back to its step-2 checkpoint
    shutil.copytree(zero2_two_ranks, zero2)
    shutil.rmtree(zero2 / "checkpoints" / "step_00000004")
    shutil.rmtree(zero2 / "final")
    out = launch([*COMMON, "trainer.max_steps=4", "trainer=zero2", "trainer.grad_accum_steps=2",
                  f"output_dir={zero2}"], 1)
    assert "written by 2 ranks, now 1" in out.stdout + out.stderr
    assert_same_trajectory(metrics(zero2), one_process_reference)


@pytest.mark.parametrize("preset", ["gemma3_tiny"])  # tied lm_head = embedding: the weight read twice
def test_sharded_target_captures_what_the_whole_target_captures(tmp_path, preset):
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "distributed_worker.py"), "sharded_target", preset, str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2
    for r in ranks:
        assert r["aux_max_diff"] == 0.0 and r["final_max_diff"] == 0.0 and r["teacher_max_diff"] == 0.0, r
        assert r["in_vocab_equal"] and r["embedding_equal"], r
        assert r["embedding_local_numel"] <= r["embedding_full_numel"] // 2  # really partitioned
        assert r["sizes"][:2] == r["sizes"][2:]
    assert ranks[0]["embedding_checksum"] == ranks[1]["embedding_checksum"]  # the same table on every rank


def test_a_model_folder_built_on_a_rank_other_than_0_has_its_weights(tmp_path, monkeypatch):
    """Inside a distributed launch transformers' save_pretrained writes weights on rank 0 only; the rank
    that builds a cached model folder (whichever takes the lock) must still write them."""
    import transformers.distributed.mixin as mixin

    from specforge_lite.config import model_preset
    from specforge_lite.targets.acquire import _tokenizer_source_dir, build_tiny_model

    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1)
    tiny = model_preset("llama3_tiny").tiny
    build_tiny_model(tiny.architecture, tiny.config, tiny.config_class, tiny.seed,
                     _tokenizer_source_dir(tiny.tokenizer_from), tmp_path / "model")
    assert (tmp_path / "model" / "config.json").is_file() and (tmp_path / "model" / "model.safetensors").is_file()


def test_ulysses_split_unroll_sums_to_the_whole_unroll_at_smollm2_heads(tmp_path):
    """Sequence parallelism over 2 gloo ranks (DeepSpeed's all-to-all), at SmolLM2's head layout (9 query
    heads over 3 KV heads: DeepSpeed splits them unevenly, 2 and 1 KV heads), packed rows of odd length
    (the split pads), activation checkpointing and loss chunks: the ranks' losses, counts and gradients add
    up to the unroll of the whole rows on one rank (1e-5 relative); for EAGLE3 and for a two-layer EAGLE 3.1
    draft (each layer's attention exchanged)."""
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "distributed_worker.py"), "ulysses", "smollm2", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    ranks = json.loads(out.read_text())
    assert sorted(r["layers"] for r in ranks) == [1, 1, 2, 2]
    for r in ranks:
        assert abs(r["loss"] - r["whole_loss"]) <= 1e-5 * abs(r["whole_loss"]), r
        assert r["valid"] == r["whole_valid"] and r["correct"] == r["whole_correct"], r
        assert r["grad_rel_diff"] < 1e-5, r
    assert all(v > 0 for r in ranks for v in r["own_valid"][:1])  # both ranks scored rows of their own


def test_sequence_parallel_training_follows_the_one_process_trajectory(tmp_path):
    """train.py on 2 ranks sharing every (packed) row, trainer.deepspeed.sequence_parallel=2 under ZeRO-2,
    against one process on the same rows: same loss, gradient norm and accuracy per step (1e-5), and the
    tokens counted once."""
    packed = [*COMMON, "data.packing=true", "trainer.micro_batch_size=2", "trainer.max_steps=3"]
    launch([*packed, f"output_dir={tmp_path / 'one'}"], None)
    launch([*packed, "trainer=zero2", "trainer.deepspeed.sequence_parallel=2", f"output_dir={tmp_path / 'sp'}"], 2)
    one, sp = metrics(tmp_path / "one"), metrics(tmp_path / "sp")
    assert len(sp) == 3
    assert_same_trajectory(sp, one)


def test_a_build_lock_left_by_a_killed_run_does_not_hang_the_next_one(tmp_path):
    """A run killed while torch built or loaded DeepSpeed's JIT ops leaves ``<extension>/lock``; torch takes
    that lock on every later load and waits on it without end. The next DeepSpeed start removes it, naming
    it, and starts; a lock a live build holds (a process working in its folder) is left alone. Fails on the
    old code by timing out."""
    from specforge_lite.training.distributed import clear_stale_build_locks, extensions_root

    extensions = tmp_path / "extensions"
    built = extensions_root()
    if built.is_dir():  # the ops the earlier tests built: a copy, so that nothing is rebuilt here
        shutil.copytree(built, extensions, ignore=shutil.ignore_patterns("lock"))
    stale = extensions / "deepspeed_shm_comm" / "lock"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.touch()
    old = time.time() - 600
    os.utime(stale, (old, old))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "OMP_NUM_THREADS": "1"}
    code = ("from specforge_lite.compose import load_config\n"
            "from specforge_lite.training.distributed import init_distributed\n"
            "ctx = init_distributed(load_config(['tracker=none', 'trainer=zero2']).trainer)\n"
            "print('started', ctx.world_size)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0 and "started 1" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"removed a stale build lock left by a killed run: {stale}" in proc.stdout + proc.stderr
    busy = extensions / "busy_op" / "lock"  # a live build: this test's own process works in the folder
    busy.parent.mkdir()
    busy.touch()
    os.utime(busy, (old, old))
    here, before = os.getcwd(), os.environ.get("TORCH_EXTENSIONS_DIR")
    os.chdir(busy.parent)
    os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions)
    try:
        assert clear_stale_build_locks(log=lambda m: None) == [] and busy.exists()
    finally:
        os.chdir(here)
        os.environ.pop("TORCH_EXTENSIONS_DIR")
        if before is not None:
            os.environ["TORCH_EXTENSIONS_DIR"] = before


def test_a_run_ends_its_process_group_and_takes_back_the_launcher_variables(tmp_path, monkeypatch):
    """A DeepSpeed run in one process (no launcher: init_distributed makes a group of one and sets the
    launcher's variables) leaves no process group and none of those variables behind: a group left to the
    interpreter's exit can abort a launch (gloo's worker thread forced out while it releases the last
    collective: ``terminate called without an active exception``), and the variables leaked into every
    process the caller started later. Fails on the code before ``process_group``."""
    sys.path.insert(0, str(ROOT))
    from specforge_lite.job import run

    from specforge_lite.compose import load_config

    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    for key in keys:
        monkeypatch.delenv(key, raising=False)
    run(load_config([*COMMON, "trainer=zero0", "trainer.max_steps=1", "trainer.save_every=0",
                     f"output_dir={tmp_path}"]), tmp_path, log=lambda line: None)
    assert (tmp_path / "final" / "model.safetensors").is_file()
    assert not torch.distributed.is_initialized()
    assert {k: os.environ[k] for k in keys if k in os.environ} == {}
