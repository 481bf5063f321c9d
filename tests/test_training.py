"""Training loop: exact resume, atomic checkpoints, metrics.jsonl, learning on a tiny target."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import datasets
import pytest
import torch

from conftest import file_size_limit, tiny_draft, tiny_target, tiny_teacher
from specforge_lite.config import TrackerConfig, TrainerConfig
from specforge_lite.data import BatchStream
from specforge_lite.data.vocab import DraftVocab
from specforge_lite.methods.eagle3.objective import TTTObjective
from specforge_lite.methods.eagle3.settings import Eagle3Settings
from specforge_lite.records import is_complete
from specforge_lite.training import checkpoint as ckpt_mod
from specforge_lite.training.loop import train
from specforge_lite.training.tracking import Tracker


def synthetic_dataset(n=24, vocab=256, seed=0, answers=True):
    g = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "loss_mask": []}
    for _ in range(n):
        T = int(torch.randint(10, 24, (1,), generator=g))
        # a learnable pattern: the sequence counts upwards from a random start
        start = int(torch.randint(0, vocab, (1,), generator=g))
        rows["input_ids"].append([(start + i) % vocab for i in range(T)])
        rows["loss_mask"].append([0] * 4 + [int(answers)] * (T - 4))
    return datasets.Dataset.from_dict(rows)


def run_training(run_dir, max_steps, stop_at=None, seed=0, lr=3e-3, accum=2, resume="auto", draft_vocab=None,
                 vocab_offset=0, answers=True, log=lambda m: None, max_minutes=None, save_every=2,
                 stream_cls=BatchStream, data_seed=0, optimizer="adamw", save_every_minutes=None, steps_per_epoch=None,
                 precision="fp32", muon_lr=None, **stream_kw):
    target = tiny_target()
    draft = tiny_draft(target, draft_vocab_size=draft_vocab or target.vocab_size, seed=seed)
    if vocab_offset:  # another mapping of the same size
        ids = (draft.draft_vocab_ids() + vocab_offset) % target.vocab_size
        vocab = DraftVocab(ids.sort().values, target.vocab_size, float("nan"))
        draft.set_vocab(vocab.d2t, vocab.t2d)
    cfg = TrainerConfig(max_steps=max_steps, micro_batch_size=2, grad_accum_steps=accum, lr=lr, save_every=save_every,
                        stop_at_step=stop_at, progress_bar=False, precision=precision, warmup_ratio=0.1, resume=resume,
                        max_minutes=max_minutes, optimizer=optimizer, save_every_minutes=save_every_minutes,
                        muon_lr=muon_lr)
    stream = stream_cls(synthetic_dataset(seed=data_seed, answers=answers), cfg.micro_batch_size, pad_id=0, seed=seed,
                        **stream_kw)
    result = train(cfg, TTTObjective.from_config(Eagle3Settings(ttt_length=3)), tiny_teacher(target, draft), draft,
                   stream, run_dir,
                   lambda step: Tracker(TrackerConfig(kind="none"), run_dir, {}, resume_step=step),
                   draft.spec.to_dict(), log=log, steps_per_epoch=steps_per_epoch)
    return result, draft


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The draft's weights after run_training's 8 default steps, left alone: what the interrupted and resumed
    runs below must end with (trained once for the module: CI time)."""
    _, draft = run_training(tmp_path_factory.mktemp("uninterrupted"), max_steps=8)
    return {name: tensor.clone() for name, tensor in draft.trainable_state_dict().items()}


@pytest.fixture(scope="module")
def stopped_at_4(tmp_path_factory) -> Path:
    """The same run stopped at step 4 (checkpoints of steps 2 and 4); a test copies it before changing it."""
    run_dir = tmp_path_factory.mktemp("stopped_at_4") / "run"
    assert run_training(run_dir, max_steps=8, stop_at=4)[0].step == 4
    return run_dir


def assert_same_weights(expected: dict, draft) -> None:
    for name, tensor in draft.trainable_state_dict().items():
        assert torch.equal(expected[name], tensor), name


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_is_exact(tmp_path, optimizer):
    """With Muon the checkpoint must carry its momentum (and AdamW's moments for the rest)."""
    straight, d1 = run_training(tmp_path / "a", max_steps=8, optimizer=optimizer)
    first, _ = run_training(tmp_path / "b", max_steps=8, stop_at=4, optimizer=optimizer)
    assert first.step == 4
    resumed, d2 = run_training(tmp_path / "b", max_steps=8, optimizer=optimizer)
    assert resumed.step == 8
    for name, tensor in d1.trainable_state_dict().items():
        assert torch.equal(tensor, d2.trainable_state_dict()[name]), name
    lines = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 9))
    straight_lines = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [x["loss"] for x in lines] == [x["loss"] for x in straight_lines]


def test_under_muon_both_learning_rates_are_logged_each_by_its_settings_name(tmp_path):
    """H9: ``lr`` in metrics.jsonl is trainer.lr's schedule (AdamW's, over the norms and the lm_head) under
    either optimizer; under Muon ``muon_lr`` is its matrices' (trainer.muon_lr's), on the same schedule."""
    run_training(tmp_path / "muon", max_steps=4, accum=1, lr=1e-3, optimizer="muon", muon_lr=4e-3)
    lines = [json.loads(x) for x in (tmp_path / "muon" / "metrics.jsonl").read_text().splitlines()]
    assert max(x["lr"] for x in lines) == pytest.approx(1e-3)
    assert [x["muon_lr"] for x in lines] == pytest.approx([4 * x["lr"] for x in lines])
    run_training(tmp_path / "adamw", max_steps=2, accum=1, lr=1e-3)
    lines = [json.loads(x) for x in (tmp_path / "adamw" / "metrics.jsonl").read_text().splitlines()]
    assert "muon_lr" not in lines[-1] and max(x["lr"] for x in lines) == pytest.approx(1e-3)


def test_the_muon_split_is_speculators_rule_widened_to_every_token_indexed_matrix():
    """H9: speculators leaves the embedding and the lm_head to AdamW; ours leaves every matrix indexed by token
    id (DSpark's Markov factors, DFlash 2's codebooks) to it too, and is speculators' rule elsewhere."""
    from specforge_lite.training.optim import TOKEN_INDEXED, for_muon
    from test_dflash import tiny_block_draft

    def speculators_rule(name, p):  # (their split, as their docs state it)
        return p.ndim == 2 and min(p.shape) > 1 and "embed_tokens" not in name and "lm_head" not in name

    target = tiny_target(aux_ids=[2, 4, 6])
    named = dict(tiny_block_draft(target, method="dspark", markov_rank=8).named_parameters())
    differ = sorted(n for n, p in named.items() if for_muon(n, p) != speculators_rule(n, p))
    assert differ == ["markov_head.markov_w1.weight", "markov_head.markov_w2.weight"]
    assert all(not for_muon(n, named[n]) and any(hint in n for hint in TOKEN_INDEXED) for n in differ)


def test_metrics_fields_and_learning(tmp_path):
    result, _ = run_training(tmp_path, max_steps=60, lr=3e-3, accum=1)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for key in ["step", "loss", "acc_0", "acc_1", "acc_2", "sim_accepted_drafts", "tokens_per_s", "lr"]:
        assert key in lines[-1]
    accs = [lines[-1][f"acc_{k}"] for k in range(3)]
    expected = accs[0] + accs[0] * accs[1] + accs[0] * accs[1] * accs[2]
    assert abs(lines[-1]["sim_accepted_drafts"] - expected) < 1e-9
    def mean(rows, key):
        return sum(r[key] for r in rows) / len(rows)

    first, last = lines[:10], lines[-10:]  # single steps are noisy at this batch size
    assert mean(last, "loss") < 0.5 * mean(first, "loss")
    assert mean(last, "acc_0") > mean(first, "acc_0") + 0.2


def test_killed_save_leaves_previous_checkpoint_usable(tmp_path, monkeypatch):
    run_training(tmp_path, max_steps=8, stop_at=2)
    good = ckpt_mod.latest_checkpoint(tmp_path)
    assert good.name == "step_00000002"

    real_save = ckpt_mod.save_file

    def dying_save(tensors, path, *a, **kw):  # the process "dies" after part of the checkpoint is on disk
        real_save(tensors, path, *a, **kw)
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(ckpt_mod, "save_file", dying_save)
    with pytest.raises(KeyboardInterrupt):
        run_training(tmp_path, max_steps=8, stop_at=4)
    monkeypatch.setattr(ckpt_mod, "save_file", real_save)
    assert ckpt_mod.latest_checkpoint(tmp_path) == good  # the half-written step 4 is invisible
    assert list((tmp_path / "checkpoints").glob(".tmp-*"))  # ... and it really was partly written
    result, _ = run_training(tmp_path, max_steps=8)
    assert result.step == 8 and not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_a_killed_resave_of_a_step_keeps_a_loadable_copy_of_it(tmp_path, monkeypatch):
    """keep_checkpoints=1 and the same step saved again (the final save after a periodic one): a kill
    between taking the old folder away and putting the new one in place must not leave the run without
    a checkpoint (resume=auto would silently start again from step 0)."""
    run_training(tmp_path, max_steps=8, stop_at=2)
    state = json.loads((tmp_path / "checkpoints" / "step_00000002" / ckpt_mod.STATE).read_text())
    real_replace = ckpt_mod.os.replace
    calls = []

    def dying_replace(src, dst):
        calls.append(Path(dst).name)
        if Path(dst).name == "step_00000002" and len(calls) > 1:  # the old folder already moved (or deleted)
            raise KeyboardInterrupt("killed mid-rename")
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt_mod.os, "replace", dying_replace)
    with pytest.raises(KeyboardInterrupt):
        ckpt_mod.save_checkpoint(tmp_path, 2, tiny_draft(tiny_target()).trainable_state_dict(), state, {}, keep=1)
    monkeypatch.setattr(ckpt_mod.os, "replace", real_replace)
    found = ckpt_mod.latest_checkpoint(tmp_path)
    assert found is not None, "no checkpoint left on disk"
    weights, loaded, _ = ckpt_mod.load_checkpoint(found)
    assert loaded["step"] == 2 and weights
    result, _ = run_training(tmp_path, max_steps=4)  # resumes from it, and the next save tidies up
    assert result.step == 4 and [p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()] == [
        "step_00000004"]


def test_every_file_and_folder_is_on_disk_before_a_checkpoint_is_published(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = ckpt_mod.os.fsync, ckpt_mod.os.replace
    monkeypatch.setattr(ckpt_mod.os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                          real_fsync(fd))[1])
    monkeypatch.setattr(ckpt_mod.os, "replace", lambda a, b: (events.append(("replace", str(a))),
                                                              real_replace(a, b))[1])
    run_training(tmp_path, max_steps=2)
    tmp = str(tmp_path / "checkpoints" / ".tmp-step_00000002")
    publish = events.index(("replace", tmp))
    synced = {path for kind, path in events[:publish] if kind == "fsync"}
    written = {str(Path(tmp) / p.name) for p in (tmp_path / "checkpoints" / "step_00000002").iterdir()}
    assert written and written <= synced and tmp in synced
    assert ("fsync", str(tmp_path / "checkpoints")) in events[publish:]  # the rename itself made durable


DAMAGE = {"weights": ckpt_mod.WEIGHTS, "optimizer": "optimizer.safetensors", "state": ckpt_mod.STATE,
          "state_key": ckpt_mod.STATE, "state_cursor": ckpt_mod.STATE, "optimizer_json": "optimizer.json",
          "rng": "rng_rank0.json"}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_checkpoint_is_named_and_the_older_one_resumed(tmp_path, damage, uninterrupted,
                                                                        stopped_at_4):
    """A checkpoint file cut short by a full disk, or JSON that is garbled or lacks a key: pointed at it, a run
    refuses in one line naming the file and the older checkpoint to use; resume=auto passes over it to the
    older intact one, says so, and ends where an uninterrupted run ends."""
    shutil.copytree(stopped_at_4, tmp_path / "run")  # (saved steps 2 and 4)
    newest = tmp_path / "run" / "checkpoints" / "step_00000004"
    damaged = newest / DAMAGE[damage]
    if damage in ("state_key", "state_cursor"):  # (the cursor's loss was a KeyError deep in the resume)
        state = json.loads(damaged.read_text())
        del (state["data"] if damage == "state_cursor" else state)["data" if damage == "state_key" else "cursor"]
        damaged.write_text(json.dumps(state))
    else:
        damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    with pytest.raises(ckpt_mod.CheckpointError, match=f"{DAMAGE[damage]} is damaged.*resume from .*step_00000002"):
        run_training(tmp_path / "other", max_steps=8, resume=str(newest))
    said = []
    resumed, d2 = run_training(tmp_path / "run", max_steps=8, log=said.append)
    assert any(f"step_00000004 ({DAMAGE[damage]} is damaged" in m and "resuming from the older" in m for m in said)
    assert resumed.step == 8
    assert_same_weights(uninterrupted, d2)


def _without(name):
    def damage(folder):
        from safetensors.torch import load_file, save_file

        weights = load_file(str(folder / ckpt_mod.WEIGHTS))
        del weights[name]
        save_file(weights, str(folder / ckpt_mod.WEIGHTS))
    return damage


MISFIT = {"fc.weight": _without("fc.weight"), "d2t": _without("d2t"),
          "spec": lambda folder: (folder / ckpt_mod.SPEC).write_text("{}")}


@pytest.mark.parametrize("damage", sorted(MISFIT))
def test_a_checkpoint_whose_weights_do_not_fit_its_spec_is_named_at_resume_and_export(tmp_path, stopped_at_4, damage):
    """Files that read but do not fit each other: a resume ended in a RuntimeError's traceback, an export in a
    KeyError or a TypeError, or (d2t gone) wrote a folder no server can load."""
    from specforge_lite.export import export_run

    shutil.copytree(stopped_at_4, tmp_path / "run")
    newest = tmp_path / "run" / "checkpoints" / "step_00000004"
    MISFIT[damage](newest)
    said = rf"checkpoint {newest} .*" + ("spec.json is damaged" if damage == "spec" else rf"is damaged: .*'{damage}'")
    with pytest.raises(ckpt_mod.CheckpointError, match=said) as refused:
        run_training(tmp_path / "other", max_steps=8, resume=str(newest))
    assert "\n" not in str(refused.value)
    with pytest.raises(ckpt_mod.CheckpointError, match=said):
        export_run(tmp_path / "run", "vllm", tmp_path / "out", checkpoint=newest)
    assert not (tmp_path / "out").exists()


def test_checkpoints_that_cannot_be_resumed_stop_auto_resume_and_a_fresh_start_keeps_them(tmp_path):
    """An output folder whose checkpoints all fail to read (here: an older version's pickles) must not be
    trained over from step 0 by resume=auto; starting anew is said explicitly, and the old ones are kept."""
    run_training(tmp_path, max_steps=8, stop_at=4)
    for folder in (tmp_path / "checkpoints").glob("step_*"):
        (folder / ckpt_mod.STATE).unlink()
        torch.save({"step": 4}, folder / "trainer_state.pt")
    metrics = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(ckpt_mod.CheckpointError, match="none can be resumed.*pickles.*trainer.resume=never"):
        run_training(tmp_path, max_steps=8)
    assert (tmp_path / "metrics.jsonl").read_text() == metrics  # nothing trained, nothing written
    said = []
    fresh, _ = run_training(tmp_path, max_steps=4, resume="never", log=said.append)
    assert fresh.step == 4 and any("earlier checkpoints are kept in" in m for m in said)
    kept = list(tmp_path.glob("checkpoints.before-*/step_00000004/trainer_state.pt"))
    assert len(kept) == 1 and (tmp_path / "checkpoints" / "step_00000004" / ckpt_mod.STATE).is_file()


def test_a_setting_changed_on_resume_is_applied_with_a_notice_or_refused(tmp_path):
    """A resume restores the saved optimizer and schedule: a changed learning rate would be silently ignored,
    so it is refused with the reason; a changed schedule length or clipping is applied, and said."""
    run_training(tmp_path, max_steps=8, stop_at=4, lr=3e-3)
    with pytest.raises(ckpt_mod.CheckpointError, match=r"trainer.lr 0.003 -> 0.001 \(the optimizer and schedule"):
        run_training(tmp_path, max_steps=8, lr=1e-3)
    said = []
    result, _ = run_training(tmp_path, max_steps=10, lr=3e-3, log=said.append)
    assert result.step == 10
    assert "[train] trainer.max_steps changed since step_00000004 (8 -> 10): applied from step 4" in said
    with pytest.raises(ckpt_mod.CheckpointError, match=r"trainer.optimizer adamw -> muon \(the saved optimizer"):
        run_training(tmp_path, max_steps=12, lr=3e-3, optimizer="muon")


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_the_learning_rate_schedule_follows_transformers_own_after_the_warmup(schedule):
    """trainer.schedule against transformers' get_{cosine,linear}_schedule_with_warmup on the same peak, warmup
    and length: every step after the warmup has the same learning rate (the warmup differs by design: ours
    reaches the peak at the warmup's last step, transformers' one step later). min_lr_ratio lifts the whole
    decay to end at lr * min_lr_ratio."""
    import transformers

    from specforge_lite.training.optim import build_scheduler

    steps, warmup_ratio, lr = 40, 0.1, 2e-3
    reference = getattr(transformers, f"get_{schedule}_schedule_with_warmup")
    theirs = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    their_lrs = []
    sched = reference(theirs, num_warmup_steps=round(warmup_ratio * steps), num_training_steps=steps)
    for _ in range(steps):
        their_lrs.append(theirs.param_groups[0]["lr"])
        theirs.step()
        sched.step()
    for min_ratio in (0.0, 0.25):
        ours = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        cfg = TrainerConfig(max_steps=steps, warmup_ratio=warmup_ratio, min_lr_ratio=min_ratio, schedule=schedule)
        scheduler, our_lrs = build_scheduler(ours, cfg), []
        for _ in range(steps):
            our_lrs.append(ours.param_groups[0]["lr"])
            ours.step()
            scheduler.step()
        warm = round(warmup_ratio * steps)
        expected = [min_ratio * lr + (1 - min_ratio) * x for x in their_lrs[warm:]]
        assert our_lrs[warm:] == pytest.approx(expected, rel=1e-6, abs=1e-12)
        assert our_lrs[warm - 1] == pytest.approx(lr)  # the peak at the warmup's last step
    # the two shapes really differ: a quarter into the decay the cosine is still near its peak
    quarter = round(warmup_ratio * steps) + (steps - round(warmup_ratio * steps)) // 4
    assert their_lrs[quarter] / lr == pytest.approx({"cosine": 0.854, "linear": 0.75}[schedule], abs=0.01)


@pytest.mark.parametrize("precision,ns_steps", [("fp32", 5), ("bf16", 5), ("fp32", 2)])
def test_muon_steps_the_layers_matrices_as_torchs_muon_and_the_rest_as_adamw(precision, ns_steps):
    """trainer.optimizer=muon as speculators sets torch's optimizers up: Muon (momentum 0.95, Nesterov,
    weight decay 0.1, its step scaled to AdamW's RMS, trainer.muon_ns_steps Newton-Schulz iterations) over the
    layer matrices and fc, AdamW over the norms and the token-indexed lm_head. The reference is
    torch.optim.Muon and torch.optim.AdamW built here on the same split. Ours orthogonalises in the run's
    precision (fp32, or bf16 as torch's always does, with its own rounding order), so the matrices agree to a
    few percent of their change; the AdamW side is torch's own, bit for bit. Torch's other scaling of the Muon
    step (adjust_lr_fn="original") moves the matrices 2-3x less and must not pass, nor may torch's Muon with
    another number of iterations than the one asked for."""
    from specforge_lite.training.optim import build_optimizer

    target = tiny_target()
    draft = tiny_draft(target, draft_vocab_size=64)
    start = {n: p.detach().clone() for n, p in draft.named_parameters() if p.requires_grad}
    cfg = TrainerConfig(optimizer="muon", lr=2e-3, weight_decay=0.01, precision=precision, muon_ns_steps=ns_steps)
    ours = build_optimizer(draft.named_parameters(), cfg)
    assert ours.parts[0].param_groups[0]["ns_dtype"] == {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    matrices = sorted(n for n, p in start.items() if p.ndim == 2 and "lm_head" not in n)
    assert "fc.weight" in matrices and "midlayer.mlp.down_proj.weight" in matrices
    assert "lm_head.weight" in start and "lm_head.weight" not in matrices  # (AdamW's: indexed by token)

    def reference(adjust, steps):
        params = {n: torch.nn.Parameter(t.clone()) for n, t in start.items()}
        return params, [torch.optim.Muon([params[n] for n in matrices], lr=2e-3, weight_decay=0.1, momentum=0.95,
                                         nesterov=True, ns_steps=steps, adjust_lr_fn=adjust),
                        torch.optim.AdamW([p for n, p in params.items() if n not in matrices], lr=2e-3,
                                          betas=(0.9, 0.95), weight_decay=0.01)]

    expected = ("match_rms_adamw", ns_steps)
    kinds = {expected, ("original", ns_steps), ("match_rms_adamw", 5 if ns_steps != 5 else 2)}
    references = {kind: reference(*kind) for kind in kinds}
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        grads = {n: torch.randn(t.shape, generator=g) for n, t in start.items()}
        for n, p in draft.named_parameters():
            if n in grads:
                p.grad = grads[n].clone()
        ours.step()
        for params, optimizers in references.values():
            for n, p in params.items():
                p.grad = grads[n].clone()
            for o in optimizers:
                o.step()
    now = dict(draft.named_parameters())
    for kind, (params, _) in references.items():
        for n in matrices:
            change = (params[n] - start[n]).abs().max()
            close = bool((now[n] - params[n]).abs().max() < 0.1 * change)
            assert close == (kind == expected), (kind, n)
    params = references[expected][0]
    for n in set(start) - set(matrices):
        assert torch.equal(now[n], params[n]), n


class SignalledStream(BatchStream):
    """Sends this process ``signum`` as it hands out its ``at``-th micro-batch: a scheduler's SIGTERM, or a
    Ctrl-C, in the middle of a step."""

    def __init__(self, *args, at: int, signum: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.at, self.signum, self.handed = at, signum, 0

    def __next__(self):
        self.handed += 1
        if self.handed == self.at:
            os.kill(os.getpid(), self.signum)
        return super().__next__()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_ends_the_step_saves_it_and_the_run_resumes_exactly(tmp_path, signum, uninterrupted):
    """SIGTERM (a scheduler's preemption) or SIGINT mid-step: the step under way finishes, a checkpoint of it
    is written, the run ends with Interrupted (train.py: a one-line error, exit 1, no export), and the same
    command resumes to what an uninterrupted run ends with."""
    from specforge_lite.training.loop import Interrupted, StopRequests

    with pytest.raises(Interrupted, match=f"stopped by {signum.name} at step 3; the checkpoint .*step_00000003"):
        run_training(tmp_path / "run", max_steps=8, save_every=100, stream_cls=SignalledStream, at=5, signum=signum)
    assert ckpt_mod.latest_checkpoint(tmp_path / "run").name == "step_00000003"
    assert not isinstance(getattr(signal.getsignal(signum), "__self__", None), StopRequests)  # handler given back
    resumed, d2 = run_training(tmp_path / "run", max_steps=8, save_every=100)
    assert resumed.step == 8
    assert_same_weights(uninterrupted, d2)


def test_a_kill_in_the_middle_of_pruning_leaves_no_half_deleted_checkpoint_listed(tmp_path, monkeypatch):
    """keep_checkpoints prunes the older folders; a kill while one is being removed (here the removal stops
    after its first file) must not leave a ``step_*`` folder that cannot be loaded (the kill torture found
    one: the folder was removed in place)."""
    run_training(tmp_path, max_steps=8, stop_at=2, save_every=1)
    real = ckpt_mod.shutil.rmtree

    def killed_midway(path, *a, **kw):
        files = sorted(p for p in Path(path).glob("*") if p.is_file())
        if files:
            files[0].unlink()
        raise SystemExit("killed while removing")

    monkeypatch.setattr(ckpt_mod.shutil, "rmtree", killed_midway)
    with pytest.raises(SystemExit):
        ckpt_mod._prune(tmp_path / "checkpoints", keep=1)
    monkeypatch.setattr(ckpt_mod.shutil, "rmtree", real)
    listed = sorted((tmp_path / "checkpoints").glob("step_*"))
    assert listed and all(is_complete(p) for p in listed), [p.name for p in listed]
    ckpt_mod._prune(tmp_path / "checkpoints", keep=1)  # the next save's prune removes what was left
    assert not list((tmp_path / "checkpoints").glob(".pruned-*"))


def test_a_checkpoint_that_cannot_be_written_is_said_and_never_the_newest(tmp_path):
    """A write that fails at a save (here: a file-size limit, failing like a full disk, inside safetensors'
    own writer, which reports it as its own error type): the run stops with the path and the reason, the
    half-written folder is gone, the previous checkpoint stays the newest, and the same command resumes once
    there is room."""
    run_training(tmp_path, max_steps=8, stop_at=2)
    with file_size_limit(4096), pytest.raises(ckpt_mod.CheckpointError, match="step 4 could not be written .*File "
                                                                                 "too large.*newest complete one is "
                                                                                 "still .*step_00000002"):
        run_training(tmp_path, max_steps=8, stop_at=4)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert ckpt_mod.latest_checkpoint(tmp_path).name == "step_00000002"
    assert run_training(tmp_path, max_steps=8)[0].step == 8


def test_metrics_that_cannot_be_written_stop_the_run_in_one_line_and_it_resumes(tmp_path):
    """The disk fills between checkpoints: the metrics line cannot be written (here a file-size limit, failing
    the same way). The run stops naming metrics.jsonl and the fix (the buffered line used to fail again at
    close, a raw OSError traceback); once there is room the same command resumes and the record is whole."""
    from specforge_lite.errors import UserError
    from specforge_lite.records import read_metrics

    run_training(tmp_path, max_steps=8, stop_at=2)
    with file_size_limit((tmp_path / "metrics.jsonl").stat().st_size + 200), \
            pytest.raises(UserError, match="metrics.jsonl could not be written .*File too large.*resumes"):
        run_training(tmp_path, max_steps=8, save_every=100)
    assert run_training(tmp_path, max_steps=8)[0].step == 8
    assert [row["step"] for row in read_metrics(tmp_path / "metrics.jsonl")] == list(range(1, 9))


def test_a_metrics_line_cut_short_by_a_kill_is_dropped_and_an_edited_one_is_named(tmp_path):
    """A kill in the middle of writing metrics.jsonl leaves a partial last line: the resume drops it (it
    raised a JSONDecodeError traceback before, and the run could not resume). A damaged line elsewhere is
    named by path and line, here and in the tools that read the record."""
    from specforge_lite.evaluate.sweep import collect
    from specforge_lite.records import DamagedRecord

    run_training(tmp_path, max_steps=6, stop_at=4)
    metrics = tmp_path / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines) + "\n" + lines[-1][: len(lines[-1]) // 2])
    resumed, _ = run_training(tmp_path, max_steps=6)
    assert resumed.step == 6
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == list(range(1, 7))
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], "{oops", *lines[2:]]) + "\n")
    with pytest.raises(DamagedRecord, match=f"{metrics}:2 is not a JSON object"):
        collect(tmp_path)
    with pytest.raises(DamagedRecord, match=f"{metrics}:2 is not a JSON object"):
        run_training(tmp_path, max_steps=8)


class _Payload:
    """Unpickling this creates a file: proof that loading ran code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("pickled", ["trainer_state.pt", "optimizer.pt", "rng_rank0.pt"])
def test_a_pickled_checkpoint_is_refused_without_running_it(tmp_path, pickled):
    """A checkpoint folder someone else made: resuming from it (and exporting it, the same loader) must not
    unpickle anything."""
    run_training(tmp_path / "mine", max_steps=4, stop_at=2)
    crafted = tmp_path / "crafted"
    shutil.copytree(tmp_path / "mine" / "checkpoints" / "step_00000002", crafted)
    for name in ("trainer_state", "optimizer", "rng_rank0"):
        for old in crafted.glob(f"{name}.*"):
            old.unlink()
    marker = tmp_path / "payload_ran"
    torch.save({"step": 2, "evil": _Payload(marker)}, crafted / pickled)
    for name in {"trainer_state.pt", "optimizer.pt", "rng_rank0.pt"} - {pickled}:
        torch.save({"step": 2}, crafted / name)
    with pytest.raises(ckpt_mod.CheckpointError, match="pickles"):
        run_training(tmp_path / "other", max_steps=4, resume=str(crafted))
    with pytest.raises(ckpt_mod.CheckpointError, match="pickles"):
        ckpt_mod.load_checkpoint(crafted)
    assert not marker.exists(), "the checkpoint's payload ran"


def test_resume_refuses_a_checkpoint_trained_on_another_draft_vocabulary(tmp_path):
    """Same sizes, same number of samples, another mapping (the data changed): the saved lm_head rows
    would train against other target tokens."""
    run_training(tmp_path, max_steps=4, stop_at=2, draft_vocab=64)
    with pytest.raises(ckpt_mod.CheckpointError, match="another draft vocabulary"):
        run_training(tmp_path, max_steps=4, draft_vocab=64, vocab_offset=1)


def test_resume_refuses_other_training_data_of_the_same_size_and_vocabulary(tmp_path):
    """The data file was edited between the runs: as many conversations, the same draft vocabulary (the whole
    target's), other token ids. The saved position would index rows the run never saw."""
    run_training(tmp_path, max_steps=4, stop_at=2)
    with pytest.raises(ValueError, match="other training data"):
        run_training(tmp_path, max_steps=4, data_seed=1)
    result, _ = run_training(tmp_path, max_steps=4)  # the same data resumes
    assert result.step == 4


def test_resume_refuses_a_checkpoint_from_another_draft(tmp_path):
    run_training(tmp_path, max_steps=4, stop_at=2)
    target = tiny_target(num_layers=10)
    from conftest import tiny_draft as make

    other = make(target, draft_vocab_size=64)
    cfg = TrainerConfig(max_steps=4, micro_batch_size=2, progress_bar=False)
    stream = BatchStream(synthetic_dataset(), 2, pad_id=0, seed=0)
    with pytest.raises(RuntimeError, match="does not fit this draft|size mismatch"):
        train(cfg, TTTObjective.from_config(Eagle3Settings(ttt_length=2)), tiny_teacher(target, other), other,
              stream, tmp_path,
              lambda s: Tracker(TrackerConfig(kind="none"), tmp_path, {}, resume_step=s), other.spec.to_dict(),
              log=lambda m: None)


def test_a_checkpoint_written_before_a_draft_option_existed_resumes(tmp_path):
    """A checkpoint whose spec predates an option (EAGLE 3.1's norm_before_fc and norm_output) holds a draft
    without it: resuming with the option off continues the run, as it did before the option existed."""
    run_training(tmp_path, max_steps=4, stop_at=2)
    spec_file = tmp_path / "checkpoints" / "step_00000002" / "spec.json"
    spec = json.loads(spec_file.read_text())
    del spec["norm_before_fc"], spec["norm_output"]
    spec_file.write_text(json.dumps(spec))
    resumed, _ = run_training(tmp_path, max_steps=4)
    assert resumed.step == 4


def test_every_spec_field_added_later_reads_as_its_old_behaviour(tmp_path):
    """A checkpoint from before the draft methods existed records no method, layers, mask token or parallel
    drafting: each absent field is its default (method eagle3, one layer, ...), so the run resumes. A field whose
    default is a non-empty string (the method) once refused every such checkpoint."""
    from specforge_lite.methods.eagle3.spec import Eagle3Spec

    run_training(tmp_path, max_steps=4, stop_at=2)
    spec_file = tmp_path / "checkpoints" / "step_00000002" / "spec.json"
    spec = json.loads(spec_file.read_text())
    later = [f for f in ("method", "num_layers", "parallel_drafting", "mask_token_id", "norm_before_fc",
                         "norm_output", "extra") if f in Eagle3Spec.__dataclass_fields__]
    spec_file.write_text(json.dumps({k: v for k, v in spec.items() if k not in later}))
    resumed, _ = run_training(tmp_path, max_steps=4)
    assert resumed.step == 4
    # a saved value that differs from the run's still refuses
    spec_file = tmp_path / "checkpoints" / "step_00000004" / "spec.json"
    spec_file.write_text(json.dumps({**spec, "method": "dflash"}))
    with pytest.raises(ckpt_mod.CheckpointError, match="does not fit this draft.*method"):
        run_training(tmp_path, max_steps=6)


def test_a_time_budget_ends_the_run_and_its_schedule_and_a_resume_spends_only_what_is_left(tmp_path, monkeypatch):
    """trainer.max_minutes: the run stops when the budget is spent, long before max_steps, with its warmup
    and cosine decay run over the budget (so it ends near min_lr, not at full lr as a step schedule cut short
    would), and counts as finished (it is exported). A resume from a checkpoint that spent the budget
    trains no further step. The loop's clock advances 0.1 s per reading, so the budget holds the same
    number of steps on any machine, busy or not."""
    from types import SimpleNamespace

    from specforge_lite.training import loop

    clock = iter(0.1 * n for n in range(1, 10**9))
    monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    result, _ = run_training(tmp_path, max_steps=100_000, accum=1, max_minutes=0.1, save_every=40)
    assert result.finished and 10 < result.step < 100_000
    lrs = [json.loads(x)["lr"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lrs[0] < 0.5 * max(lrs) and max(lrs) > 0.9 * 3e-3 and lrs[-1] < 0.1 * max(lrs)
    latest = ckpt_mod.latest_checkpoint(tmp_path)
    state = json.loads((latest / "trainer_state.json").read_text())
    assert state["elapsed_s"] >= 0.1 * 60
    again, _ = run_training(tmp_path, max_steps=100_000, accum=1, max_minutes=0.1, save_every=40)
    assert again.step == state["step"] and again.finished
    with pytest.raises(ValueError, match="trainer.max_minutes=0"):
        run_training(tmp_path / "zero", max_steps=5, max_minutes=0)


def test_a_resume_on_a_machine_where_auto_precision_chooses_otherwise_says_so(tmp_path, monkeypatch):
    """Review H8: trainer.precision=auto was recorded and compared as the word, so a run begun in bf16 (a CPU
    with native bf16, a GPU) and resumed where auto picks fp32 changed precision without a word. The choice is
    recorded; a resume where it differs says so in one line."""
    from types import SimpleNamespace

    from specforge_lite.training import distributed

    said = []
    monkeypatch.setattr(distributed, "native_bf16", lambda device: SimpleNamespace(native=True))
    run_training(tmp_path, max_steps=4, stop_at=2, precision="auto")
    monkeypatch.setattr(distributed, "native_bf16", lambda device: SimpleNamespace(native=False))
    run_training(tmp_path, max_steps=4, precision="auto", log=said.append)
    assert any("trainer.precision changed since step_00000002 (bf16 -> fp32)" in line for line in said), said


def test_a_time_budget_that_never_binds_schedules_every_step_as_the_step_schedule_does():
    """Review H7: with trainer.max_minutes the schedule followed the step schedule one step late, and the run's
    last step trained at lr 0. With a budget whose time never binds, every step's factor must be the step
    schedule's: the warmup's, then the decay from where the coming step starts."""
    from specforge_lite.config import TrainerConfig
    from specforge_lite.training.optim import Budget, warmup_decay

    for schedule, ratio in (("cosine", 0.1), ("linear", 0.0), ("cosine", 0.25)):
        cfg = TrainerConfig(max_steps=20, warmup_ratio=ratio, schedule=schedule, max_minutes=1e6)
        by_steps = warmup_decay(TrainerConfig(max_steps=20, warmup_ratio=ratio, schedule=schedule))
        by_time = warmup_decay(cfg, Budget(cfg))  # (elapsed 0: the time never binds)
        for step in range(20):
            assert by_time(step) == pytest.approx(by_steps(step), abs=1e-12), (schedule, ratio, step)
        assert by_time(19) > 0


def test_a_time_budget_the_steps_fit_leaves_the_run_independent_of_a_slow_first_step(tmp_path, monkeypatch):
    """The embedded recipe caps training by time (trainer.max_minutes) where its steps would not fit. On a CPU
    where they fit, the run must not depend on timing: a first step that pays one-off costs (kernels' first
    calls, a data loader's start) longer than the budget's pace must neither end the run nor move its
    learning rates. The loop's clock is simulated: 0.01 s per reading, plus what a slow start adds."""
    from types import SimpleNamespace

    from specforge_lite.training import loop

    now = [0.0]

    def perf_counter():
        now[0] += 0.01
        return now[0]

    monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=perf_counter))

    class SlowStart(BatchStream):  # its first micro-batch costs 5 s of the clock
        def __next__(self):
            if not getattr(self, "started", False):
                self.started = True
                now[0] += 5.0
            return super().__next__()

    # 3 s for 12 steps: a pace of 0.25 s a step, which every step but a slow first one keeps
    fast, fast_draft = run_training(tmp_path / "fast", max_steps=12, max_minutes=0.05, save_every=0)
    slow, slow_draft = run_training(tmp_path / "slow", max_steps=12, max_minutes=0.05, save_every=0,
                                    stream_cls=SlowStart)
    assert fast.step == slow.step == 12
    lrs = {name: [json.loads(x)["lr"] for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
           for name in ("fast", "slow")}
    assert lrs["fast"] == lrs["slow"]
    for name, tensor in fast_draft.trainable_state_dict().items():
        assert torch.equal(tensor, slow_draft.trainable_state_dict()[name]), name


def test_checkpoints_by_time_and_metrics_by_epoch(tmp_path, monkeypatch):
    """trainer.save_every_minutes (the scale recipe's checkpoints) saves once that much of the loop's clock has
    passed since the last checkpoint, whatever the step count; the metrics count epochs (trainer.epochs). The
    clock is simulated: every micro-batch costs 20 s, a step (two of them) 40 s, so a checkpoint every minute
    falls at every second step."""
    from types import SimpleNamespace

    from specforge_lite.training import loop

    now = [0.0]
    monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    class Slow(BatchStream):
        def __next__(self):
            now[0] += 20.0
            return super().__next__()

    saved = []
    real_save = loop.CheckpointManager.save
    monkeypatch.setattr(loop.CheckpointManager, "save", lambda self, step, *a: saved.append(step) or real_save(
        self, step, *a))
    run_training(tmp_path / "r", max_steps=7, save_every=0, save_every_minutes=1.0, stream_cls=Slow,
                 steps_per_epoch=4.0)
    assert saved == [2, 4, 6, 7]  # every 80 s of the clock, then the last step
    epochs = [json.loads(x)["epoch"] for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert epochs[0] == 0.25 and epochs[-1] == 1.75


def test_acceptance_loss_is_zero_on_agreement_and_trains():
    from specforge_lite.draft.objective import token_loss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=g)
    p = torch.softmax(logits, -1)
    assert torch.allclose(token_loss("acceptance", p, logits), torch.zeros(5), atol=1e-6)
    other = torch.randn(5, 40, generator=g)
    expected = -torch.log(torch.minimum(p, torch.softmax(other, -1)).sum(-1))  # 1 - total variation, by hand
    assert torch.allclose(token_loss("acceptance", p, other), expected)
    assert not torch.allclose(token_loss("acceptance", p, other), token_loss("soft_ce", p, other))
    assert torch.allclose(token_loss("tv", p, other), 1 - torch.exp(-expected))  # total variation, bounded by 1
    assert torch.allclose(token_loss("tv", p, logits), torch.zeros(5), atol=1e-6)
    with pytest.raises(ValueError, match="draft.loss"):
        token_loss("hinge", p, other)


def test_training_with_the_acceptance_loss_learns(tmp_path):
    target = tiny_target()
    draft = tiny_draft(target, draft_vocab_size=target.vocab_size)
    cfg = TrainerConfig(max_steps=40, micro_batch_size=2, lr=3e-3, save_every=0, progress_bar=False,
                        precision="fp32", warmup_ratio=0.1)
    stream = BatchStream(synthetic_dataset(), 2, pad_id=0, seed=0)
    train(cfg, TTTObjective.from_config(Eagle3Settings(ttt_length=3, loss="acceptance")),
          tiny_teacher(target, draft), draft, stream, tmp_path,
          lambda step: Tracker(TrackerConfig(kind="none"), tmp_path, {}, resume_step=step), draft.spec.to_dict(),
          log=lambda m: None)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["loss"] < 0.5 * lines[0]["loss"] and lines[-1]["acc_0"] > lines[0]["acc_0"]


def test_a_run_that_scores_no_token_warns_and_then_stops(tmp_path):
    """Batches whose loss mask or draft vocabulary leaves nothing to score train nothing (loss 0, grad 0):
    each such step is a warning, and several in a row end the run with the reason and the fix."""
    from specforge_lite.training.loop import UNSCORED_STEPS_LIMIT, NothingScored

    lines = []
    with pytest.raises(NothingScored, match="scored no token.*draft.draft_vocab_size"):
        run_training(tmp_path, max_steps=UNSCORED_STEPS_LIMIT + 3, answers=False, log=lines.append)
    warnings = [line for line in lines if "warning" in line and "scored no token" in line]
    assert len(warnings) == UNSCORED_STEPS_LIMIT - 1


def test_sigkilled_at_random_moments_and_resumed_ends_bit_equal_to_an_uninterrupted_run(tmp_path):
    """The kill torture (python -m specforge_lite.bench kill_resume), short: train.py killed with SIGKILL
    inside a checkpoint write and at a random moment, resumed each time, every listing loadable. Where a
    tmpfs can be mounted, first two disks that fill up under the run: each run stops by itself in one line."""
    import subprocess

    from specforge_lite.bench.kill_resume import torture

    probe = tmp_path / "probe"
    probe.mkdir()
    try:
        mountable = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)],
                                   capture_output=True).returncode == 0
    except FileNotFoundError:  # (no mount command at all)
        mountable = False
    if mountable:
        subprocess.run(["umount", str(probe)], capture_output=True)
    try:
        result = torture(kills=2, steps=6, seed=0, out=tmp_path / "torture", overrides=[], log=lambda m: None,
                         full_disk=2 if mountable else 0)
    finally:
        if mountable:
            subprocess.run(["umount", str(tmp_path / "torture" / "killed")], capture_output=True)
    assert all(t["rc"] == 1 and t["error"] and not t["traceback"] for t in result["full_disk"])
    assert len(result["full_disk"]) == (2 if mountable else 0) and result["full_disk_differing_tensors"] == []
    assert result["kills"] == 2 and result["inside_checkpoint_writes"] >= 1
    assert result["unloadable_listings"] == []
    assert result["final_steps"] == ["step_00000006", "step_00000006"] and result["differing_tensors"] == []
