"""Sequence packing (data.packing): packed rows give the same loss, metrics and gradients as the same
conversations unpacked, on both target backends and on a sliding-window family."""

from __future__ import annotations

import pytest
import torch

from specforge_lite.methods.eagle3.settings import Eagle3Settings
from specforge_lite.compose import load_config
from specforge_lite.data.loader import BatchStream, collate, collate_packed, pack
from specforge_lite.data.vocab import DraftVocab
from specforge_lite.methods.eagle3.objective import TTTObjective
from specforge_lite.methods import draft_spec
from specforge_lite.methods.eagle3.model import Eagle3Draft
from specforge_lite.targets import build_target
from specforge_lite.targets import Teacher

CFG = Eagle3Settings(ttt_length=4)


def conversations(vocab: int, lengths=(21, 9, 26, 14, 7, 18), seed: int = 0) -> list[dict]:
    """Rows with a prompt (no loss) then an answer (loss), longer than the tiny presets' 16-token windows."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        prompt = int(torch.randint(2, 6, (1,), generator=g))
        rows.append({"input_ids": torch.randint(0, vocab, (n,), generator=g).tolist(),
                     "loss_mask": [0] * prompt + [1] * (n - prompt)})
    return rows


def make_draft(target, seed: int = 0) -> Eagle3Draft:
    # the whole vocabulary: every target argmax is in it, so every answer token is scored
    vocab = DraftVocab(torch.arange(target.vocab_size), target.vocab_size, float("nan"))
    spec = draft_spec(target.config, CFG, target.aux_layer_ids, target.convention, target.vocab_size,
                      vocab.size, target.hidden_size)
    torch.manual_seed(seed)
    draft = Eagle3Draft(spec)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    draft.set_embedding(target.embedding_weight())
    with torch.no_grad():  # a head that reads its input sharply, so the loss depends on what is attended
        draft.lm_head.weight.copy_(target.full_head()[0].float() * 30)
    return draft


def test_pack_is_first_fit_in_order_and_keeps_every_token():
    rows = conversations(100)
    bins = pack(rows, 32)
    assert [[len(r["input_ids"]) for r in b] for b in bins] == [[21, 9], [26], [14, 7], [18]]
    batch = collate_packed(rows, 0, 32)
    assert batch.input_ids.shape == (4, 30)
    assert int(batch.attention_mask.sum()) == sum(len(r["input_ids"]) for r in rows)
    assert batch.position_ids[0, :30].tolist() == list(range(21)) + list(range(9))
    assert batch.loss_mask[0, 21:30].tolist() == rows[1]["loss_mask"]


@pytest.mark.parametrize("preset,backend", [("llama3_tiny", "hf"), ("llama3_tiny", "lean"), ("gemma3_tiny", "hf"),
                                            ("gemma3_tiny", "lean")])
def test_packed_and_unpacked_losses_are_equal(preset, backend):
    target = build_target(load_config([f"model={preset}", "tracker=none", f"target.backend={backend}"]))
    draft = make_draft(target)
    teacher, objective = Teacher(target, draft.draft_vocab_ids(), draft.t2d), TTTObjective.from_config(CFG)
    rows = conversations(target.vocab_size)
    unpacked = collate(rows, 0)
    packed = collate_packed(rows, 0, 32)
    assert packed.input_ids.shape[0] < unpacked.input_ids.shape[0]

    def run(batch):
        draft.zero_grad()
        out = objective(draft, teacher, batch)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}

    (ref, ref_grads), (got, got_grads) = run(unpacked), run(packed)
    assert int(ref.steps[-1].valid) > 40
    assert [int(s.valid) for s in got.steps] == [int(s.valid) for s in ref.steps]
    assert [int(s.correct) for s in got.steps] == [int(s.correct) for s in ref.steps]
    assert torch.allclose(got.loss, ref.loss, rtol=1e-5, atol=1e-6), (float(got.loss), float(ref.loss))
    for a, b in zip(got.steps, ref.steps):
        assert abs(float(a.loss) - float(b.loss)) <= 1e-5 * abs(float(b.loss)), (float(a.loss), float(b.loss))
    for name, g in ref_grads.items():
        assert torch.allclose(got_grads[name], g, rtol=1e-4, atol=1e-6), name

    # The same packed rows read as one sequence each (no position ids) give another loss: the equality
    # above holds because attention and TTT targets stop at conversation boundaries.
    packed.position_ids = None
    leaked = objective(draft, teacher, packed)
    assert max(abs(float(a.loss) - float(b.loss)) for a, b in zip(leaked.steps, ref.steps)) > 1e-3


def test_packing_is_refused_where_conversations_cannot_be_kept_apart():
    from specforge_lite.run import packing_length

    config = load_config(["model=qwen3_next_tiny", "tracker=none", "data.packing=true"])
    target = build_target(config)
    with pytest.raises(ValueError, match="data.packing=false"):
        packing_length(config, target)
    with pytest.raises(ValueError, match="packed rows"):
        target.capture(torch.tensor([[1, 2, 3, 4]]), None, position_ids=torch.tensor([[0, 1, 0, 1]]))


# ---- token-budget micro-batches (trainer.micro_batch_tokens) ------------------------------------------------------
def budget_stream(rows, budget: int, **kw) -> BatchStream:
    return BatchStream(rows, 1, pad_id=0, seed=kw.pop("seed", 3), token_budget=budget, **kw)


def conversations_in(batch) -> list[list[int]]:
    """The conversations of a packed batch's rows, each as its token ids (cut where position ids restart)."""
    found = []
    for ids, pos, att in zip(batch.input_ids.tolist(), batch.position_ids.tolist(), batch.attention_mask.tolist()):
        for t, p, a in zip(ids, pos, att):
            if not a:
                break
            if p == 0:
                found.append([])
            found[-1].append(t)
    return found


MIXED = conversations(1000, lengths=[int(n) for n in torch.randint(6, 48, (61,), generator=torch.Generator()
                                                                   .manual_seed(1))])


def test_budget_groups_fill_one_row_within_the_budget_and_take_every_conversation_once_per_epoch():
    stream = budget_stream(MIXED, 64)
    seen, sizes = [], []
    while stream.epoch == 0:
        before = list(stream._order[stream.cursor:])
        batch = next(stream)
        if stream.epoch:
            break
        got = conversations_in(batch)
        assert batch.input_ids.shape[0] == 1 and batch.num_tokens <= 64
        # each group takes the order's next conversations while they fit: the next one would pass the budget
        assert got == [MIXED[i]["input_ids"] for i in before[:len(got)]]
        if len(got) < len(before):
            assert batch.num_tokens + len(MIXED[before[len(got)]]["input_ids"]) > 64
        seen += got
        sizes.append(len(got))
    assert sorted(map(tuple, seen)) == sorted(tuple(r["input_ids"]) for r in MIXED)
    assert max(sizes) > 2 and len(sizes) == stream.micro_batches_per_epoch()
    # epochs -> steps: the groups over accumulation and ranks
    from specforge_lite.job import steps_per_epoch

    config = load_config(["trainer.grad_accum_steps=2"])
    assert steps_per_epoch(config, len(MIXED), 1, len(sizes)) == len(sizes) / 2


def test_budget_groups_resume_mid_epoch_exactly():
    stream = budget_stream(MIXED, 80)
    for _ in range(5):
        next(stream)
    state = stream.state_dict()
    expected = [conversations_in(next(stream)) for _ in range(20)]  # (past the epoch's end)
    resumed = budget_stream(MIXED, 80)
    resumed.load_state_dict(state)
    assert [conversations_in(next(resumed)) for _ in range(20)] == expected


def test_two_ranks_take_disjoint_budget_groups_whose_union_is_one_processes():
    one = budget_stream(MIXED, 64)
    single = [conversations_in(next(one)) for _ in range(one.micro_batches_per_epoch())]
    ranks = [budget_stream(MIXED, 64, rank=r, world_size=2) for r in range(2)]
    assert ranks[0].micro_batches_per_epoch() == len(single) - len(single) % 2
    for step in range(len(single) // 2):
        mine = [conversations_in(next(s)) for s in ranks]
        assert mine == single[2 * step : 2 * step + 2]
        assert ranks[0].state_dict() == ranks[1].state_dict()  # (one position, shared by the ranks)


def test_a_budget_group_loses_what_its_conversations_lose_unpacked():
    target = build_target(load_config(["model=llama3_tiny", "tracker=none", "target.backend=hf"]))
    draft = make_draft(target)
    teacher, objective = Teacher(target, draft.draft_vocab_ids(), draft.t2d), TTTObjective.from_config(CFG)
    rows = conversations(target.vocab_size)
    group = next(budget_stream(rows, 128, shuffle=False))
    assert group.input_ids.shape == (1, sum(len(r["input_ids"]) for r in rows))
    # one micro-batch of these conversations, unpacked: the same token mean (each token 1 / scored tokens)
    ref, got = objective(draft, teacher, collate(rows, 0)), objective(draft, teacher, group)
    assert [int(s.valid) for s in got.steps] == [int(s.valid) for s in ref.steps]
    assert torch.allclose(got.loss, ref.loss, rtol=1e-5, atol=1e-6), (float(got.loss), float(ref.loss))


@pytest.mark.parametrize("overrides, named", [
    (["trainer.micro_batch_tokens=256", "trainer.micro_batch_size=1"], "below data.max_length=384"),
    (["trainer.micro_batch_tokens=1024", "trainer.micro_batch_size=2"], "set trainer.micro_batch_size=1"),
    (["trainer.micro_batch_tokens=1024", "trainer.micro_batch_size=1", "data.packing=true"], "set data.packing=false"),
    (["model=qwen3_next_tiny", "trainer.micro_batch_tokens=1024", "trainer.micro_batch_size=1"], "qwen3_next family"),
    (["draft=dflash", "trainer.micro_batch_tokens=1024", "trainer.micro_batch_size=1"], "a dflash draft"),
    (["data.source=offline", "data.store=/nowhere", "trainer.micro_batch_tokens=1024", "trainer.micro_batch_size=1"],
     "hidden-state store"),
])
def test_a_budget_that_cannot_run_is_refused_in_one_line(overrides, named):
    from specforge_lite.settings import token_budget_problems

    problems = token_budget_problems(load_config(["model=qwen3_tiny", *overrides]))
    assert len(problems) == 1 and named in problems[0] and "\n" not in problems[0], problems
    assert "trainer.micro_batch_tokens=" in problems[0]
    assert not token_budget_problems(load_config(["model=qwen3_tiny", "trainer.micro_batch_tokens=1024",
                                                  "trainer.micro_batch_size=1"]))


def test_the_scale_recipe_budgets_tokens_where_rows_pack_and_says_where_they_do_not():
    from specforge_lite.job import describe_recipe
    from specforge_lite.methods import draft_method
    from specforge_lite.settings import token_budget_problems

    config = load_config(["model=llama3_8b"])
    assert (config.recipe_name, config.trainer.micro_batch_tokens) == ("scale", 8192)
    assert config.trainer.micro_batch_tokens >= config.data.max_length and not token_budget_problems(config)
    assert "micro-batch(es) of up to 8192 tokens" in describe_recipe(config, draft_method("eagle3"))[0]
    for overrides in (["model=qwen3_next"], ["model=llama3_8b", "draft=dflash"]):
        config = load_config(overrides)
        assert config.trainer.micro_batch_tokens is None and not token_budget_problems(config)
        said = describe_recipe(config, draft_method(config.draft.method))
        assert "1 conversation(s) per step" in said[0] and "one conversation per micro-batch" in said[-1]
    # the recipe's budget holds a whole conversation, and steps aside for data.packing=true (count-sized micro-batches)
    assert load_config(["model=llama3_8b", "data.max_length=16384"]).trainer.micro_batch_tokens == 16384
    assert load_config(["model=llama3_8b", "data.packing=true"]).trainer.micro_batch_tokens is None
    # a budget given is used as given, and refused where rows cannot pack
    given = load_config(["model=qwen3_next", "trainer.micro_batch_tokens=4096"])
    assert given.trainer.micro_batch_tokens == 4096 and token_budget_problems(given)


def test_a_run_of_one_epoch_in_budget_micro_batches_trains_on_every_token_once(tmp_path):
    import json

    from specforge_lite import job

    said = []
    config = load_config(["model=llama3_tiny", "recipe=none", "tracker=none", "data.max_samples=24",
                          "data.max_length=256", "data.heldout_samples=4", "trainer.micro_batch_size=1",
                          "trainer.micro_batch_tokens=1024", "trainer.epochs=1", "trainer.progress_bar=false",
                          "trainer.save_every=0", "eval.enabled=false", "draft.ttt_length=2",
                          "draft.draft_vocab_size=2048"])
    job.run(config, tmp_path, log=said.append)
    line = next(s for s in said if s.startswith("[train] 1 epochs"))
    groups = int(line.split(" in ")[1].split()[0])
    assert f"in {groups} micro-batches of up to 1024 tokens: {groups} steps" in line, line
    assert any("1 micro-batch(es) of up to 1024 tokens per step" in s for s in said if s.startswith("[recipe]"))
    stats = json.loads((tmp_path / "data_stats.json").read_text())
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert stats["train_tokens"] / 1024 <= groups < stats["train"] and last["step"] == groups
    assert last["tokens_seen"] == stats["train_tokens"] and last["epoch"] == 1  # every conversation, once
