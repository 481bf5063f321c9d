"""The user's data in every shape the peers take: JSON/JSONL, Parquet and Arrow files, folders saved with datasets,
hub ids; tool-calling and reasoning conversations; pre-tokenized rows; prompts for the target to answer. Each on a
real file of its shape, and a broken one named by file and row."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import ROOT
from specforge_lite.config import DataConfig, MixSource
from specforge_lite.data import DataError, MalformedRow, normalize_conversation, prepare_data
from specforge_lite.data.chat import check_renderable, tokenize_samples
from specforge_lite.data.formats import iter_rows
from specforge_lite.data.readers import parse_hub_id

# Qwen3's behaviour with tools and reasoning, written for these tests (SmolLM2's tokenizer, the one offline, has a
# template without either): tools in the system turn, calls as <tool_call> JSON, results as <tool_response> in a
# user turn, reasoning as <think> only for the answers after the last user turn.
TOOL_TEMPLATE = (
    "{%- if tools -%}{{- '<|im_start|>system\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}"
    "{{- 'Tools:' -}}{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}{{- '<|im_end|>\n' -}}"
    "{%- elif messages[0].role == 'system' -%}{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{- '<|im_start|>user\n' + m.content + '<|im_end|>\n' -}}"
    "{%- elif m.role == 'assistant' -%}{{- '<|im_start|>assistant\n' -}}"
    "{%- if m.reasoning_content is string and loop.index0 > ns.last_user -%}"
    "{{- '<think>\n' + m.reasoning_content + '\n</think>\n\n' -}}{%- endif -%}"
    "{{- m.content -}}"
    "{%- for call in m.tool_calls or [] -%}"
    "{{- '\n<tool_call>\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' + "
    "(call.function.arguments | tojson) + '}\n</tool_call>' -}}"
    "{%- endfor -%}{{- '<|im_end|>\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
TOOL_ROW = {"tools": [WEATHER], "messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    {"role": "assistant", "content": "It is 18C and sunny in Paris."}]}
# the same conversation as LLaMA-Factory writes it in ShareGPT
SHAREGPT_TOOL_ROW = {"tools": json.dumps([WEATHER["function"]]), "conversations": [
    {"from": "human", "value": "Weather in Paris?"},
    {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
    {"from": "observation", "value": "18C, sunny"},
    {"from": "gpt", "value": "It is 18C and sunny in Paris."}]}


def rows(n: int) -> list[dict]:
    """n conversations of varied shapes (plain, with tools, with reasoning), distinct openings."""
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append({"messages": [{"role": "user", "content": f"Question {i}: what is two plus two?"},
                                     {"role": "assistant", "content": "Four."}]})
        elif i % 3 == 1:  # (arguments as objects, and schemas and arguments that differ from row to row)
            row = copy.deepcopy(TOOL_ROW)
            row["messages"][0]["content"] = f"Question {i}: weather in Paris?"
            call = row["messages"][1]["tool_calls"][0]["function"]
            call["arguments"] = {"city": "Paris"}
            if i > 1:
                call["arguments"]["days"] = i
                row["tools"][0]["function"]["parameters"]["properties"]["days"] = {"type": "integer"}
            out.append(row)
        else:
            out.append({"messages": [{"role": "user", "content": f"Question {i}: and three plus three?"},
                                     {"role": "assistant", "content": "Six.", "reasoning_content": "3+3=6"}]})
    return out


def write(path, rows_):
    """rows_ in the file format its suffix names (an .arrow file in Arrow's IPC file format)."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows_))
    elif path.suffix == ".parquet":
        pq.write_table(table(rows_), path)
    else:
        with pa.ipc.new_file(path, table(rows_).schema) as writer:
            writer.write_table(table(rows_))
    return path


def table(rows_) -> pa.Table:
    return pa.Table.from_struct_array(pa.array(rows_))  # (the columns and fields of every row, not the first's)


def saved(rows_) -> datasets.Dataset:
    return datasets.Dataset(table(rows_))


@pytest.fixture
def tool_tok(smollm2):
    """SmolLM2's real tokenizer with a template that renders tools and reasoning."""
    tok = copy.deepcopy(smollm2[2])
    tok.chat_template = TOOL_TEMPLATE
    return tok


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFORGE_LITE_CACHE", str(tmp_path / "cache"))


def read(source) -> list:
    return [normalize_conversation(r, f.parent) for f, _, r in iter_rows(source)]


def test_every_file_shape_and_a_saved_dataset_read_as_the_same_conversations(tmp_path):
    """Arrow gives each row the fields of every row (a user turn gets tool_calls: null, a tool schema another
    row's properties): what is read is the row as written, as from JSON."""
    want = read(write(tmp_path / "d.jsonl", rows(6)))
    assert want[1][0]["tools"] == [WEATHER]
    assert want[1][1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert want[4][1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 4}
    for name in ("d.json", "d.parquet", "d.arrow"):
        assert read(write(tmp_path / name, rows(6))) == want, name
    saved(rows(6)).save_to_disk(str(tmp_path / "saved"))  # (Arrow's stream format)
    assert read(tmp_path / "saved") == want
    datasets.DatasetDict({"train": saved(rows(6)), "test": saved(rows(2))}).save_to_disk(str(tmp_path / "splits"))
    assert read(tmp_path / "splits") == want  # (its train split)


def test_a_parquet_file_and_a_saved_dataset_prepare_like_the_jsonl(tmp_path, tool_tok, cache):
    def prepared(path):
        data = prepare_data(DataConfig(source="path", path=str(path), heldout_samples=2), tool_tok, log=lambda m: None)
        return list(data.train["input_ids"]), list(data.train["loss_mask"]), data.heldout_prompts

    (tmp_path / "folder").mkdir()
    want = prepared(write(tmp_path / "folder" / "d.jsonl", rows(9)))
    assert len(want[0]) == 7
    assert prepared(write(tmp_path / "d.parquet", rows(9))) == want
    saved(rows(9)).save_to_disk(str(tmp_path / "saved"))
    assert prepared(tmp_path / "saved") == want


def test_broken_table_files_and_rows_are_named_by_file_and_row(tmp_path, tool_tok, cache):
    good = write(tmp_path / "good.parquet", rows(4))
    (tmp_path / "cut.parquet").write_bytes(good.read_bytes()[:200])
    [(_, where, error)] = list(iter_rows(tmp_path / "cut.parquet"))
    assert where == str(tmp_path / "cut.parquet") and isinstance(error, MalformedRow)
    assert "cannot be read as Parquet" in str(error) and "write it again" in str(error)
    bad = write(tmp_path / "bad.parquet", rows(4) + [{"messages": [{"role": "wizard", "content": "x"}]}])
    with pytest.raises(DataError, match=rf"unknown role 'wizard' \(first at {bad}\[4\]\)"):
        prepare_data(DataConfig(source="path", path=str(bad), heldout_samples=1), tool_tok)


def test_hub_ids_parse_and_refusals_name_the_id_and_the_fix():
    assert parse_hub_id("hf:org/name") == ("org/name", "train")
    assert parse_hub_id("hf:HuggingFaceH4/ultrachat_200k:train_sft") == ("HuggingFaceH4/ultrachat_200k", "train_sft")
    assert parse_hub_id("hf:squad") == ("squad", "train")
    for bad in ("hf:", "hf:org/name/extra", "hf:org name"):
        with pytest.raises(DataError, match="not a hub dataset id; write hf:org/name"):
            parse_hub_id(bad)


def test_a_hub_dataset_that_cannot_be_reached_is_one_line_before_the_target_loads(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SPECFORGE_LITE_CACHE": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, str(ROOT / "train.py"), "model=llama3_tiny", "tracker=none", "data=sharegpt",
                          "data.path=hf:someorg/no-such-chats:train", f"output_dir={tmp_path / 'run'}"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    said = run.stderr.splitlines()[0]
    assert said.startswith("error: data.path=hf:someorg/no-such-chats:train: the hub dataset 'someorg/no-such-chats' "
                           "(split train) could not be loaded (")
    assert "save_to_disk or to_parquet and pass that folder or file as data.path" in said
    assert "[target]" not in run.stdout


def learned(tok, sample) -> str:
    ids, mask, _ = sample
    return tok.decode([t for t, m in zip(ids, mask) if m])


def test_tool_calls_are_in_the_loss_and_tool_results_are_not(tool_tok):
    messages = normalize_conversation(TOOL_ROW)
    [sample] = tokenize_samples(tool_tok, messages, 1024)
    text = tool_tok.decode(sample[0])
    assert '"name": "get_weather"' in text.split("<|im_start|>user")[0]  # the tools, in the system turn
    assert learned(tool_tok, sample) == ('\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                         '</tool_call><|im_end|>It is 18C and sunny in Paris.<|im_end|>')
    assert "<tool_response>\n18C, sunny\n</tool_response>" in text
    # LLaMA-Factory's ShareGPT spelling of the same conversation is the same sample
    assert tokenize_samples(tool_tok, normalize_conversation(SHAREGPT_TOOL_ROW), 1024) == [sample]


def _tool_turns(*turns: dict) -> dict:
    return {"tools": [WEATHER], "messages": [{"role": "user", "content": "Weather in Paris?"}, *turns,
                                             {"role": "assistant", "content": "It is sunny."}]}


CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}


@pytest.mark.parametrize("row, said", [
    (_tool_turns({"role": "tool", "tool_call_id": "call_1", "content": "18C"}), "answers no tool call"),
    (_tool_turns(CALL, {"role": "tool", "content": "18C"}, {"role": "tool", "content": "19C"}),
     "more results than calls"),
    (_tool_turns(CALL, {"role": "tool", "tool_call_id": "call_9", "content": "18C"}), "'call_9' names none of"),
    (_tool_turns(CALL, {"role": "user", "content": "and?"}, {"role": "tool", "content": "18C"}),
     "answers no tool call"),
    ({"conversations": [{"from": "human", "value": "Weather?"}, {"from": "observation", "value": "18C"},
                        {"from": "gpt", "value": "Sunny."}]}, "answers no tool call"),
])
def test_a_tool_result_without_its_call_is_a_malformed_row(row, said):
    """Accepted and trained as if whole before; each is a conversation no server would be sent."""
    with pytest.raises(MalformedRow, match=said):
        normalize_conversation(row)


@pytest.mark.parametrize("row, said", [
    ({"messages": [{"role": {"name": "user"}, "content": "hi"}, {"role": "assistant", "content": "yo"}]},
     "unknown role {'name': 'user'}"),  # (a TypeError: unhashable type)
    ({"input_ids": None, "loss_mask": [0, 1]}, "input_ids is not a list of integers"),  # (a TypeError: len(None))
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": None}]},
                   {"role": "assistant", "content": "yo"}]}, "a text part has no text"),  # (trained as "None")
    (_tool_turns(CALL, {"role": "tool", "content": [{"type": "text", "text": None}]}), "a text part has no text"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": "f" * 400 + ".png"}, "hi"]},
                   {"role": "assistant", "content": "yo"}]}, "is not a path this machine can open"),  # (OSError)
])
def test_a_row_that_crashed_the_reader_or_read_as_other_text_is_a_malformed_row(row, said):
    with pytest.raises(MalformedRow, match=re.escape(said)):
        normalize_conversation(row, Path("/tmp"))


def test_an_empty_saved_dataset_is_named(tmp_path):
    """datasets' load_from_disk of a saved dataset with no rows raised IndexError."""
    import datasets

    from specforge_lite.data.readers import saved_dataset

    datasets.Dataset.from_list([{"messages": []}]).select([]).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataError, match=rf"^data.path={tmp_path / 'saved'} is a saved dataset that holds no rows"):
        saved_dataset(tmp_path / "saved")


def test_a_damaged_saved_dataset_is_named(tmp_path):
    """A saved dataset whose state.json is cut short raised datasets' own error, naming neither folder nor fix."""
    from specforge_lite.data.readers import saved_dataset

    folder = tmp_path / "saved"
    datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "hi"}]}]).save_to_disk(str(folder))
    state = folder / "state.json"
    state.write_text(state.read_text()[:20])
    with pytest.raises(DataError, match=rf"^data.path={folder} is a saved dataset that does not read \(.*\): save it "
                                        r"again"):
        saved_dataset(folder)


def test_well_formed_tool_turns_pass_the_check():
    two = {**CALL, "tool_calls": [CALL["tool_calls"][0], {**CALL["tool_calls"][0], "id": "call_2"}]}
    answered_out_of_order = _tool_turns(two, {"role": "tool", "tool_call_id": "call_2", "content": "a"},
                                        {"role": "tool", "tool_call_id": "call_1", "content": "b"})
    without_id = _tool_turns(CALL, {"role": "tool", "content": "no id: answers the first call"})
    for row in (TOOL_ROW, SHAREGPT_TOOL_ROW, answered_out_of_order, without_id):
        normalize_conversation(row)


def test_a_template_that_cannot_render_tools_is_named_with_the_fix(tmp_path, smollm2, cache):
    tok = smollm2[2]  # SmolLM2's own template: no tools, no tool calls
    with pytest.raises(MalformedRow, match="renders no tools, tool calls: set model.chat_template="):
        check_renderable(tok, normalize_conversation(TOOL_ROW))
    path = write(tmp_path / "d.jsonl", [TOOL_ROW] * 4)
    with pytest.raises(DataError, match=rf"the chat template of .* renders no tools.*\(first at {path}:1\)"):
        prepare_data(DataConfig(source="path", path=str(path), heldout_samples=1), tok)


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
def test_reasoning_is_rendered_as_the_template_does_and_learned(tool_tok, smollm2, key):
    turns = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1", key: "r1"},
             {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2", key: "r2"}]
    samples = tokenize_samples(tool_tok, normalize_conversation({"messages": turns}), 256)
    # earlier answers lose their reasoning in history: one sample per answer, each as the server renders it
    assert [learned(tool_tok, s) for s in samples] == ["<think>\nr1\n</think>\n\nA1<|im_end|>",
                                                       "<think>\nr2\n</think>\n\nA2<|im_end|>"]
    assert "r1" not in tool_tok.decode(samples[1][0])
    with pytest.raises(MalformedRow, match="renders no reasoning .*set model.chat_template="):
        check_renderable(smollm2[2], normalize_conversation({"messages": turns}))


def test_pre_tokenized_rows_are_used_as_they_are_and_broken_ones_named(tmp_path, smollm2, cache):
    tok = smollm2[2]
    given = [{"input_ids": [1, 100 + i, 200 + i, 300, 2, 0], "loss_mask": [0, 0, 1, 1, 1, 0],
              "attention_mask": [1, 1, 1, 1, 1, 0]} for i in range(8)]
    path = write(tmp_path / "ids.parquet", given)
    data = prepare_data(DataConfig(source="path", path=str(path), heldout_samples=2, regenerate=True), tok,
                        generate=lambda b: pytest.fail("pre-tokenized rows were sent to the target"),
                        log=lambda m: None)
    kept = [r["input_ids"][:5] for r in given]  # (the padding dropped)
    assert len(data.train) == 6 and all(ids in kept for ids in data.train["input_ids"])
    assert data.train["loss_mask"] == [[0, 0, 1, 1, 1]] * 6
    assert len(data.heldout_prompts) == 2 and all(p in [k[:2] for k in kept] for p in data.heldout_prompts)
    broken = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1]}, {"input_ids": [1, len(tok), 3], "loss_mask": [0, 1, 1]},
              {"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}, {"input_ids": [1, 2], "loss_mask": [1, 1]},
              {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "attention_mask": [1, 0, 1]}]
    for n, row in enumerate(broken):
        path = write(tmp_path / f"broken{n}.jsonl", given + [row] * 2)
        with pytest.raises(DataError, match=rf"2 of 10 rows .*\(first at {path}:9\)"):
            prepare_data(DataConfig(source="path", path=str(path), heldout_samples=2), tok)
    with pytest.raises(MalformedRow, match=f"token id {len(tok)} lies outside the target's vocabulary of {len(tok)}"):
        normalize_conversation(broken[1], vocab_size=len(tok))


def test_prompt_only_rows_are_answered_by_the_target_and_refused_without_it(tmp_path, smollm2, cache):
    tok = smollm2[2]
    prompts = [{"prompt": f"Question {i}: name a colour."} for i in range(4)] + [
        {"messages": [{"role": "user", "content": f"Question {i}: hi"}, {"role": "assistant", "content": "Hello."},
                      {"role": "user", "content": "And a colour?"}]} for i in range(4, 8)]
    path = write(tmp_path / "prompts.jsonl", prompts)
    with pytest.raises(DataError, match=rf"set data.regenerate=true .*\(first at {path}:1\)"):
        prepare_data(DataConfig(source="path", path=str(path), heldout_samples=2), tok)
    asked = []
    data = prepare_data(DataConfig(source="path", path=str(path), heldout_samples=2, regenerate=True), tok,
                        generate=lambda convs: asked.extend(convs) or ["Blue." for _ in convs], log=lambda m: None)
    assert len(data.train) == 6
    # every prompt was put to the target, and a conversation's last user turn too
    assert {c[-1]["content"] for c in asked} == {f"Question {i}: name a colour." for i in range(4)} | {
        f"Question {i}: hi" for i in range(4, 8)} | {"And a colour?"}
    assert all(learned(tok, (ids, mask, [])).endswith("Blue.<|im_end|>")
               for ids, mask in zip(data.train["input_ids"], data.train["loss_mask"]))
    # a source whose answers are kept as written takes none without answers
    answered = write(tmp_path / "answered.jsonl", [{"messages": [{"role": "user", "content": f"Q{i}"},
                                                                 {"role": "assistant", "content": "A"}]}
                                                   for i in range(4)])
    mix = [MixSource("path", str(path), 1.0, regenerate=False), MixSource("path", str(answered), 1.0)]
    with pytest.raises(DataError, match="set data.regenerate=true"):
        prepare_data(DataConfig(source="mix", mix=mix, heldout_samples=2, regenerate=True), tok,
                     generate=lambda convs: ["Blue." for _ in convs], log=lambda m: None)
