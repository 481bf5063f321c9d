"""What a user names is used as given, or refused in one line before any weight loads: a model path (a hub id, a
folder, a mistyped one), a public draft's hub id, the natural commands around the recipe. The hub is out of reach
here, as on many users' cluster nodes: a hub id is read from a hub cache laid out as huggingface_hub lays it out."""

from __future__ import annotations

import json
import os
import re
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


def test_eval_serve_without_a_serving_environment_is_refused_before_training(tmp_path, monkeypatch):
    """It was said at the end of the run ("[serve] skipped"), after the whole training, as target.backend=vllm
    without one never was."""
    from specforge_lite.settings import setting_problems

    monkeypatch.setenv("SPECFORGE_LITE_SERVING_PYTHON", str(tmp_path / "no-python"))
    problems = setting_problems(load_config(["tracker=none", "eval.serve=vllm"]))
    assert problems == ["eval.serve=vllm serves the export from the serving environment, and there is none: build it "
                        "with bash scripts/setup_serving.sh, or set eval.serve=null (python -m "
                        "specforge_lite.evaluate.served RUN serves it later)"]


def test_the_run_length_the_user_gives_replaces_the_recipes():
    """trainer.max_steps=500 on a real target trained the scale recipe's 2 epochs, the recipe line saying so and
    nothing of the 500; given both, the epochs won unsaid."""
    from specforge_lite.job import describe_recipe

    config = load_config(["model=llama3_8b", "trainer.max_steps=500"])
    assert (config.recipe_name, config.trainer.max_steps, config.trainer.epochs) == ("scale", 500, None)
    assert "; 500 steps, " in describe_recipe(config, METHODS["eagle3"])[0]
    assert load_config(["model=llama3_8b"]).trainer.epochs == 2  # (the recipe's, given nothing)
    assert load_config(["model=llama3_8b", "trainer.epochs=3"]).trainer.epochs == 3
    with pytest.raises(ValueError, match=r"^trainer.max_steps=500 and trainer.epochs=3: a run's length is one of "
                                         r"them; drop the other"):
        load_config(["model=llama3_8b", "trainer.max_steps=500", "trainer.epochs=3"])
    shown = run_train("model=llama3_8b", "trainer.max_steps=500", "--cfg", "job")
    assert shown.returncode == 0 and "max_steps: 500" in shown.stdout and "epochs: null" in shown.stdout, shown.stderr


def test_a_whole_vocabulary_draft_refuses_a_draft_vocabulary_and_the_recipe_line_says_the_whole_one():
    from specforge_lite.job import describe_recipe

    with pytest.raises(ValueError, match=r"^draft=dflash2 drafts over the target's whole vocabulary whatever "
                                         r"draft.draft_vocab_size says: drop draft.draft_vocab_size=4096"):
        load_config(["draft=dflash2", "draft.draft_vocab_size=4096"])
    line = describe_recipe(load_config(["model=llama3_8b", "draft=dflash2"]), METHODS["dflash2"])[0]
    assert "the target's whole vocabulary" in line and "32000" not in line  # (the scale recipe's 32000: not read)


@pytest.mark.parametrize("override, said", [
    ("+foo=1", "foo: no such setting (python train.py --help lists every key)"),
    ("++trainer.max_stepz=3", "trainer.max_stepz: no such setting (python train.py --help lists every key)"),
    ("trainer.max_steps=[1,2]", "trainer.max_steps=[1,2]: Value '[1, 2]' of type 'list' could not be converted to "
                                "Integer"),
    ("trainer.max_steps=abc", "trainer.max_steps=abc: not an integer"),
    ("draft.aux_layer_ids=2,4", "draft.aux_layer_ids=2,4: Ambiguous value for argument 'draft.aux_layer_ids=2,4' 1. "
                                "To use it as a list, use key=[value1,value2]"),
])
def test_an_override_that_does_not_compose_is_said_in_one_line(override, said):
    """A traceback (ConfigKeyError from the typed tree; every tool composing with load_config) or Hydra's message
    over several lines, without the key's value."""
    with pytest.raises(ValueError) as refused:
        load_config(["tracker=none", override])
    assert str(refused.value).startswith(said) and "\n" not in str(refused.value), str(refused.value)


def test_an_unknown_key_on_train_pys_command_line_is_one_error_line(tmp_path):
    refused = run_train("model=llama3_tiny", "tracker=none", "+foo=1", f"output_dir={tmp_path / 'run'}")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert refused.stderr.startswith("error: foo: no such setting"), refused.stderr


def test_a_prompt_file_is_named_as_the_docs_spell_it_and_read_before_training(tmp_path):
    """eval.prompt_files.mtbench=PATH (docs/evaluation.md) was refused by Hydra (only +eval.prompt_files... composed),
    and the file itself was first read after the whole training: a missing or cut-short one ended the run there."""
    import gzip

    from specforge_lite.settings import setting_problems

    good = tmp_path / "question.jsonl"
    good.write_text('{"turns": ["Hello?"]}\n')
    config = load_config(["tracker=none", "eval.prompt_sets=[mtbench]", f"eval.prompt_files.mtbench={good}"])
    assert config.eval.prompt_files == {"mtbench": str(good)} and setting_problems(config) == []
    shown = run_train("tracker=none", f"eval.prompt_files.mtbench={good}", "--cfg", "job")
    assert shown.returncode == 0 and f"mtbench: {good}" in shown.stdout, shown.stderr
    cut = tmp_path / "question.jsonl.gz"
    cut.write_bytes(gzip.compress(b'{"turns": ["Hello?"]}\n' * 200)[:60])
    for path, said in ((tmp_path / "missing.jsonl", "does not exist"), (cut, "cannot be read")):
        problems = setting_problems(load_config(["tracker=none", "eval.prompt_sets=[mtbench]",
                                                 f"eval.prompt_files.mtbench={path}"]))
        assert len(problems) == 1 and f"prompt file {path} {said}" in problems[0], problems


def test_a_model_folder_whose_weight_names_do_not_fit_its_architecture_is_refused(tmp_path):
    """A checkpoint saved through a wrapper (DDP's module., torch.compile's _orig_mod.) loaded with every weight
    MISSING: transformers printed its load report and the run trained against a randomly initialised target."""
    from safetensors.torch import load_file, save_file

    from specforge_lite.targets import build_target
    from specforge_lite.targets.acquire import tiny_model_dir

    folder = tmp_path / "wrapped"
    shutil.copytree(tiny_model_dir(load_config(["model=llama3_tiny"]).model), folder)
    for path in folder.glob("*.safetensors"):
        save_file({f"module.{k}": v for k, v in load_file(str(path)).items()}, str(path), metadata={"format": "pt"})
    config = load_config(["model=llama3_tiny", f"model.path={folder}", "tracker=none"])
    with pytest.raises(ValueError, match=rf"^model folder {folder}: its weights do not fit the model: \d+ of its "
                                         r"parameters are missing \(lm_head.weight, .*\) and \d+ weights "
                                         r"there are not the model's \(module.lm_head.weight, .*\)") as refused:
        build_target(config)
    assert "\n" not in str(refused.value)


def test_a_model_config_with_a_field_of_the_wrong_type_is_named(tmp_path):
    """"num_hidden_layers": "8" ended in huggingface_hub's StrictDataclassFieldValidationError, a traceback."""
    from specforge_lite.targets import tokenizer_before_target
    from specforge_lite.targets.acquire import ModelUnavailableError, tiny_model_dir

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir(load_config(["model=llama3_tiny"]).model), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": "8"}))
    with pytest.raises(ModelUnavailableError, match=rf"^model folder {folder}: config.json does not read \(.*"
                                                    r"'num_hidden_layers' expected int, got str"):
        tokenizer_before_target(load_config(["model=llama3_tiny", f"model.path={folder}"]))


@pytest.mark.parametrize("overrides, said", [
    (["recipe=none", "trainer.muon_lr=0.1"], "trainer.muon_lr=0.1 is read only with trainer.optimizer=muon"),
    (["eval.tree_topk=4"], "eval.tree_topk=4 is read only with eval.drafting=tree"),
    (["target.server_timeout=5"], "target.server_timeout=5 is read only with target.backend=vllm"),
    (["trainer.deepspeed.zero_stage=3"], "trainer.deepspeed.zero_stage=3 is read only with "
                                         "trainer.deepspeed.enabled=true"),
    (["draft.mask_token_id=3"], "draft.mask_token_id=3 is read only with a draft with mask slots"),
    (["data.regenerate=false", "data.generation.max_new_tokens=9"], "data.generation.max_new_tokens=9 is read only "
                                                                    "with data.regenerate=true"),
    (["data=sharegpt", "data.path=x.jsonl", "data.self_generated.temperature=0.5"],
     "data.self_generated.temperature=0.5 is read only with a self_generated source in data.mix"),
])
def test_a_setting_given_where_the_run_does_not_read_it_is_refused_in_one_line(overrides, said):
    """Each has a default, so only the command line tells it was given: set, then never read (no Muon, a chain
    evaluation, no served target, no DeepSpeed, no mask slots, no regeneration, no self-generated requests)."""
    with pytest.raises(ValueError, match="^" + re.escape(said)):
        load_config(["tracker=none", *overrides])
    # what a recipe sets is not the user's: the scale recipe's generation settings, regeneration turned off
    assert load_config(["model=llama3_8b", "data.regenerate=false"]).data.generation.max_new_tokens == 1024


def test_train_py_refuses_a_setting_given_where_the_run_does_not_read_it(tmp_path):
    refused = run_train("model=llama3_tiny", "tracker=none", "eval.tree_topk=4", f"output_dir={tmp_path / 'run'}")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert refused.stderr.startswith("error: eval.tree_topk=4 is read only with eval.drafting=tree"), refused.stderr


def test_a_model_folder_without_its_tokenizer_is_one_line(tmp_path):
    """transformers' several lines ("Couldn't instantiate the backend tokenizer ..."), naming neither the folder's
    missing files nor the fix."""
    from specforge_lite.targets import tokenizer_before_target
    from specforge_lite.targets.acquire import tiny_model_dir

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir(load_config(["model=llama3_tiny"]).model), folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        (folder / name).unlink(missing_ok=True)
    with pytest.raises(ValueError, match=rf"^model folder {folder}: its tokenizer does not load \(") as refused:
        tokenizer_before_target(load_config(["model=llama3_tiny", f"model.path={folder}"]))
    assert "\n" not in str(refused.value) and "tokenizer files" in str(refused.value)


@pytest.mark.parametrize("override, said", [
    ("trainer.max_steps=abc", "trainer.max_steps=abc: not an integer"),
    ("trainer.lr=fast", "trainer.lr=fast: not a number"),
    ("eval.enabled=maybe", "eval.enabled=maybe: not true or false"),
    ("trainer.max_steps=5,x", "trainer.max_steps=x: not an integer"),
    ("draft.ttt_length=seven", "draft.ttt_length=seven: not an integer"),
])
def test_a_value_of_the_wrong_kind_is_refused_in_one_line_before_hydra(override, said):
    """Hydra's own refusal printed six lines (its merge error, OmegaConf's full_key, reference_type and object_type,
    HYDRA_FULL_ERROR) without the error: prefix; the values Hydra takes (null, a float's exponent, a sweep, an
    interpolation, every word and integer OmegaConf reads as a bool) still pass."""
    from specforge_lite.arguments import check_arguments
    from specforge_lite.config import CONF_DIR

    with pytest.raises(SystemExit) as stopped:
        check_arguments([override], CONF_DIR)
    assert str(stopped.value.code) == f"error: {said}", stopped.value.code
    for taken in ("trainer.max_steps=5", "trainer.lr=3e-4", "trainer.lr=1", "eval.enabled=false", "eval.enabled=yes",
                  "eval.enabled=y", "eval.enabled=2",
                  "trainer.epochs=null", "trainer.max_steps=1,2", "trainer.max_minutes=${trainer.lr}",
                  "trainer.max_steps=range(1,3)", "draft.ttt_length=5", "draft=dflash"):
        check_arguments([taken], CONF_DIR)
