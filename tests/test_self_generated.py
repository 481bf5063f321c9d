"""Self-generated requests (Magpie) and data mixes: the template prefix, the filters, caching and resume,
and how a mix composes the training and held-out conversations."""

from __future__ import annotations

import json

import pytest

from specforge_lite.config import DataConfig, MixSource, SelfGeneratedConfig
from specforge_lite.data import DataError, prepare_data
from specforge_lite.data.self_generated import rejection, user_turn_prefix, write_requests

CFG = SelfGeneratedConfig(max_new_tokens=40, min_words=4)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFORGE_LITE_CACHE", str(tmp_path / "cache"))


class ScriptedWriter:
    """A fake target writing requests: request (shard i, j) gets POOL[i * 4 + j] (batch size 4)."""

    def __init__(self, pool, die_after=None):
        self.pool, self.die_after, self.taken, self.prompts = pool, die_after, 0, set()

    def stream(self, queue):
        while len(queue):
            (i, j), prompt, seed = queue.pop()
            self.prompts.add(prompt)
            if self.die_after is not None and self.taken >= self.die_after:
                raise KeyboardInterrupt("killed")
            self.taken += 1
            yield (i, j), self.pool[(i * 4 + j) % len(self.pool)]


POOL = ["How do I bake bread at home?", "", "Sure, here is how you bake bread.", "Tell me a fun fact about owls.",
        "What is   the capital of France?", "how do I bake bread at HOME", "hi there", "Explain how tides work.",
        "Write a poem about rain, please.", "<|im_start|>assistant hello there friend", "a b a b a b a b a b a b",
        "Give me three tips for better sleep."]


def test_user_turn_prefix_is_the_template_up_to_the_users_words(smollm2):
    _, _, tok = smollm2
    prefix = user_turn_prefix(tok)
    rendered = tok.apply_chat_template([{"role": "user", "content": "Name a fruit."}], tokenize=False)
    assert rendered.startswith(prefix + "Name a fruit.")
    assert prefix.endswith("<|im_start|>user\n") and "system" in prefix  # SmolLM2's default system prompt


def test_rejection_names_why_a_request_is_dropped():
    assert rejection("", 0, CFG) == "empty"
    assert rejection("word " * 50, 39, CFG).startswith("unfinished")
    assert rejection("hi there", 2, CFG).startswith("shorter")
    assert rejection("Sure, here is how you bake bread.", 9, CFG).startswith("an assistant's reply")
    assert rejection("<|im_start|>assistant hello there friend", 9, CFG) == "holds chat-template markup"
    assert rejection("a b a b a b a b a b a b", 12, CFG) == "repetitive"
    assert rejection("How do I bake bread at home?", 8, CFG) is None


def test_requests_are_filtered_deduplicated_cached_and_extend_as_a_prefix(smollm2):
    _, _, tok = smollm2
    first = ScriptedWriter(POOL)
    kept, stats = write_requests(first, tok, 3, CFG, "model-a", 4, log=lambda m: None)
    assert kept == ["How do I bake bread at home?", "Tell me a fun fact about owls.",
                    "What is   the capital of France?"]
    assert first.prompts == {user_turn_prefix(tok)}  # the writer saw nothing but the template's user-turn prefix
    # a larger count reuses the shards already written and extends the same list
    more = ScriptedWriter(POOL)
    kept6, stats6 = write_requests(more, tok, 6, CFG, "model-a", 4, log=lambda m: None)
    assert kept6[:3] == kept and len(kept6) == 6
    assert "how do I bake bread at HOME" not in kept6  # a duplicate up to case and punctuation
    assert more.taken == stats6["candidates"] - stats["candidates"]
    assert stats6["dropped"]["duplicate"] == 1 and stats6["dropped"]["empty"] == 1
    # another model: another cache
    other = ScriptedWriter(POOL)
    write_requests(other, tok, 3, CFG, "model-b", 4, log=lambda m: None)
    assert other.taken > 0


def test_a_killed_request_run_resumes_at_its_first_missing_shard(smollm2):
    _, _, tok = smollm2
    first = ScriptedWriter(POOL)
    straight, _ = write_requests(first, tok, 5, CFG, "ref", 4, log=lambda m: None)
    assert first.taken == 12  # three shards of four: two, then one more at the pass rate seen
    with pytest.raises(KeyboardInterrupt):  # killed inside the second shard: the first is on disk
        write_requests(ScriptedWriter(POOL, die_after=6), tok, 5, CFG, "run", 4, log=lambda m: None)
    again = ScriptedWriter(POOL)
    resumed, _ = write_requests(again, tok, 5, CFG, "run", 4, log=lambda m: None)
    assert resumed == straight and again.taken == 8


def _write(path, n, prefix, answer="an answer"):
    rows = [{"messages": [{"role": "user", "content": f"{prefix} question {i}"},
                          {"role": "assistant", "content": f"{answer} {i}"}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_mix_takes_each_source_by_weight_and_holds_out_from_the_files(tmp_path, smollm2):
    _, _, tok = smollm2
    a, b = _write(tmp_path / "a.jsonl", 40, "alpha"), _write(tmp_path / "b.jsonl", 40, "beta")
    cfg = DataConfig(source="mix", mix=[MixSource("path", str(a), 1.0), MixSource("path", str(b), 3.0)],
                     max_samples=16, heldout_samples=8)
    data = prepare_data(cfg, tok, log=lambda m: None)
    texts = [tok.decode(ids) for ids in data.train["input_ids"]]
    assert sum("alpha" in t for t in texts) == 4 and sum("beta" in t for t in texts) == 12
    held = [tok.decode(p) for p in data.heldout_prompts]
    assert sum("alpha" in t for t in held) == 2 and sum("beta" in t for t in held) == 6
    assert data.stats["mix"] == {f"path:{a}#0": 4, f"path:{b}#1": 12}


def test_self_generated_requests_join_the_mix_answered_by_the_target(tmp_path, smollm2):
    _, _, tok = smollm2
    a = _write(tmp_path / "a.jsonl", 40, "alpha")
    mix = [MixSource("path", str(a), 1.0), MixSource("self_generated", None, 1.0)]
    cfg = DataConfig(source="mix", mix=mix, max_samples=8, heldout_samples=4, regenerate=True)
    data = prepare_data(cfg, tok, generate=lambda convs: [f"target answers {c[-1]['content'][:12]}" for c in convs],
                        request_writer=ScriptedWriter(POOL), model_fingerprint="fake", log=lambda m: None)
    texts = [tok.decode(ids) for ids in data.train["input_ids"]]
    assert sum("alpha question" in t for t in texts) == 4
    assert sum("How do I bake bread" in t or "fun fact about owls" in t for t in texts) == 2
    assert all("target answers" in t and "an answer" not in t for t in texts)
    assert data.stats["self_generated"]["kept"] == 4
    assert all("alpha" in tok.decode(p) for p in data.heldout_prompts)  # held out from the file source only


def test_a_source_with_regenerate_false_keeps_its_served_answers(tmp_path, smollm2):
    """Served traffic (python -m specforge_lite.adapt) beside data the target answers: only the other source's
    answers are regenerated, and the key of the prepared data tells the two mixes apart."""
    _, _, tok = smollm2
    served, other = _write(tmp_path / "s.jsonl", 30, "served", "SERVED"), _write(tmp_path / "o.jsonl", 30, "other")
    asked = []
    mix = [MixSource("path", str(served), 3.0, regenerate=False), MixSource("path", str(other), 1.0)]
    cfg = DataConfig(source="mix", mix=mix, max_samples=16, heldout_samples=4, regenerate=True)
    data = prepare_data(cfg, tok, generate=lambda convs: asked.extend(convs) or ["TARGET" for _ in convs],
                        model_fingerprint="fake", log=lambda m: None)
    texts = [tok.decode(ids) for ids in data.train["input_ids"]]
    assert sum("served question" in t and "SERVED" in t and "TARGET" not in t for t in texts) == 12
    assert sum("other question" in t and "TARGET" in t for t in texts) == 4
    assert asked and all("other" in c[0]["content"] for c in asked)  # nothing served was asked again
    assert data.stats["regeneration"]["answers_kept_as_written"] == 12
    with pytest.raises(DataError, match="empty answers"):
        prepare_data(DataConfig(source="mix", mix=[MixSource("path", str(other), 1.0),
                                                   MixSource("self_generated", None, 1.0, regenerate=False)],
                                regenerate=True), tok, log=lambda m: None)


def test_without_regeneration_a_mix_leaves_its_self_generated_requests_out_and_says_so(tmp_path, smollm2):
    """data.regenerate=false alone on the default recipe's mix (refused before: the user had to find the mix)."""
    _, _, tok = smollm2
    a = _write(tmp_path / "a.jsonl", 20, "alpha")
    said = []
    cfg = DataConfig(source="mix", mix=[MixSource("path", str(a), 1.0), MixSource("self_generated", None, 1.0)],
                     heldout_samples=4)
    data = prepare_data(cfg, tok, log=said.append)
    assert len(data.train) == 16 and all("alpha" in tok.decode(ids) for ids in data.train["input_ids"])
    assert any("self_generated requests left out" in m for m in said), said


def test_mix_mistakes_are_named(tmp_path, smollm2):
    _, _, tok = smollm2
    a = _write(tmp_path / "a.jsonl", 10, "alpha")
    for cfg, words in [
        (DataConfig(source="mix"), "needs data.mix"),
        (DataConfig(source="mix", mix=[MixSource("self_generated", None, 1.0)], regenerate=True), "add a file source"),
        (DataConfig(source="mix", mix=[MixSource("path", str(a), 0.0)]), "must be positive"),
    ]:
        with pytest.raises(DataError, match=words):
            prepare_data(cfg, tok, log=lambda m: None)


def test_prompts_that_fill_max_length_are_never_answered_nor_asked(tmp_path, smollm2):
    _, _, tok = smollm2
    rows = [{"messages": [{"role": "user", "content": ("long " * 300) if i % 5 == 0 else f"short {i}"},
                          {"role": "assistant", "content": "ok"}]} for i in range(30)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = []
    data = prepare_data(DataConfig(source="path", path=str(tmp_path / "d.jsonl"), max_length=64, heldout_samples=6,
                                   regenerate=True, max_malformed_fraction=0.5),
                        tok, generate=lambda convs: seen.extend(convs) or ["fine" for _ in convs],
                        model_fingerprint="fake", log=lambda m: None)
    assert not any("long long" in c[0]["content"] for c in seen)  # no answer generated for them
    assert all(len(p) < 64 for p in data.heldout_prompts)
    assert data.stats["skipped"]["first prompt of data.max_length=64 tokens or more"] == 6


def test_a_data_group_on_the_command_line_replaces_the_recipes_mix():
    """The embedded default's recipe picks the assistant mix, but a user's own data=... must win over it."""
    from specforge_lite.compose import load_config

    default = load_config(["tracker=none"]).data
    assert default.source == "mix" and [m.source for m in default.mix] == ["builtin_chitchat", "self_generated"]
    mine = load_config(["tracker=none", "data=sharegpt", "data.path=/data/chats.jsonl"]).data
    assert mine.source == "path" and mine.path == "/data/chats.jsonl" and not mine.mix
    assert load_config(["tracker=none", "data=shapes"]).data.source == "builtin_shapes"
