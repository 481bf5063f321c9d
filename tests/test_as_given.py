"""What a user names is used as given, or refused in one line before any weight loads: a model path (a hub id, a
folder, a mistyped one), a public draft's hub id, the natural commands around the recipe. The hub is out of reach
here, as on many users' cluster nodes: a hub id is read from a hub cache laid out as huggingface_hub lays it out."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import ROOT
from specforge_lite.compose import load_config
from specforge_lite.config import with_recipe
from specforge_lite.methods import METHODS

FIXTURES = Path(__file__).parent / "fixtures"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cached_on_hub(cache: Path, repo_id: str, folder: Path) -> Path:
    """``folder`` as the hub cache holds repository ``repo_id`` after a download (refs/main -> one snapshot)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return repo / "snapshots" / COMMIT


@pytest.fixture
def offline_hub(tmp_path, monkeypatch) -> Path:
    """An empty hub cache, the hub switched off (HF_HUB_OFFLINE=1 as read at each call)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_model_path_names_that_target_never_the_presets_package():
    """model.path on the default preset (docs/targets.md's form) once fetched SmolLM2 from its registry package
    and named the run smollm2_135m; on a tiny preset it built the tiny model."""
    given = load_config(["model.path=Qwen/Qwen3-8B", "model.family=qwen3"])
    assert (given.model.name, given.model.path, given.model.registry, given.recipe_name) == \
        ("Qwen3-8B", "Qwen/Qwen3-8B", None, "scale")
    folder = load_config(["model=llama3_tiny", "model.path=/models/my-llama/"]).model
    assert (folder.name, folder.tiny, folder.source) == ("my-llama", None, "auto")
    preset = load_config([]).model  # (the preset's own path: its package holds that model)
    assert preset.name == "smollm2_135m" and preset.registry is not None


def test_a_hub_id_is_its_cached_snapshot_and_a_missing_one_or_a_typo_is_refused_in_one_line(offline_hub):
    from specforge_lite.targets.acquire import ModelUnavailableError, resolve_model_dir, tiny_model_dir

    tiny = load_config(["model=llama3_tiny"]).model
    snapshot = cached_on_hub(offline_hub, "acme/tiny-llama", tiny_model_dir(tiny))
    model = load_config(["model=llama3_tiny", "model.path=acme/tiny-llama"]).model
    assert resolve_model_dir(model) == str(snapshot)
    for path, said in (("Qwen/Qwen3-8B", "^model.path=Qwen/Qwen3-8B is not in the local hub cache"),
                       ("/models/typo", "model.path=/models/typo: no such folder")):
        with pytest.raises(ModelUnavailableError, match=said) as e:
            resolve_model_dir(load_config([f"model.path={path}"]).model)
        assert "HF_HUB_OFFLINE=1" in str(e.value) if path.startswith("Qwen") else "hub cache" not in str(e.value)
        assert "smollm2" not in str(e.value)


def test_a_public_drafts_hub_id_is_checked_as_its_folder(offline_hub, capsys):
    from specforge_lite.export.__main__ import main

    snapshot = cached_on_hub(offline_hub, "acme/eagle3-draft", FIXTURES / "published" / "specforge")
    with pytest.raises(SystemExit) as ended:
        main(["--check", "acme/eagle3-draft"])
    assert ended.value.code == 0 and capsys.readouterr().out.startswith(f"{snapshot}: llama-eagle3 (vLLM, SGLang)")
    with pytest.raises(SystemExit, match="--check=acme/missing-draft is not in the local hub cache"):
        main(["--check", "acme/missing-draft"])


def test_the_recipe_goes_with_the_overrides_so_hydras_flags_parse_and_sweeps_of_real_targets_keep_it():
    assert with_recipe(["model=llama3_8b", "--cfg", "job"]) == ["model=llama3_8b", "recipe=scale", "--cfg", "job"]
    assert with_recipe(["--info", "config", "model=llama3_8b"])[-1] == "recipe=scale"
    assert "recipe=scale" in with_recipe(["-m", "model=llama3_8b,qwen3_8b"])
    assert "recipe=scale" not in with_recipe(["-m", "model=llama3_tiny,qwen3_tiny"])
    with pytest.raises(ValueError, match="mixes small offline presets \\(llama3_tiny\\) with real targets"):
        with_recipe(["-m", "model=llama3_tiny,llama3_8b"])


def test_data_regenerate_false_alone_turns_regeneration_off():
    """The default recipe's rounds of answers and its self-generated requests follow regeneration off (refused
    before, naming data.generation.max_minutes, which the user never set)."""
    from specforge_lite.job import describe_recipe
    from specforge_lite.settings import setting_problems

    config = load_config(["tracker=none", "data.regenerate=false"])
    assert setting_problems(config) == []
    line = describe_recipe(config, METHODS["eagle3"])[0]
    assert "on builtin_chitchat (self_generated left out" in line and "the answers as written" in line
    assert "a round" not in line


def test_the_recipe_line_says_what_is_trained():
    from specforge_lite.job import describe_recipe

    line = describe_recipe(load_config(["tracker=none", "draft.init_from=/drafts/published"]), METHODS["eagle3"])[0]
    assert "continuing the draft of /drafts/published (its vocabulary" in line and "vocabulary 8192" not in line
    line = describe_recipe(load_config(["tracker=none", "data.source=offline", "data.store=/stores/s"]),
                           METHODS["eagle3"])[0]
    assert "on the hidden-state store /stores/s, its stored states" in line and "regenerated" not in line
    line = describe_recipe(load_config(["tracker=none"]), METHODS["eagle3"])[0]
    assert "draft vocabulary 8192, ttt length 4;" in line
    for method, block in (("dflash", 4), ("dspark", 3)):  # (a block draft unrolls no TTT: its block is said)
        line = describe_recipe(load_config(["tracker=none", f"draft={method}"]), METHODS[method])[0]
        assert f"draft vocabulary 8192, block size {block};" in line and "ttt" not in line.lower()


def run_train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_a_new_users_natural_commands_do_what_they_say_or_stop_in_one_line(tmp_path):
    shown = run_train("model=llama3_8b", "--cfg", "job")  # (exit 2 before: "unrecognized arguments: recipe=scale")
    assert shown.returncode == 0 and "recipe_name: scale" in shown.stdout, shown.stderr
    typo = run_train("model.path=/models/typo", "tracker=none", f"output_dir={tmp_path / 'run'}")
    assert typo.returncode == 1 and "Traceback" not in typo.stderr
    assert typo.stderr.startswith("error: model.path=/models/typo: no such folder; give an existing folder, or a hub "
                                  "id as org/name\n("), typo.stderr
    assert "[target]" not in typo.stdout and typo.stdout.startswith("[recipe] scale: typo on")


def test_a_file_the_run_cannot_train_on_is_refused_before_any_weight_loads(tmp_path):
    """Rows read and rendered with the tokenizer alone first: a 70B target under ZeRO-3 took a full load before
    a typo in the data was found."""
    from specforge_lite.data import DataError
    from specforge_lite.run import Run

    # (no answers, no regeneration; rows of this test run's own: data prepared from the same rows is cached, and
    # so taken as checked)
    run = uuid.uuid4().hex
    rows = [{"messages": [{"role": "user", "content": f"q {i} of {run}"}]} for i in range(6)]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    said = []
    config = load_config(["model=llama3_tiny", "data=sharegpt", f"data.path={tmp_path / 'chats.jsonl'}",
                          "data.regenerate=false", "tracker=none"])
    with pytest.raises(DataError, match="6 of 6 rows in"):
        Run.online(config, log=said.append)
    assert not any(m.startswith("[target]") for m in said), said
    rows[0]["messages"].append({"role": "assistant", "content": "an answer"})
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config.data.max_malformed_fraction = 0.9
    Run.online(config, log=said.append)
    assert said[0].startswith("[data] read before the target loads: 6 rows, 5 skipped (5x no assistant answer")
    assert said[1].startswith("[target]")


def test_every_export_names_the_target_it_drafts_for(tmp_path):
    """Only speculators' layout named its target: an export in another format, evaluated or adapted without
    model=..., was refused (or, before that, taken as the embedded default's draft)."""
    from conftest import tiny_draft, tiny_target
    from specforge_lite.evaluate.finished import target_overrides
    from specforge_lite.export import export_draft

    draft = tiny_draft(tiny_target(aux_ids=[2, 4, 6]))
    for fmt in ("vllm", "sglang", "speculators"):
        out = export_draft(draft.trainable_state_dict(), draft.spec, fmt, tmp_path / fmt,
                           verifier={"name_or_path": "meta-llama/Llama-3.1-8B-Instruct"})
        assert target_overrides(out, []) == ["model=llama3_8b"], fmt
