"""Data: formats, the assistant-only loss mask on a real chat template, malformed rows, vocab maps."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specforge_lite.config import DataConfig
from specforge_lite.data import DataError, MalformedRow, normalize_conversation, prepare_data
from specforge_lite.data.chat import tokenize_conversation
from specforge_lite.data.vocab import DraftVocab, count_loss_tokens, select_draft_tokens

CONV = [{"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four."},
        {"role": "user", "content": "And three plus three?"},
        {"role": "assistant", "content": "Six, of course."}]


def test_sharegpt_and_openai_rows_normalise_alike():
    share = {"conversations": [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
                               for m in CONV]}
    assert normalize_conversation(share) == normalize_conversation({"messages": CONV}) == CONV
    assert normalize_conversation({"messages": [{"role": "assistant", "content": "hi"}] + CONV}) == CONV


@pytest.mark.parametrize("row, reason", [
    ({"text": "x"}, "none of 'conversations'"),
    ({"messages": []}, "empty"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown role"),
    ({"messages": [{"role": "user", "content": 3}]}, "not text"),
    ({"messages": [{"role": "user", "content": "only a question"}]}, "set data.regenerate=true"),
    ([1, 2], "not an object"),
])
def test_malformed_rows_are_named(row, reason):
    with pytest.raises(MalformedRow, match=reason):
        normalize_conversation(row)


def test_loss_mask_covers_exactly_the_assistant_turns_on_smollm2_template(smollm2):
    _, _, tok = smollm2
    ids, mask, _ = tokenize_conversation(tok, CONV, max_length=4096)
    text = tok.apply_chat_template(CONV, tokenize=False)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    masked = tok.decode([i for i, m in zip(ids, mask) if m])
    # Each assistant answer plus its end-of-turn token, nothing of the system/user turns or the headers.
    assert masked == "Four.<|im_end|>Six, of course.<|im_end|>"
    # Mask runs start right after "<|im_start|>assistant\n".
    starts = [j for j in range(len(mask)) if mask[j] and not mask[j - 1]]
    for j in starts:
        assert tok.decode(ids[:j]).endswith("<|im_start|>assistant\n")


def test_truncation_and_no_loss_left(smollm2):
    _, _, tok = smollm2
    ids, mask, _ = tokenize_conversation(tok, CONV, max_length=40)
    assert len(ids) == len(mask) == 40
    with pytest.raises(MalformedRow, match="no assistant tokens within max_length=10"):
        tokenize_conversation(tok, CONV, max_length=10)


def distinct(n):
    """n conversations with different openings (identical ones would all match a held-out prompt)."""
    return [{"messages": [{**CONV[0], "content": f"Question {i}: what is two plus two?"}] + CONV[1:]} for i in range(n)]


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def test_malformed_rows_are_skipped_and_counted(tmp_path, smollm2, monkeypatch):
    monkeypatch.setenv("SPECFORGE_LITE_CACHE", str(tmp_path / "cache"))
    _, _, tok = smollm2
    _write(tmp_path / "d.jsonl", distinct(30) + ["{not json", {"messages": [{"role": "user", "content": "q"}]}])
    data = prepare_data(DataConfig(source="path", path=str(tmp_path / "d.jsonl"), heldout_samples=4), tok,
                        log=lambda m: None)
    assert len(data.train) == 26 and len(data.heldout) == 4
    assert sum(data.stats["skipped"].values()) == 2
    assert len(data.heldout_prompts) == 4 and tok.decode(data.heldout_prompts[0]).endswith("<|im_start|>assistant\n")


def test_too_many_malformed_rows_is_an_error(tmp_path, smollm2, monkeypatch):
    monkeypatch.setenv("SPECFORGE_LITE_CACHE", str(tmp_path / "cache"))
    _, _, tok = smollm2
    _write(tmp_path / "d.jsonl", distinct(5) + [{"oops": 1}] * 5)
    with pytest.raises(DataError, match="5 of 10 rows .* malformed .*max_malformed_fraction"):
        prepare_data(DataConfig(source="path", path=str(tmp_path / "d.jsonl")), tok)


def test_empty_after_filtering_and_missing_file(tmp_path, smollm2, monkeypatch):
    monkeypatch.setenv("SPECFORGE_LITE_CACHE", str(tmp_path / "cache"))
    _, _, tok = smollm2
    _write(tmp_path / "d.jsonl", distinct(4))
    # every row is lost at tokenisation: the threshold names the cause before "nothing usable" could
    with pytest.raises(DataError, match=r"4 of 4 rows in .*d\.jsonl could not be used \(4x first prompt of"):
        prepare_data(DataConfig(source="path", path=str(tmp_path / "d.jsonl"), max_length=8, heldout_samples=1), tok)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prepare_data(DataConfig(source="path", path=str(tmp_path / "nope.jsonl")), tok)
    _write(tmp_path / "same.jsonl", [{"messages": CONV}] * 6)  # every opening equals a held-out prompt's
    with pytest.raises(DataError, match="6 shared an opening|5 shared an opening"):
        prepare_data(DataConfig(source="path", path=str(tmp_path / "same.jsonl"), heldout_samples=1), tok)


def test_draft_vocab_is_the_most_frequent_loss_tokens():
    ids = [[5, 5, 5, 7, 7, 9, 1, 1, 1, 1]]
    mask = [[1, 1, 1, 1, 1, 1, 0, 0, 0, 0]]  # token 1 is frequent but never carries loss
    counts = count_loss_tokens(ids, mask, vocab_size=12)
    assert counts[5] == 3 and counts[7] == 2 and counts[1] == 0
    used = select_draft_tokens(counts, 3)
    assert used.tolist() == [5, 7, 9]
    # tokens without loss occurrences fill the rest by lowest id (BPE merge order ~ frequency)
    assert select_draft_tokens(counts, 5).tolist() == [0, 1, 5, 7, 9]


def test_d2t_and_t2d_invariants():
    used = torch.tensor([0, 3, 4, 10, 11, 40])
    vocab = DraftVocab(used, target_vocab_size=50, coverage=1.0)
    d2t, t2d = vocab.d2t, vocab.t2d
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert torch.equal(torch.arange(6) + d2t, used)  # target_id = draft_id + d2t[draft_id]
    assert int(t2d.sum()) == 6 and bool(t2d[used].all())
    assert torch.equal(DraftVocab.from_d2t(d2t, 50).draft_to_target, used)
    assert bool((np.diff(used.numpy()) > 0).all())


# A template with Qwen3's thinking behaviour (written for this test): an answer's <think> block is
# kept only for the answer after the last user turn; earlier answers are rendered without it.
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip() -%}{%- endif -%}"
    "{{ '<|im_start|>' + m['role'] + '\n' + content + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def test_thinking_template_gives_one_sample_per_turn_as_the_server_sees_it(smollm2):
    import copy

    from specforge_lite.data.chat import tokenize_samples

    tok = copy.deepcopy(smollm2[2])
    tok.chat_template = THINKING_TEMPLATE
    msgs = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "<think>r1</think>A1"},
            {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "<think>r2</think>A2"}]
    with pytest.raises(MalformedRow, match="prefix-stable"):
        tokenize_conversation(tok, msgs, 256)
    samples = tokenize_samples(tok, msgs, 256)
    assert len(samples) == 2
    learned = [tok.decode([t for t, m in zip(ids, mask) if m]) for ids, mask, _ in samples]
    assert learned == ["<think>r1</think>A1<|im_end|>", "<think>r2</think>A2<|im_end|>"]
    # the second sample's history shows the first answer as the server renders history: without thinking
    context = tok.decode(samples[1][0])
    assert "r1" not in context and "A1<|im_end|>" in context
    # a prefix-stable template still gives a single sample with both turns in the loss
    assert len(tokenize_samples(smollm2[2], msgs, 256)) == 1


def test_image_rows_in_both_formats_and_their_errors(tmp_path):
    from PIL import Image

    Image.new("RGB", (32, 32)).save(tmp_path / "a.png")
    Image.new("RGB", (32, 32)).save(tmp_path / "b.png")
    openai = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file://a.png"}},
                                                        {"type": "text", "text": "what?"}]},
                           {"role": "assistant", "content": "dark"}]}
    llava = {"images": ["a.png", "b.png"], "conversations": [
        {"from": "human", "value": "<image> vs <image>"}, {"from": "gpt", "value": "same"}]}
    bare = {"image": "a.png", "conversations": [{"from": "human", "value": "what?"}, {"from": "gpt", "value": "dark"}]}
    a, b = str(tmp_path / "a.png"), str(tmp_path / "b.png")
    assert normalize_conversation(openai, tmp_path)[0] == {"role": "user", "content": "<image>what?", "images": [a]}
    assert normalize_conversation(llava, tmp_path)[0]["images"] == [a, b]
    assert normalize_conversation(bare, tmp_path)[0] == {"role": "user", "content": "<image>\nwhat?", "images": [a]}
    with pytest.raises(MalformedRow, match="image file not found"):
        normalize_conversation({**bare, "image": "missing.png"}, tmp_path)
    with pytest.raises(MalformedRow, match="2 images but its turns hold 1"):
        normalize_conversation({**llava, "conversations": [{"from": "human", "value": "<image>"},
                                                           {"from": "gpt", "value": "x"}]}, tmp_path)


def test_a_text_only_target_skips_image_rows_and_counts_them(tmp_path, smollm2):
    from PIL import Image

    Image.new("RGB", (32, 32)).save(tmp_path / "a.png")
    rows = [{"messages": [{"role": "user", "content": f"hello {i}"}, {"role": "assistant", "content": f"hi {i}"}]}
            for i in range(12)]
    rows.append({"image": "a.png",
                 "conversations": [{"from": "human", "value": "what?"}, {"from": "gpt", "value": "x"}]})
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg = DataConfig(source="path", path=str(tmp_path / "d.jsonl"), heldout_samples=2)
    data = prepare_data(cfg, smollm2[2], log=lambda m: None)
    assert data.stats["skipped"] == {"a turn holds images but the target takes text only": 1}
    assert len(data.train) + len(data.heldout) == 12


@pytest.mark.parametrize("template", ["prefix-stable", "thinking"])
def test_last_turn_only_puts_the_loss_on_the_last_answer_with_the_rest_as_context(smollm2, template):
    """data.loss_turns=last: one sample per conversation, the loss on exactly the last answer's tokens (and its
    end token), the earlier turns present as context, rendered as the server renders history (the thinking
    template drops the earlier answer's reasoning); compared with the text the template itself renders."""
    import copy

    from specforge_lite.data.chat import tokenize_samples

    tok = copy.deepcopy(smollm2[2])
    if template == "thinking":
        tok.chat_template = THINKING_TEMPLATE
    msgs = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "<think>r1</think>A1"},
            {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "<think>r2</think>A2"}]
    [(ids, mask, _)] = tokenize_samples(tok, msgs, 256, loss_turns="last")
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "<think>r2</think>A2<|im_end|>"
    assert tok.decode(ids) == tok.apply_chat_template(msgs, tokenize=False)
    assert ("r1" in tok.decode(ids)) == (template == "prefix-stable")
    with pytest.raises(ValueError, match="data.loss_turns='first': use one of"):
        tokenize_samples(tok, msgs, 256, loss_turns="first")


def test_byte_order_marks_are_read_and_non_utf8_bytes_are_named_by_file_and_line(tmp_path):
    """A UTF-8 file that starts with a byte-order mark (Windows tools write one) is read as it is; bytes
    that are not UTF-8 make that row a counted malformed row whose message names the file, the line and
    the fix, never a UnicodeDecodeError."""
    from specforge_lite.data.formats import iter_rows

    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    line = json.dumps(row).encode()
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + line + b"\n" + line + b"\n")
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps([row]).encode())
    for name, count in (("bom.jsonl", 2), ("bom.json", 1)):
        rows = [r for _, _, r in iter_rows(tmp_path / name)]
        assert rows == [row] * count, name
    (tmp_path / "latin1.jsonl").write_bytes(line + b"\n" + '{"messages": "caf\xe9"}'.encode("latin-1") + b"\n" + line)
    got = list(iter_rows(tmp_path / "latin1.jsonl"))
    assert [r for _, _, r in got][0::2] == [row, row]
    where, bad = got[1][1], got[1][2]
    assert isinstance(bad, MalformedRow) and where.endswith("latin1.jsonl:2")
    assert "not UTF-8" in str(bad) and "save the file as UTF-8" in str(bad)
    (tmp_path / "latin1.json").write_bytes(b'[\n{"a": 1},\n{"b": "caf\xe9"}\n]')
    [(_, where, bad)] = list(iter_rows(tmp_path / "latin1.json"))
    assert isinstance(bad, MalformedRow) and where.endswith("latin1.json:3") and "not UTF-8" in str(bad)


def test_rows_lost_at_tokenisation_count_against_the_malformed_threshold(tmp_path, smollm2, monkeypatch):
    """Rows that parse but yield no sample (here: prompts longer than data.max_length) are bad rows too: a
    wrong template or length must not silently drop most of the data."""
    monkeypatch.setenv("SPECFORGE_LITE_CACHE", str(tmp_path / "cache"))
    _, _, tok = smollm2
    too_long = [{"messages": [{"role": "user", "content": f"Topic {i}: " + "word " * 100},
                              {"role": "assistant", "content": "An answer."}]} for i in range(8)]
    _write(tmp_path / "d.jsonl", distinct(4) + too_long)
    with pytest.raises(DataError, match="8 of 12 rows .* could not be used .*max_malformed_fraction"):
        prepare_data(DataConfig(source="path", path=str(tmp_path / "d.jsonl"), max_length=64, heldout_samples=1), tok,
                     log=lambda m: None)


@pytest.mark.parametrize("conversations, heldout", [(1, 4), (6, 0)])
def test_data_without_a_held_out_split_prepares_and_reads_back_from_the_cache(tmp_path, smollm2, monkeypatch,
                                                                              conversations, heldout):
    """A single usable conversation, or data.heldout_samples=0: an empty held-out split, written and read back."""
    monkeypatch.setenv("SPECFORGE_LITE_CACHE", str(tmp_path / "cache"))
    _, _, tok = smollm2
    _write(tmp_path / "d.jsonl", distinct(conversations))
    cfg = DataConfig(source="path", path=str(tmp_path / "d.jsonl"), heldout_samples=heldout)
    for _ in range(2):  # prepared, then from the cache
        data = prepare_data(cfg, tok, log=lambda m: None)
        assert len(data.train) == conversations and len(data.heldout) == 0 and data.heldout_prompts == []


def test_two_runs_preparing_the_same_data_at_once_both_finish_and_publish_it_once(tmp_path, smollm2, monkeypatch):
    """Two runs on one machine (two users, a sweep's jobs, a test suite's two processes) prepare the same data into
    the shared cache at the same moment: the second does all its work while the first is writing. Each writes
    beside the cache entry under a name of its own, so neither reads or moves the other's half-written files, and
    both end with the data."""
    import datasets

    monkeypatch.setenv("SPECFORGE_LITE_CACHE", str(tmp_path / "cache"))
    _, _, tok = smollm2
    _write(tmp_path / "d.jsonl", distinct(6))
    cfg = DataConfig(source="path", path=str(tmp_path / "d.jsonl"), heldout_samples=2)
    save, other = datasets.Dataset.save_to_disk, {}

    def save_then_let_the_other_run(self, path, *args, **kwargs):
        save(self, path, *args, **kwargs)
        if "started" not in other:  # the first run has written one split: the other prepares, start to end, now
            other["started"] = True
            other["data"] = prepare_data(cfg, tok, log=lambda m: None)

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", save_then_let_the_other_run)
    first = prepare_data(cfg, tok, log=lambda m: None)
    assert len(first.train) == len(other["data"].train) == 4 and len(first.heldout) == len(other["data"].heldout) == 2
    published = [p.name for p in (tmp_path / "cache").rglob("*") if p.is_dir() and "tmp" in p.name]
    assert published == [], published  # (no temporary folder left behind)


def test_image_paths_stay_inside_the_data_files_folder_and_non_images_are_named(tmp_path):
    """A data file from elsewhere must not make training read other files of the machine."""
    from PIL import Image

    from specforge_lite.data.images import ImageInputs

    folder = tmp_path / "data"
    folder.mkdir()
    Image.new("RGB", (8, 8)).save(folder / "inside.png")
    Image.new("RGB", (8, 8)).save(tmp_path / "outside.png")

    def row(ref):
        return {"image": ref, "conversations": [{"from": "human", "value": "what?"}, {"from": "gpt", "value": "dark"}]}

    assert normalize_conversation(row("inside.png"), folder)[0]["images"] == [str(folder / "inside.png")]
    for ref in ["../outside.png", str(tmp_path / "outside.png"), "../../../../../etc/hostname"]:
        with pytest.raises(MalformedRow, match="outside the data file's folder"):
            normalize_conversation(row(ref), folder)
    allowed = normalize_conversation(row("../outside.png"), folder, confine_images=False)  # the user's choice
    assert allowed[0]["images"] == [str(tmp_path / "outside.png")]

    (folder / "notes.png").write_text("not an image")
    with pytest.raises(MalformedRow, match="notes.png is not an image file"):
        ImageInputs(None, "<img>", 0, 2).open(str(folder / "notes.png"))


def test_evaluation_prompts_follow_the_training_length_rule(tmp_path, smollm2, monkeypatch):
    """A conversation whose first prompt fills data.max_length is neither a sample nor an evaluation prompt
    (the end-of-run evaluation would otherwise run attention over it)."""
    monkeypatch.setenv("SPECFORGE_LITE_CACHE", str(tmp_path / "cache"))
    _, _, tok = smollm2
    huge = [{"messages": [{"role": "user", "content": f"Essay {i}: " + "word " * 2000},
                          {"role": "assistant", "content": "Noted."}]} for i in range(6)]
    _write(tmp_path / "d.jsonl", distinct(6) + huge)
    data = prepare_data(DataConfig(source="path", path=str(tmp_path / "d.jsonl"), max_length=64, heldout_samples=6,
                                   max_malformed_fraction=0.6), tok, log=lambda m: None)
    assert data.heldout_prompts and all(len(p) < 64 for p in data.heldout_prompts)
    assert data.stats["skipped"]["first prompt of data.max_length=64 tokens or more"] == 6


def test_hostile_files_are_counted_skips_naming_the_file(tmp_path, smollm2, monkeypatch):
    """A data folder with a symlink loop and a dangling link, JSON nested past the parser's limit, text with a
    lone surrogate, and an image whose header declares a decompression bomb: each a counted skip with the
    file (and line) and the reason; the good rows train. Data given as a pipe (a process substitution) is
    read once and prepares like the same file."""
    import os
    import zlib

    from PIL import Image

    from specforge_lite.data.images import ImageInputs

    monkeypatch.setenv("SPECFORGE_LITE_CACHE", str(tmp_path / "cache"))
    tok = smollm2[2]
    folder = tmp_path / "data"
    folder.mkdir()
    _write(folder / "good.jsonl", distinct(30))
    (folder / "loop.jsonl").symlink_to(folder / "loop.jsonl")
    (folder / "gone.jsonl").symlink_to(tmp_path / "missing.jsonl")
    (folder / "sub").mkdir()
    (folder / "sub" / "up").symlink_to(folder, target_is_directory=True)  # a folder loop: not followed
    deep = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    surrogate = '{"messages": [{"role": "user", "content": "hi \\ud800"}, {"role": "assistant", "content": "yo"}]}'
    _write(folder / "odd.jsonl", [deep, surrogate])
    data = prepare_data(DataConfig(source="path", path=str(folder), heldout_samples=4, max_malformed_fraction=0.2),
                        tok, log=lambda m: None)
    assert len(data.train) + len(data.heldout) == 30
    skipped = data.stats["skipped"]
    assert skipped["the file cannot be read (Too many levels of symbolic links)"] == 1
    assert skipped["the file cannot be read (No such file or directory)"] == 1
    assert skipped["JSON nested deeper than any conversation (the parser's recursion limit)"] == 1
    assert any("lone UTF-16 surrogate" in reason for reason in skipped)

    bomb = folder / "bomb.png"
    Image.new("L", (1, 1)).save(bomb)
    raw = bytearray(bomb.read_bytes())
    raw[16:24] = (200_000).to_bytes(4, "big") * 2  # the IHDR width and height: 4e10 pixels declared
    raw[29:33] = zlib.crc32(bytes(raw[12:29])).to_bytes(4, "big")  # (and its checksum, so the header reads)
    bomb.write_bytes(bytes(raw))
    with pytest.raises(MalformedRow, match="bomb.png declares more pixels than any training image has"):
        ImageInputs(None, "<img>", 0, 2).open(str(bomb))

    read, write = os.pipe()
    with os.fdopen(write, "w") as w:  # (small enough for the pipe's buffer)
        w.write("".join(json.dumps(r) + "\n" for r in distinct(30)))
    try:
        piped = prepare_data(DataConfig(source="path", path=f"/dev/fd/{read}", heldout_samples=4), tok,
                             log=lambda m: None)
    finally:
        os.close(read)
    assert sorted(map(tuple, piped.train["input_ids"])) == sorted(map(tuple, data.train["input_ids"]))
