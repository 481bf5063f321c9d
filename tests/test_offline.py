"""Offline training: dump a store, train from it exactly as online, resume a killed dump, refuse bad
stores by name, and ingest vLLM / speculators extractions to the same content as our own dump."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import ROOT
from specforge_lite.compose import load_config
from specforge_lite.offline import StoreError, StoreReader
from specforge_lite.offline.dump import dump as dump_run
from specforge_lite.offline.ingest import ingest
from specforge_lite.run import Run

sys.path.insert(0, str(ROOT))

# The whole vocabulary as draft vocabulary: every position of the random tiny target counts (non-zero losses).
TINY = ["model=llama3_tiny", "recipe=none", "tracker=none", "data.max_length=96", "data.max_samples=24",
        "data.heldout_samples=4", "draft.draft_vocab_size=49152", "draft.ttt_length=3"]
TRAIN = ["trainer.max_steps=6", "trainer.log_every=1", "trainer.progress_bar=false", "trainer.precision=fp32",
         "trainer.micro_batch_size=2", "trainer.lr=1e-3", "trainer.warmup_ratio=0", "eval.enabled=false"]


def dump(config, log):
    """What python -m specforge_lite.offline dump does."""
    return dump_run(Run.online(config, log=lambda m: None), log=log)


def _train(overrides, run_dir):
    from specforge_lite.job import run

    run(load_config([*overrides, f"output_dir={run_dir}"]), run_dir, log=lambda m: None)
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(run_dir):
    from safetensors.torch import load_file

    return load_file(run_dir / "final" / "model.safetensors")


def _store_tensors(folder):
    reader = StoreReader(folder)
    return [reader.sample(i) for i in range(len(reader))]


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory):
    folder = tmp_path_factory.mktemp("store") / "tiny"
    dump(load_config([*TINY, f"store.path={folder}", "store.dtype=float32", "store.samples_per_shard=10"]),
         log=lambda m: None)
    return folder


def test_training_from_a_store_equals_training_online(tmp_path, tiny_store):
    """Same data, seed and steps: identical losses and final weights (fp32 store; bf16 rounds the states).
    On the real SmolLM2 tests/test_serving.py trains from a store of vLLM's own extraction the same way."""
    base, store = TINY, tiny_store
    online = _train([*base, *TRAIN], tmp_path / "online")
    offline = _train([*base, *TRAIN, "data.source=offline", f"data.store={store}"], tmp_path / "offline")
    assert [m["loss"] for m in offline] == pytest.approx([m["loss"] for m in online], rel=1e-6)
    assert any(m["loss"] > 0 for m in online)
    a, b = _weights(tmp_path / "online"), _weights(tmp_path / "offline")
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=1e-5, atol=1e-7), name


def test_a_killed_dump_resumes_to_the_same_store(tmp_path, tiny_store, monkeypatch):
    from specforge_lite.targets import store as store_mod

    folder = tmp_path / "store"
    config = load_config([*TINY, f"store.path={folder}", "store.dtype=float32", "store.samples_per_shard=10"])
    real_flush, calls = store_mod.ShardWriter.flush, []

    def dying_flush(self):
        if len(calls) == 1:  # the second shard: a half-written file, then the process dies
            (self.folder / "shard_00001.safetensors.tmp").write_bytes(b"partial")
            raise KeyboardInterrupt
        calls.append(1)
        real_flush(self)

    monkeypatch.setattr(store_mod.ShardWriter, "flush", dying_flush)
    with pytest.raises(KeyboardInterrupt):
        dump(config, log=lambda m: None)
    assert json.loads((folder / "manifest.json").read_text())["num_samples"] == 10  # only the complete shard
    monkeypatch.setattr(store_mod.ShardWriter, "flush", real_flush)
    messages = []
    dump(config, log=messages.append)
    assert any("10 samples already stored" in m for m in messages)
    assert not list(folder.glob("*.tmp"))
    got, want = _store_tensors(folder), _store_tensors(tiny_store)
    assert len(got) == len(want) == 24
    for g, w in zip(got, want):
        for k in w:
            assert torch.equal(g[k], w[k]), k


def test_a_dump_split_across_two_ranks_merges_to_the_one_process_store(tmp_path, tiny_store):
    """torchrun --nproc_per_node 2 -m specforge_lite.offline dump: each rank captures its half of the samples
    into its own part and rank 0 merges them. The merged store holds the one-process dump's samples
    (tiny_store, same settings) in the same order: ids, masks and flags equal, states within 1e-5 (the
    ranks batch other rows together, so the padded shapes differ), and the target's parts are equal."""
    import subprocess

    folder = tmp_path / "split"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "specforge_lite.offline", "dump", *TINY, f"store={folder}", "store.dtype=float32",
           "store.samples_per_shard=10"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert {s["file"].split("/")[0] for s in manifest["shards"]} == {"rank-000-of-002", "rank-001-of-002"}
    one, two = _store_tensors(tiny_store), _store_tensors(folder)
    assert len(one) == len(two) == manifest["num_samples"]
    for a, b in zip(one, two):
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-5, msg=key)
    parts_one, parts_two = StoreReader(tiny_store).parts(), StoreReader(folder).parts()
    assert parts_one.keys() == parts_two.keys() and all(torch.equal(parts_one[k], parts_two[k]) for k in parts_one)


def test_bad_stores_are_named(tmp_path, tiny_store):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_store, broken)
    shard = broken / "shard_00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    reader = StoreReader(broken)
    reader.sample(0)  # shard 0 is intact
    with pytest.raises(StoreError, match="shard_00001.safetensors is corrupted"):
        reader.sample(15)
    from specforge_lite.offline import StoreTarget

    with pytest.raises(StoreError, match=r"aux ids \[2, 4, 5\] stored.*draft.aux_layer_ids=\[2, 4, 5\]"):
        StoreTarget.open(load_config([*TINY, "draft.aux_layer_ids=[1,3,5]", "data.source=offline",
                                      f"data.store={tiny_store}"]))
    with pytest.raises(StoreError, match="not a hidden-state store"):
        StoreReader(tmp_path / "nothing")


def test_ingest_takes_its_arguments_in_the_order_the_docs_write_them(tmp_path, capsys):
    """docs/offline.md writes --layer-ids after the source folder, then the overrides: argparse refused that as
    "unrecognized arguments". Taken now, the command goes on to say the folder is missing."""
    from specforge_lite.offline.__main__ import main

    with pytest.raises(SystemExit) as ended:
        main(["ingest", "--from", "vllm", str(tmp_path / "hidden_states"), "--layer-ids", "2,4,5,8", *TINY,
              f"store={tmp_path / 'store'}"])
    assert str(ended.value.code).startswith(f"error: {tmp_path / 'hidden_states'} is not a folder of vllm"), \
        (ended.value.code, capsys.readouterr().err)


def test_data_settings_a_store_holds_otherwise_are_refused(tiny_store):
    """A store holds the rows it was made with: other data.max_length, max_samples, heldout_samples or loss_turns
    went unread (rows of 96 tokens trained under data.max_length=32, all of them under data.max_samples=2)."""
    from specforge_lite.offline import StoreTarget

    store = ["data.source=offline", f"data.store={tiny_store}"]
    StoreTarget.open(load_config([*TINY, *store]))  # (the dump's own settings)
    with pytest.raises(StoreError, match=r"does not fit this run: data.max_length=32 and data.max_samples=2 given, "
                                         r"the store was made with data.max_length=96 and data.max_samples=24 \(its "
                                         r"rows are those it was made with: set those, or dump again\)"):
        StoreTarget.open(load_config([*TINY, *store, "data.max_length=32", "data.max_samples=2"]))
    with pytest.raises(StoreError, match=r"data.loss_turns=last given, the store was made with data.loss_turns=all"):
        StoreTarget.open(load_config([*TINY, *store, "data.loss_turns=last"]))


def test_a_store_trained_run_continues_the_draft_it_is_given(tmp_path, tiny_store):
    """draft.init_from with data.source=offline trained a new draft, the recipe line and data_stats.json saying it
    continued the given one. At lr 0 the continued draft comes out as it went in; one of other aux ids than the
    store's is refused by name."""
    store = ["data.source=offline", f"data.store={tiny_store}"]
    first, again = tmp_path / "first", tmp_path / "again"
    _train([*TINY, *TRAIN, *store], first)
    _train([*TINY, *TRAIN, *store, "trainer.lr=0", "trainer.max_steps=2", f"draft.init_from={first}"], again)
    a, b = _weights(first), _weights(again)
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    config = json.loads((first / "final" / "config.json").read_text())
    ours = config["specforge_lite"]  # (a draft of other aux ids, wherever its config.json names them)
    config["eagle_aux_hidden_state_layer_ids"] = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = \
        ours["aux_layer_ids"] = ours["spec"]["aux_layer_ids"] = [1, 3, 5]
    (first / "final" / "config.json").write_text(json.dumps(config))
    with pytest.raises(StoreError, match=rf"draft.init_from={first} reads aux ids \[1, 3, 5\] and the store holds "
                                         rf"\[2, 4, 5\] \(make the store with draft.init_from={first}\)"):
        _train([*TINY, *TRAIN, *store, f"draft.init_from={first}"], tmp_path / "other")


def _reference_states(target, ids, ids_to_capture):
    """Independent of our capture: HF output_hidden_states (input of layer i = entry i) and a pre-hook on
    the final norm for id L (HF's last entry is after the norm)."""
    seen = {}
    norm = target.family.final_norm(target.model)
    handle = norm.register_forward_pre_hook(lambda m, args: seen.__setitem__("x", args[0]))
    try:
        with torch.no_grad():
            out = target.model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    finally:
        handle.remove()
    L = target.num_layers
    return torch.stack([out.hidden_states[i][0] if i < L else seen["x"][0] for i in ids_to_capture], dim=1)


@pytest.mark.parametrize("kind", ["vllm", "speculators"])
def test_an_extraction_ingests_to_what_our_dump_stores(kind, tmp_path, tiny_store):
    config = load_config([*TINY, f"store.path={tmp_path / 'store'}", "store.dtype=float32"])
    run = Run.online(config, log=lambda m: None)
    target, data = run.target, run.data
    src = tmp_path / "extraction"
    src.mkdir()
    layer_ids = [2, 4, 5, 8]  # vLLM was given the aux ids and id L (= 8 layers): the pre-norm final state
    for i, row in enumerate(data.train):
        ids = torch.tensor(row["input_ids"])
        hs = _reference_states(target, ids, layer_ids)  # [T, 4, H]
        if kind == "vllm" and i % 2:
            hs = hs.transpose(0, 1).contiguous()  # the older [n_ids, T, H] layout
        name = f"req-{i:03d}.safetensors" if kind == "vllm" else f"hs_{i}.safetensors"
        save_file({"hidden_states": hs, "token_ids": ids}, str(src / name))
    unknown = torch.randint(0, 1000, (12,))
    save_file({"hidden_states": _reference_states(target, unknown, layer_ids), "token_ids": unknown},
              str(src / ("zzz-unknown.safetensors" if kind == "vllm" else "hs_999.safetensors")))
    # as python -m specforge_lite.offline ingest runs it: the target's embedding, final norm and lm_head
    # read from its safetensors, every layer left unread on the meta device
    parts = Run.online(config, log=lambda m: None, parts_only=True)
    assert all(p.is_meta for p in parts.target.family.layers(parts.target.model).parameters())
    assert not parts.target.family.embedding(parts.target.model).weight.is_meta
    ingest(parts, kind, src, layer_ids, log=lambda m: None)
    got, want = _store_tensors(tmp_path / "store"), _store_tensors(tiny_store)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g["input_ids"], w["input_ids"]) and torch.equal(g["loss_mask"], w["loss_mask"])
        assert torch.equal(g["in_vocab"], w["in_vocab"])
        for k in ("aux", "final"):
            assert torch.allclose(g[k], w[k], rtol=1e-5, atol=1e-5), k
    with safe_open(str(tmp_path / "store" / "target_parts.safetensors"), "pt") as f, \
            safe_open(str(tiny_store / "target_parts.safetensors"), "pt") as g:
        assert all(torch.equal(f.get_tensor(k), g.get_tensor(k)) for k in g.keys())


def test_a_locked_vllm_file_is_skipped(tmp_path):
    import fcntl

    from specforge_lite.offline.ingest import read_extraction

    path = tmp_path / "req.safetensors"
    save_file({"hidden_states": torch.zeros(3, 2, 4), "token_ids": torch.arange(3)}, str(path))
    with open(str(path) + ".lock", "wb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the writer still holds it
        assert read_extraction(path) is None
    ids, hs = read_extraction(path)
    assert ids.tolist() == [0, 1, 2] and hs.shape == (3, 2, 4)
    os.remove(str(path) + ".lock")


def test_a_topk_store_is_smaller_and_keeps_the_teachers_argmax(tmp_path, tiny_store):
    """store.teacher=topk drops the final state for the teacher's top-k logits: fewer bytes, the same
    argmax (so the same first-step accuracy as online), a renormalised top-k distribution."""
    topk = tmp_path / "topk"
    dump(load_config([*TINY, f"store.path={topk}", "store.dtype=float32", "store.teacher=topk", "store.topk=8"]),
         log=lambda m: None)
    size = lambda d: sum(f.stat().st_size for f in d.glob("shard_*.safetensors"))  # noqa: E731
    assert size(topk) < 0.9 * size(tiny_store)
    online = _train([*TINY, *TRAIN, "trainer.max_steps=1"], tmp_path / "online")
    offline = _train([*TINY, *TRAIN, "trainer.max_steps=1", "data.source=offline", f"data.store={topk}"],
                     tmp_path / "offline")
    assert offline[0]["acc_0"] == online[0]["acc_0"]
    assert offline[0]["loss"] == pytest.approx(online[0]["loss"], rel=0.2)
    with pytest.raises(StoreError, match="other settings"):  # the same folder cannot switch teacher kind
        dump(load_config([*TINY, f"store.path={topk}", "store.dtype=float32"]), log=lambda m: None)


def test_shard_order_reads_one_shard_at_a_time_and_resumes(tiny_store):
    """data.store_order=shard: an epoch is every sample once, each shard's samples together (one shard
    switch per shard boundary, shards and rows in a seeded shuffled order that changes per epoch), and a
    stream restored from its state_dict continues with the same batches."""
    from specforge_lite.data.loader import BatchStream

    reader = StoreReader(tiny_store)
    blocks = reader.shard_ranges()
    assert [len(b) for b in blocks] == [s["samples"] for s in reader.manifest.shards] and len(blocks) > 1
    shard_of = {i: k for k, b in enumerate(blocks) for i in b}

    stream = BatchStream(reader, 2, 0, seed=3, blocks=blocks)
    first = list(stream._order)
    assert sorted(first) == list(range(len(reader)))
    switches = sum(shard_of[a] != shard_of[b] for a, b in zip(first, first[1:]))
    assert switches == len(blocks) - 1
    assert first != list(range(len(reader)))  # shuffled inside the shards
    for _ in range(len(reader) // 2 + 1):  # through the epoch, into the next
        next(stream)
    assert stream.epoch == 1 and stream._order != first and sorted(stream._order) == sorted(first)
    state = stream.state_dict()
    resumed = BatchStream(reader, 2, 0, seed=3, blocks=blocks)
    resumed.load_state_dict(state)
    for _ in range(3):
        assert torch.equal(next(resumed).input_ids, next(stream).input_ids)
