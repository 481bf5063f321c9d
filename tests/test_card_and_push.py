"""The export's model card as the hub reads it (its YAML front matter, parsed by huggingface_hub's own parser),
``python -m specforge_lite.export --push ORG/NAME`` with the hub client pointed at nothing (offline, a closed port,
no login, a folder --check refuses), and the CUDA allocator setting a run makes and names in its ``[step]`` line.

Every card here is built from files written in tmp_path, as export/card.py reads them (the export's config.json,
the run's config.yaml, eval.json, data_stats.json): no training, no download."""

from __future__ import annotations

import json
import re
import socket

import pytest
import torch
import yaml

from conftest import tiny_draft, tiny_target
from specforge_lite.export import export_draft
from specforge_lite.export.card import write_model_card

HUB_TARGET = "meta-llama/Llama-3.1-8B-Instruct"


def _export(tmp_path, fmt="vllm", target=HUB_TARGET):
    """A tiny draft's export (config.json and model.safetensors, as export_draft writes them), in RUN/final."""
    model = tiny_target(aux_ids=[2, 4, 6])
    draft = tiny_draft(model, draft_vocab_size=100)
    return export_draft(draft.trainable_state_dict(), draft.spec, fmt, tmp_path / "run" / "final",
                        verifier={"name_or_path": target})


def _run_files(run, model: dict, data: dict | None = None):
    """The run's records the card reads: config.yaml, eval.json, data_stats.json and the newest checkpoint's name."""
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(yaml.safe_dump({
        "model": {"name": "custom", "source": "auto", "path": "", **model},
        "data": data or {"source": "builtin_chitchat"}, "draft": {}, "eval": {"num_draft_tokens": 3}}))
    (run / "eval.json").write_text(json.dumps({
        "mean_acceptance_length": 2.5, "num_draft_tokens": 3, "prompts": 8, "temperature": 0,
        "sets": {"chat": {"mean_acceptance_length": 2.5}}}))
    (run / "data_stats.json").write_text(json.dumps({"train": 100, "heldout": 8, "rows": 110,
                                                     "skipped": {"no answer": 2}}))
    (run / "checkpoints").mkdir(exist_ok=True)
    (run / "checkpoints" / "latest").write_text("step_000010")


def _card(tmp_path, model: dict, data: dict | None = None, fmt="vllm"):
    out = _export(tmp_path, fmt, model.get("path") or "a local target")
    _run_files(tmp_path / "run", model, data)
    return write_model_card(out, tmp_path / "run")


def test_the_card_carries_front_matter_the_hubs_own_parser_reads(tmp_path):
    """README.md opens with the hub's YAML metadata: the target's hub id as base_model, vLLM as the library that
    loads it, text-generation, the method's and the engines' tags, the hub datasets it was trained on, no licence
    (none is known). Failed: the card had no front matter (metadata_load found none)."""
    from huggingface_hub import ModelCard
    from huggingface_hub.repocard import metadata_load
    from huggingface_hub.utils import validate_repo_id

    card = _card(tmp_path, {"name": "llama3_8b", "path": HUB_TARGET},
                 {"source": "path", "path": "hf:HuggingFaceH4/ultrachat_200k:train_sft"})
    meta = metadata_load(card)
    assert meta is not None, "no YAML front matter in the card"
    assert meta["base_model"] == HUB_TARGET
    validate_repo_id(meta["base_model"])
    assert meta["library_name"] == "vllm" and meta["pipeline_tag"] == "text-generation"
    assert {"speculative-decoding", "eagle3", "vllm", "sglang", "specforge_lite"} <= set(meta["tags"])
    assert meta["datasets"] == ["HuggingFaceH4/ultrachat_200k"]
    assert "license" not in meta
    parsed = ModelCard.load(card)  # (the hub's own class: the front matter and the body it keeps apart)
    assert parsed.data.base_model == HUB_TARGET and parsed.data.library_name == "vllm"
    assert parsed.text.lstrip().startswith("# EAGLE3") and f"vllm serve {HUB_TARGET}" in parsed.text


@pytest.mark.parametrize("model", [
    pytest.param({"name": "llama3_tiny", "source": "tiny"}, id="tiny-preset"),
    pytest.param({"path": "LOCAL"}, id="local-folder"),
    pytest.param({"path": "models/llama", "source": "local"}, id="relative-local-path"),
])
def test_base_model_is_a_hub_id_or_absent(tmp_path, model):
    """A target that is not on the hub (a folder, a tiny preset built here) gives no base_model: the hub would
    link a path as a model id. Failed: no front matter at all."""
    from huggingface_hub.repocard import metadata_load

    if model.get("path") == "LOCAL":
        (tmp_path / "models" / "llama").mkdir(parents=True)
        model = {"path": str(tmp_path / "models" / "llama")}
    meta = metadata_load(_card(tmp_path, model))
    assert meta is not None and meta["pipeline_tag"] == "text-generation"
    assert "base_model" not in meta and "base_model_relation" not in meta


def test_an_sglang_export_names_sglang_as_its_library(tmp_path):
    """The sglang export is loaded by SGLang (vLLM would read its ids one layer early). Failed: no front matter."""
    from huggingface_hub.repocard import metadata_load

    meta = metadata_load(_card(tmp_path, {"name": "llama3_8b", "path": HUB_TARGET}, fmt="sglang"))
    assert meta is not None and meta["library_name"] == "sglang" and "sglang" in meta["tags"]


@pytest.mark.parametrize("method, options", [
    ("eagle3", {}), ("eagle3", {"parallel_drafting": True, "mask_token_id": 5}), ("dflash", {}), ("dflash2", {}),
    ("dspark", {"markov_rank": 8})])
def test_the_cards_vllm_command_is_the_speculative_config_vllm_is_served_with_in_the_tests(tmp_path, method, options):
    """The card's --speculative-config is what eval/vllm_acceptance.py (which serves our exports in
    tests/test_serving.py) gives vLLM for the folder: a P-EAGLE draft's parallel_drafting and a DSpark draft's
    adaptive verification included, which vLLM reads from its speculative config and not from the folder. Failed
    for DSpark: the judge left enable_adaptive_verification out (vLLM's CPU build cannot serve DSpark, so no serving
    test would have shown it)."""
    import importlib.util

    from conftest import ROOT
    from test_dflash import tiny_block_draft

    spec_ = importlib.util.spec_from_file_location("vllm_acceptance", ROOT / "eval" / "vllm_acceptance.py")
    judge = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(judge)
    model = tiny_target(aux_ids=[2, 4, 6])
    draft = (tiny_draft(model, draft_vocab_size=100, **options) if method == "eagle3" else
             tiny_block_draft(model, method, draft_vocab=None if method == "dflash2" else 100, **options))
    out = export_draft(draft.trainable_state_dict(), draft.spec, "vllm", tmp_path / "run" / "final",
                       verifier={"name_or_path": HUB_TARGET})
    _run_files(tmp_path / "run", {"name": "llama3_8b", "path": HUB_TARGET})
    card = write_model_card(out, tmp_path / "run").read_text()
    said = json.loads(re.search(r"--speculative-config '(\{.*?\})'", card).group(1))
    assert said == judge.speculative_config(out, said["num_speculative_tokens"])
    assert said["num_speculative_tokens"] == 3  # (a block draft's own k: its default block, the card's eval k)


# ---- --push ---------------------------------------------------------------------------------------------------

def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def hub_at_nothing(monkeypatch, tmp_path):
    """The hub client pointed at a closed port on this machine, online, with a (fake) token."""
    from huggingface_hub import constants

    endpoint = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.delenv("HF_OIDC_RESOURCE", raising=False)
    return endpoint


def _push(argv) -> str:
    """The one-line error ``python -m specforge_lite.export`` ends with (its exit message)."""
    from specforge_lite.export.__main__ import main

    with pytest.raises(SystemExit) as stopped:
        main(argv)
    said = str(stopped.value.code)
    assert said.startswith("error: ") and said.count("\n") <= 1, said  # (the message, then the traceback hint)
    return said.splitlines()[0]


def test_push_offline_says_it_did_not_happen_why_and_how_to_retry(tmp_path, hub_at_nothing, monkeypatch):
    """HF_HUB_OFFLINE=1: one line, no network. Failed: --push was not an option (argparse exit 2)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    out = _export(tmp_path)
    said = _push(["--push", "org/draft", "--export", str(out)])
    assert "not pushed" in said and "HF_HUB_OFFLINE=1" in said and "run the same command" in said


def test_push_to_an_unreachable_hub_says_so_in_one_line(tmp_path, hub_at_nothing):
    """The hub at a closed port: one line naming the endpoint and the retry, well under a second (no retry loop).
    Failed: --push was not an option."""
    import time

    out = _export(tmp_path)
    started = time.monotonic()
    said = _push(["--push", "org/draft", "--export", str(out)])
    assert "not pushed" in said and hub_at_nothing in said and "cannot be reached" in said
    assert "run the same command" in said and time.monotonic() - started < 2


def test_push_without_a_login_says_to_log_in(tmp_path, hub_at_nothing, monkeypatch):
    """No token anywhere (no HF_TOKEN, no token file): one line saying how to log in, before any request.
    Failed: --push was not an option."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    out = _export(tmp_path)
    said = _push(["--push", "org/draft", "--export", str(out)])
    assert "not pushed" in said and "hf auth login" in said and "HF_TOKEN" in said


def test_push_refuses_a_folder_the_check_finds_errors_in(tmp_path, hub_at_nothing):
    """A folder --check finds errors in (weights missing) is not pushed: one line naming the check.
    Failed: --push was not an option."""
    out = _export(tmp_path)
    (out / "model.safetensors").unlink()
    said = _push(["--push", "org/draft", "--export", str(out)])
    assert "not pushed" in said and "--check" in said and "no *.safetensors" in said


def test_push_refuses_a_repo_id_that_is_not_org_name(tmp_path, hub_at_nothing):
    out = _export(tmp_path)
    said = _push(["--push", "not a repo", "--export", str(out)])
    assert "--push" in said and "ORG/NAME" in said


def test_push_creates_the_repo_and_uploads_the_folder_with_a_card_for_the_hub(tmp_path, hub_at_nothing,
                                                                             monkeypatch, capsys):
    """With a hub that answers (a stand-in for HfApi): create_repo(exist_ok) then upload_folder of the export, its
    card rewritten so the serve commands name the hub repository, not this machine's folder. --run-dir alone pushes
    RUN/final. Failed: --push was not an option."""
    import huggingface_hub

    calls = []

    class FakeApi:
        def __init__(self, *args, **kwargs):
            pass

        def create_repo(self, repo_id, **kwargs):
            calls.append(("create_repo", repo_id, kwargs))
            return f"https://hub.example/{repo_id}"

        def upload_folder(self, **kwargs):
            calls.append(("upload_folder", kwargs["repo_id"], kwargs))
            return "commit"

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    out = _export(tmp_path)
    _run_files(tmp_path / "run", {"name": "llama3_8b", "path": HUB_TARGET})
    from specforge_lite.export.__main__ import main

    main(["--push", "org/draft", "--run-dir", str(tmp_path / "run"), "--private"])
    (create, repo, options), (upload, repo2, kwargs) = calls
    assert (create, repo, upload, repo2) == ("create_repo", "org/draft", "upload_folder", "org/draft")
    assert options["exist_ok"] is True and options["private"] is True
    assert str(kwargs["folder_path"]) == str(out)
    card = (out / "README.md").read_text()
    assert '"model": "org/draft"' in card and str(out) not in card.split("## Serve it with vLLM")[1]
    assert "org/draft" in capsys.readouterr().out


# ---- the CUDA allocator ---------------------------------------------------------------------------------------

def test_a_cuda_run_sets_expandable_segments_unless_the_user_set_the_allocator():
    """On CUDA, with neither allocator variable set: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before
    CUDA starts: after, it would change nothing, and the run says so); a user's value, under either name, is left as
    set and named; nothing on CPU. Failed: run.py had no allocator_setting."""
    from specforge_lite.run import ALLOC_CONF, EXPANDABLE, allocator_setting

    changes, said = allocator_setting({}, "cuda")
    assert changes[ALLOC_CONF] == EXPANDABLE == "expandable_segments:True"
    assert f"{ALLOC_CONF}={EXPANDABLE}" in said and "set by the run" in said
    assert allocator_setting({}, "cuda:1")[0][ALLOC_CONF] == EXPANDABLE
    # the second call of the same process (the run's own setting, seen again): nothing to set, said the same way
    again, said_again = allocator_setting(changes, "cuda")
    assert again == {} and "set by the run" in said_again
    for name in (ALLOC_CONF, "PYTORCH_ALLOC_CONF"):
        kept, said = allocator_setting({name: "max_split_size_mb:128"}, "cuda")
        assert kept == {} and f"{name}=max_split_size_mb:128" in said and "yours" in said
    late, said = allocator_setting({}, "cuda", cuda_initialized=True)
    assert late == {} and "not set" in said and "initialised" in said
    assert allocator_setting({}, "cpu") == ({}, None)


def test_the_step_line_names_the_allocator_setting():
    """The [step] line of a CUDA run says what the allocator runs with. Failed: describe_step took no allocator."""
    from specforge_lite.compose import load_config
    from specforge_lite.run import allocator_setting, describe_step

    draft = load_config(["tracker=none"]).draft
    _, said = allocator_setting({}, "cuda")
    line = describe_step(draft, torch.device("cuda"), said)
    assert line.startswith("draft.ttt_attention=flex (cuda's default)")
    assert re.search(r"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \(set by the run", line)
    assert describe_step(draft, torch.device("cpu"), None) == describe_step(draft, torch.device("cpu"))


def test_the_run_sets_the_allocator_before_anything_touches_cuda(monkeypatch, tmp_path):
    """job.run decides the allocator first: the variable is in the environment when the process group starts (the
    first thing that may start CUDA, before the target). On a CPU machine, with model.device=cuda and the group
    stopped there. Failed: run.py had no use_expandable_segments (and job.run set nothing)."""
    import os

    from specforge_lite import job
    from specforge_lite import run as run_module
    from specforge_lite.compose import load_config
    from specforge_lite.training import distributed

    for name in (run_module.ALLOC_CONF, run_module.ALLOC_CONF_NEW, run_module.SET_BY_RUN):
        monkeypatch.setenv(name, "")  # (recorded as absent, so the teardown removes what the run sets)
        monkeypatch.delenv(name)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)

    class GroupStarted(Exception):
        pass

    def group(trainer_settings):
        raise GroupStarted(os.environ.get(run_module.ALLOC_CONF))

    monkeypatch.setattr(distributed, "init_distributed", group)
    with pytest.raises(GroupStarted, match="^expandable_segments:True$"):
        job.run(load_config(["model=llama3_tiny", "tracker=none", "model.device=cuda"]), tmp_path / "run",
                log=lambda m: None)
    # again in the same process (adapt's candidates): the run's own setting, said as such, not as the user's
    assert "set by the run" in run_module.use_expandable_segments("cuda:0")
