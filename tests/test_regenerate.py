"""Regeneration: semantics, resume after a kill, batched generation = one-by-one greedy, held-out hygiene."""

from __future__ import annotations

import json

import pytest
import torch

from specforge_lite.config import DataConfig, GenerationConfig
from specforge_lite.data import prepare_data
from specforge_lite.data.regenerate import regenerate

CONVS = [
    [{"role": "user", "content": f"q{i}a"}, {"role": "assistant", "content": f"human answer {i}"},
     {"role": "user", "content": f"q{i}b"}, {"role": "assistant", "content": f"human answer {i}b"}]
    for i in range(7)
]


class Recorder:
    """A fake target: answers name the prompt they saw, so the conditioning is visible."""

    def __init__(self, die_after=None):
        self.prompts, self.calls, self.die_after = [], 0, die_after

    def __call__(self, batch):
        if self.die_after is not None and self.calls >= self.die_after:
            raise KeyboardInterrupt("killed")
        self.calls += 1
        self.prompts += batch
        return [f"model says: {' | '.join(m['content'] for m in conv)}" for conv in batch]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFORGE_LITE_CACHE", str(tmp_path / "cache"))


def test_context_all_regenerates_every_turn_in_order():
    out, stats = regenerate(CONVS, Recorder(), GenerationConfig(context="all", batch_size=3), "k1", log=lambda m: None)
    assert len(out) == 7 and stats["regenerated"] == 7
    first, second = out[0][1]["content"], out[0][3]["content"]
    assert first == "model says: q0a"
    # the second answer was conditioned on the conversation with the first answer already regenerated
    assert second == "model says: q0a | model says: q0a | q0b"
    assert all(m["content"].startswith("model says") for c in out for m in c if m["role"] == "assistant")


def test_context_last_and_max_turns():
    out, _ = regenerate(CONVS, Recorder(), GenerationConfig(context="last", batch_size=4), "k2", log=lambda m: None)
    assert len(out) == 14
    assert out[1] == [{"role": "user", "content": "q0b"}, {"role": "assistant", "content": "model says: q0b"}]
    out, _ = regenerate(CONVS, Recorder(), GenerationConfig(context="all", max_turns=1, max_conversations=5),
                        "k3", log=lambda m: None)
    assert len(out) == 5 and all(len(c) == 2 for c in out)


def test_the_answers_made_and_their_rate_are_counted_and_said():
    """The rate a user multiplies by their data size: answers (not conversations) per second, this call's own
    (answers a killed run had journaled are read back, not counted)."""
    said = []
    dying = Recorder(die_after=2)
    with pytest.raises(KeyboardInterrupt):
        regenerate(CONVS, dying, GenerationConfig(context="all", batch_size=2), "rate", log=said.append)
    _, stats = regenerate(CONVS, Recorder(), GenerationConfig(context="all", batch_size=2), "rate", log=said.append)
    assert stats["answers"] == len(CONVS) * 2 - 2 * 2 and stats["seconds"] > 0
    assert stats["answers_per_s"] == stats["answers"] / stats["seconds"]
    line = said[-1]
    assert line.startswith(f"[regenerate] {stats['answers']} answers in ") and "answers/s" in line, said


def test_empty_answers_are_counted_and_cut():
    def shy(batch):
        return ["" if conv[-1]["content"].endswith("b") else "ok" for conv in batch]

    out, stats = regenerate(CONVS, shy, GenerationConfig(context="all"), "k4", log=lambda m: None)
    assert stats["empty_answers"] == 7 and all(len(c) == 2 for c in out)


def test_resume_after_kill_regenerates_only_what_is_missing():
    cfg = GenerationConfig(context="all", batch_size=2)
    straight, _ = regenerate(CONVS, Recorder(), cfg, "ref", log=lambda m: None)
    dying = Recorder(die_after=3)  # two turns per batch: dies inside the second batch
    with pytest.raises(KeyboardInterrupt):
        regenerate(CONVS, dying, cfg, "run", log=lambda m: None)
    again = Recorder()
    resumed, _ = regenerate(CONVS, again, cfg, "run", log=lambda m: None)
    assert resumed == straight
    # every answer given before the kill was kept, not only the finished shard's: 3 calls x 2 answers
    assert len(again.prompts) == len(CONVS) * 2 - 3 * 2
    assert not any(p in dying.prompts for p in again.prompts)


def test_a_journaled_answer_to_another_prompt_is_asked_again():
    """The journal names the prompt each answer was given to: where the conversations before it changed (a
    different first turn here), its answers are not attached to prompts they never answered."""
    cfg = GenerationConfig(context="all", batch_size=2)
    with pytest.raises(KeyboardInterrupt):
        regenerate(CONVS, Recorder(die_after=3), cfg, "changed", log=lambda m: None)
    changed = [[{**m, "content": m["content"] + " (edited)"} if i == 0 else m for i, m in enumerate(c)] for c in CONVS]
    again, said = Recorder(), []
    out, _ = regenerate(changed, again, cfg, "changed", log=said.append)
    assert any(line.startswith("[regenerate] 2 journaled answers were given to prompts") for line in said), said
    # (the first batch's shard was written whole before the kill and is reused as cached under this key; the
    # journal held the first answers of conversations 2 and 3, given to their old first turns)
    assert [c[1]["content"] for c in out[2:]] == [f"model says: q{n}a (edited)" for n in range(2, 7)], out
    assert [p[0]["content"] for p in again.prompts[:2]] == ["q2a (edited)", "q3a (edited)"], again.prompts


def test_sampled_resume_draws_what_an_uninterrupted_run_draws():
    """Sampling uses torch's generator; seeding per shard makes a resumed run identical."""
    state = {"calls": 0}

    def sampler(batch):
        state["calls"] += 1
        if state.get("die_at") == state["calls"]:
            raise KeyboardInterrupt("killed")
        return [f"draw {torch.rand(1).item():.6f}" for _ in batch]

    cfg = GenerationConfig(context="all", max_turns=1, batch_size=2, temperature=0.7)
    straight, _ = regenerate(CONVS, sampler, cfg, "ref-s", log=lambda m: None)
    state.update(calls=0, die_at=3)
    with pytest.raises(KeyboardInterrupt):
        regenerate(CONVS, sampler, cfg, "run-s", log=lambda m: None)
    state.update(calls=0, die_at=None)
    torch.manual_seed(12345)  # whatever the global state is when the run comes back
    resumed, _ = regenerate(CONVS, sampler, cfg, "run-s", log=lambda m: None)
    assert resumed == straight


def test_heldout_openings_never_reach_training(tmp_path, smollm2):
    _, _, tok = smollm2
    rows = [{"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": f"hello {i}"}]}
            for i in range(20)]
    rows += [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"a{i}"}]}
             for i in range(20)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = prepare_data(DataConfig(source="path", path=str(tmp_path / "d.jsonl"), heldout_samples=10), tok,
                        log=lambda m: None)
    held = {tok.decode(p) for p in data.heldout_prompts}
    train_text = [tok.decode(ids) for ids in data.train["input_ids"]]
    assert held and not any(any(t.startswith(h) for h in held) for t in train_text)
    assert data.stats["heldout_overlap_removed"] > 0


def test_training_data_and_vocab_come_from_the_regenerated_answers(tmp_path, smollm2):
    from specforge_lite.data.vocab import count_loss_tokens

    _, target, tok = smollm2
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "human text"}]}
            for i in range(12)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = prepare_data(DataConfig(source="path", path=str(tmp_path / "d.jsonl"), heldout_samples=2, regenerate=True),
                        tok, generate=lambda b: ["Photosynthesis converts light." for _ in b], model_fingerprint="fake",
                        log=lambda m: None)
    texts = [tok.decode(ids) for ids in data.train["input_ids"]]
    assert all("Photosynthesis" in t and "human text" not in t for t in texts)
    counts = count_loss_tokens(data.train["input_ids"], data.train["loss_mask"], target.vocab_size)
    assert counts[tok("Photosynthesis", add_special_tokens=False)["input_ids"][0]] == len(texts)
    assert data.stats["regeneration"]["regenerated"] == 10


def test_batched_generation_equals_one_by_one_greedy(smollm2):
    from specforge_lite.evaluate.spec_decode import greedy_generate
    from specforge_lite.generation import HFGenerator, stop_ids

    _, target, tok = smollm2
    convs = [[{"role": "user", "content": q}] for q in ["Name a fruit.", "What is 2+2? Answer briefly please.", "Hi!"]]
    stops = stop_ids(tok, target)
    gen = HFGenerator(target.model, tok, max_new_tokens=20, stop_ids=stops)
    batched = gen(convs)
    for conv, answer in zip(convs, batched):
        prompt = tok(tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
        alone = greedy_generate(target, prompt, 20, stops)
        assert answer == tok.decode([t for t in alone if t not in stops], skip_special_tokens=True).strip()
    assert gen.tokens_generated > 0


def test_a_larger_regeneration_cap_prepares_more_conversations(tmp_path, smollm2):
    # The regenerated answers are cached by prefix (a larger cap reuses them), but the prepared data holds as
    # many conversations as the cap: raising data.generation.max_conversations must not reuse the smaller set.
    _, _, tok = smollm2
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "human"}]}
            for i in range(12)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sizes = []
    for cap in (4, 8):
        cfg = DataConfig(source="path", path=str(tmp_path / "d.jsonl"), heldout_samples=2, regenerate=True,
                         generation=GenerationConfig(max_conversations=cap))
        data = prepare_data(cfg, tok, generate=lambda b: ["An answer." for _ in b], model_fingerprint="fake",
                            log=lambda m: None)
        sizes.append(len(data.train))
    assert sizes == [4, 8]


def _question_file(tmp_path, n: int):
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "human"}]}
            for i in range(n)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(tmp_path / "d.jsonl")


@pytest.mark.parametrize("batch_size", [4, 3])
def test_rounds_of_answers_while_there_is_time_ask_for_each_answer_once(tmp_path, smollm2, batch_size):
    # data.generation.max_minutes with room for every round: rounds of 4 up to 10, each a longer prefix of one
    # order, so every training question is asked exactly once and the data holds all 10; also where a round ends
    # inside a batch (3: the next round's longer batch reads the answers of the shorter one it extends).
    _, _, tok = smollm2
    asked = []
    cfg = DataConfig(source="path", path=_question_file(tmp_path, 14), heldout_samples=2, regenerate=True,
                     generation=GenerationConfig(max_conversations=10, round_conversations=4, max_minutes=60,
                                                 batch_size=batch_size))
    data = prepare_data(cfg, tok, generate=lambda b: asked.extend(c[0]["content"] for c in b) or
                        ["An answer." for _ in b], model_fingerprint="fake", log=lambda m: None)
    assert len(data.train) == 10 and data.stats["regeneration"]["rounds"] == 3
    assert len(asked) == 12 and len(set(asked)) == 12, asked  # (10 training questions, 2 held-out)
    regen = data.stats["regeneration"]  # every round's training answers and time, not the last round's alone
    assert regen["answers"] == 10 and regen["answers_per_s"] == 10 / regen["seconds"], regen


def test_rounds_stop_when_the_next_would_end_past_the_budget_and_the_next_run_goes_on(tmp_path, smollm2):
    import time

    _, _, tok = smollm2
    asked, said = [], []

    def slow(batch):  # each call 0.3 s: a round of 4 (one call) cannot fit twice in 0.5 s
        time.sleep(0.3)
        asked.extend(c[0]["content"] for c in batch)
        return ["An answer." for _ in batch]

    cfg = DataConfig(source="path", path=_question_file(tmp_path, 14), heldout_samples=2, regenerate=True,
                     generation=GenerationConfig(max_conversations=12, round_conversations=4, max_minutes=0.5 / 60,
                                                 batch_size=4))
    first = prepare_data(cfg, tok, generate=slow, model_fingerprint="fake", log=said.append)
    assert len(first.train) == 4
    assert any("4 of data.generation.max_conversations=12 conversations answered" in m for m in said), said
    training_asked = len(asked) - 2  # (the held-out pair, asked once)
    second = prepare_data(cfg, tok, generate=slow, model_fingerprint="fake", log=said.append)
    # the first round comes from the cache (no question asked again), the second is answered, then time is up
    assert len(second.train) == 8 and len(asked) - 2 == training_asked + 4
    assert len(set(asked)) == len(asked)


@pytest.mark.parametrize("generation, regenerate, words", [
    (dict(round_conversations=4), True, "round_conversations is read only together with data.generation.max_minutes"),
    (dict(max_minutes=5.0), True, "max_minutes is read only together with data.generation.round_conversations"),
    (dict(max_minutes=5.0, round_conversations=4), True, "set data.generation.max_conversations"),
])
def test_rounds_settings_that_would_not_be_read_are_refused(generation, regenerate, words):
    from specforge_lite.data.sources import data_setting_problems

    problems = data_setting_problems(DataConfig(regenerate=regenerate, generation=GenerationConfig(**generation)))
    assert len(problems) == 1 and words in problems[0], problems


def test_regeneration_off_leaves_the_rounds_unread():
    """data.regenerate=false on a recipe that answers in rounds: no rounds, nothing refused (the natural command
    was refused, naming data.generation.max_minutes, which the user never set)."""
    from specforge_lite.data.sources import data_setting_problems

    rounds = GenerationConfig(max_minutes=5.0, round_conversations=4, max_conversations=12)
    assert data_setting_problems(DataConfig(regenerate=False, generation=rounds)) == []


# ---- requests that fail for good (a serving engine, after its client's retries) -------------------------------------
def _heldout_questions(n: int, held: int) -> list[str]:
    """Which of _question_file's questions the held-out split takes (its fixed shuffle)."""
    import random

    from specforge_lite.data.prepare import _HELDOUT_SEED

    order = list(range(n))
    random.Random(_HELDOUT_SEED).shuffle(order)
    return [f"question {i}" for i in order[:held]]


def _answering(asked: list, failing=()):
    """A fake target answering every question but those in ``failing``, whose requests fail for good."""
    from specforge_lite.data.regenerate import FailedAnswer

    def generate(batch):
        asked.extend(c[0]["content"] for c in batch)
        return [FailedAnswer("HTTP 500 after 8 retries: down") if c[0]["content"] in failing
                else f"Answer to {c[0]['content']}." for c in batch]

    return generate


def test_a_rerun_asks_again_for_exactly_the_failed_conversations_and_its_data_holds_them(tmp_path, smollm2,
                                                                                        monkeypatch):
    """Failed conversations are left out of one run's data, never frozen into the cache: the prepared data of a run
    with failures is kept apart as incomplete, and the same command asks for those conversations (and no other)."""
    from specforge_lite.data import prepare

    _, _, tok = smollm2
    held = _heldout_questions(22, 2)
    failing = {held[0], next(f"question {i}" for i in range(22) if f"question {i}" not in held)}
    cfg = DataConfig(source="path", path=_question_file(tmp_path, 22), heldout_samples=2, regenerate=True,
                     generation=GenerationConfig(batch_size=4, max_failed_fraction=0.5))
    asked = []
    first = prepare_data(cfg, tok, generate=_answering(asked, failing), model_fingerprint="fake", log=lambda m: None)
    assert (len(first.train), len(first.heldout)) == (19, 1) and len(asked) == 22

    # another rank of the same distributed run reads what rank 0 made (run.py has it wait for rank 0)
    monkeypatch.setattr(prepare, "_other_rank", lambda: True, raising=False)
    other = prepare_data(cfg, tok, generate=_answering(asked, set(asked)), model_fingerprint="fake",
                         log=lambda m: None)
    assert (len(other.train), len(other.heldout)) == (19, 1) and len(asked) == 22
    monkeypatch.setattr(prepare, "_other_rank", lambda: False, raising=False)

    asked.clear()
    second = prepare_data(cfg, tok, generate=_answering(asked), model_fingerprint="fake", log=lambda m: None)
    assert sorted(asked) == sorted(failing)  # those two alone, the answered ones come from the cache
    assert (len(second.train), len(second.heldout)) == (20, 2)
    assert second.stats["regeneration"]["failed_total"] == 0
    asked.clear()
    third = prepare_data(cfg, tok, generate=_answering(asked), model_fingerprint="fake", log=lambda m: None)
    assert asked == [] and len(third.train) == 20  # complete: published under the key, and reused as is


def test_heldout_failures_are_counted_in_the_stats_and_the_log(tmp_path, smollm2):
    _, _, tok = smollm2
    held = _heldout_questions(12, 2)
    cfg = DataConfig(source="path", path=_question_file(tmp_path, 12), heldout_samples=2, regenerate=True,
                     generation=GenerationConfig(max_failed_fraction=0.5))
    said = []
    data = prepare_data(cfg, tok, generate=_answering([], {held[1]}), model_fingerprint="fake", log=said.append)
    regen = data.stats["regeneration"]
    assert len(data.heldout) == 1 and regen["failed"] == 0 and regen["failed_total"] == 1
    assert regen["heldout"]["failed"] == 1 and regen["heldout"]["regenerated"] == 1
    assert [f["opening"] for f in regen["heldout"]["failed_conversations"]] == [held[1]]
    line = next(m for m in said if "failed after the retries" in m)
    assert "1 of 2 held-out conversations failed after the retries" in line and repr(held[1]) in line
    summary = next(m for m in said if m.startswith("[data]"))
    assert "1 held-out conversation left out after failed requests" in summary and "-incomplete" in summary


def test_the_failed_fraction_counts_both_splits_together(tmp_path, smollm2):
    """At the defaults (64 held-out conversations, max_failed_fraction 0.01), one held-out failure among 164
    conversations is within the share, not 1 of 64 over it; two are over it, and stop the run with one line."""
    from specforge_lite.data.regenerate import RegenerationFailed

    _, _, tok = smollm2
    held = _heldout_questions(164, 64)
    cfg = DataConfig(source="path", path=_question_file(tmp_path, 164), regenerate=True)
    data = prepare_data(cfg, tok, generate=_answering([], {held[5]}), model_fingerprint="fake", log=lambda m: None)
    assert (len(data.train), len(data.heldout)) == (100, 63)
    assert data.stats["regeneration"]["heldout"]["failed"] == 1

    cfg.generation.seed = 1  # (another key: nothing cached)
    with pytest.raises(RegenerationFailed) as stop:
        prepare_data(cfg, tok, generate=_answering([], {held[5], held[6]}), model_fingerprint="fake",
                     log=lambda m: None)
    message = str(stop.value)
    assert "\n" not in message and message.startswith("2 of 164 conversations (training and held-out together)")
    assert "held-out #" in message and repr(held[6]) in message
