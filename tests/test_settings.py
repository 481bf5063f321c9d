"""Every setting checked once, before anything runs (settings.py), and draft methods as plug-ins: everything
about a method is asked of its registered ``DraftMethod`` (methods/<name>/), so nothing outside methods/ names one."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from specforge_lite.compose import load_config
from specforge_lite.methods import METHODS, draft_method
from specforge_lite.settings import check_settings, setting_problems


@pytest.mark.parametrize("overrides, said", [
    (["export.format=sgalng"], "export.format='sgalng': choose one of"),
    (["export.format=sglang", "draft.num_layers=2"], "draft.num_layers=2: SGLang's EAGLE3 draft is one layer"),
    (["export.format=sglang", "draft.parallel_drafting=true"], "the sglang format has no mask slots"),
    (["export.format=sglang", "draft.norm_before_residual=true"], "SGLang's EAGLE3 draft always takes the residual"),
    (["draft=dflash", "draft.norm_before_residual=true"], "does not take draft.norm_before_residual"),
    (["draft=dflash", "draft.ttt_length=3"], "draft=dflash does not take draft.ttt_length"),  # (EAGLE3's setting)
    (["draft=dflash", "draft.block_size=6"], "draft=dflash with draft.block_size=6 proposes 5 tokens per block but is "
                                             "served with eval.num_draft_tokens=3"),
    (["draft=dspark", "draft.block_size=0"], "draft.block_size=0: allowed [1, inf)"),
    (["draft.block_size=4"], "draft=eagle3 does not take draft.block_size"),
    (["export.format=dflash"], "export.format=dflash cannot write a eagle3 draft"),
    (["draft=dflash", "eval.drafting=tree"], "dflash draft is evaluated greedy and as a chain"),
    (["draft.parallel_drafting=true", "eval.drafting=tree"], "P-EAGLE) draft proposes one chain"),
    (["draft=medusa"], "draft=medusa: no such method; use one of dflash, dflash2, dspark, eagle3"),
    (["draft.freeze_lm_head=true", "draft.init_lm_head_from_target=false"], "a frozen lm_head would keep its random"),
    (["trainer.optimizer=muon", "trainer.deepspeed.enabled=true"], "which Muon cannot orthogonalise as matrices"),
    (["trainer=zero2"], "use trainer.optimizer=adamw under DeepSpeed (the embedded recipe"),  # (its Muon)
    (["draft.ttt_attention=flash"], "draft.ttt_attention='flash': use one of blockwise, flex, dense, sdpa"),
    (["draft.ttt_attention=flex"], "draft.ttt_attention=flex needs a CUDA device"),  # (these machines have none)
    # (a data.path no source reads: once dropped silently, a missing file passing too)
    (["data.path=/nowhere/chats.jsonl"], "data.path=/nowhere/chats.jsonl is read only with data.source=path, and "
     "data.source is mix: use data=sharegpt data.path=/nowhere/chats.jsonl (or add {source: path, path: ...}"),
    (["data=chitchat", "data.path=chats.parquet"], "data.source is builtin_chitchat: use data=sharegpt "
     "data.path=chats.parquet"),
    # (each of these was composed without a word, then never read: the run trained on something else)
    (["data.store=/stores/s"], "data.store=/stores/s is read only with data.source=offline, and data.source is mix: "
     "add data.source=offline, or drop data.store"),
    (["data.store_order=shard"], "data.store_order=shard is read only with data.source=offline"),
    (["data.generation.server_url=http://127.0.0.1:8000/v1"], "data.generation.server_url=http://127.0.0.1:8000/v1 "
     "is read by data.generation.engine=openai only (auto answers in-process): set data.generation.engine=openai"),
    (["data.generation.server_model=served"], "data.generation.server_model=served is read by "
     "data.generation.engine=openai only"),
    (["eval.serve=vllm", "eval.enabled=false"], "eval.serve=vllm serves the export after the run's evaluation, and "
     "eval.enabled=false: set eval.enabled=true, or eval.serve=null"),
    (["eval.serve=vllm", "data.source=offline", "data.store=/stores/s"], "eval.serve=vllm with data.source=offline: "
     "a store-trained run is evaluated where its target runs"),
    (["eval.serve=vllm", "target.backend=vllm"], "eval.serve=vllm with target.backend=vllm: a draft trained from a "
     "served target is evaluated where its target runs in-process"),
    (["model=qwen3_moe_tiny", "target.backend=lean"], "target.backend=lean: the qwen3_moe family has no lean forward "
     "(the transformers modules would run); use target.backend=hf"),
])
def test_a_setting_no_run_could_finish_with_is_refused_before_training(overrides, said):
    """Each of these used to be refused only at the export or the evaluation, after the whole training."""
    with pytest.raises(ValueError, match=re.escape(said)):
        check_settings(load_config(["tracker=none", *overrides]))


@pytest.mark.parametrize("override, said", [
    ("data.loss_turns=al", "data.loss_turns=al: not one of all, last"),
    ("target.backend=vlm", "target.backend=vlm: not one of hf, lean"),
    ("draft.loss=kl", "draft.loss=kl: not one of soft_ce, acceptance, tv"),
    ("data.store_order=random", "data.store_order=random: not one of global, shard"),
    ("trainer.precision=fp16", "trainer.precision=fp16: not one of auto, fp32, bf16"),
    ("data.generation.engine=vllm", "data.generation.engine=vllm: not one of auto, lean, hf, openai"),
    ("eval.serve=sglang", "eval.serve=sglang: not one of vllm, null"),
    ("trainer.optimizer=sgd", "trainer.optimizer=sgd: not one of adamw, muon"),
    ("model.family=lama", "model.family=lama: not one of gemma3, gemma4, gpt_oss, llama, llama3, llama4, mistral"),
])
def test_a_closed_choice_given_another_value_is_refused_in_one_line_when_the_settings_are_composed(override, said):
    """Each of these was refused only where it is used (draft.loss once the target had loaded), and --cfg job
    printed it as a valid configuration: train.py's command line says it before Hydra composes anything."""
    from specforge_lite.train import cli

    with pytest.raises(ValueError) as refused:
        load_config(["tracker=none", override])
    assert str(refused.value).startswith(said) and "\n" not in str(refused.value)
    for command in ([override], ["--cfg", "job", override]):
        with pytest.raises(SystemExit) as exited, pytest.MonkeyPatch.context() as patch:
            patch.setattr(sys, "argv", ["train.py", *command])
            cli()
        assert str(exited.value.code).startswith(f"error: {said}") and "\n" not in str(exited.value.code)


def test_a_closed_choice_is_its_value_in_code_and_in_the_saved_config():
    """A choice compares with, prints as and is saved as its value; an earlier version's name for one reads as it
    (target.backend=custom, the lean backend's; data.source=jsonl, path's), and a sweep's values are checked each."""
    from omegaconf import OmegaConf

    config = load_config(["tracker=none", "data.loss_turns=last", "target.backend=custom", "data=sharegpt",
                          "data.source=jsonl", "data.path=chats.jsonl"])
    assert config.data.loss_turns == "last" and f"{config.data.loss_turns}" == "last"
    assert config.target.backend == "lean" and config.data.source == "path"
    saved = OmegaConf.to_yaml(OmegaConf.structured(config))
    assert "loss_turns: last\n" in saved and "backend: lean\n" in saved and "source: path\n" in saved
    with pytest.raises(ValueError, match="^data.loss_turns=first: not one of all, last$"):
        load_config(["data.loss_turns=all,first"])


def test_a_real_target_trains_with_the_scale_recipe_and_says_so_before_loading(tmp_path):
    """Tried as a new user would: the mission's command, the README's GPU quick start and a folder of one's own
    compose the recipe for real training (the target's own answers, rows of 2048, a 32k vocabulary, TTT 7,
    epochs, AdamW), and the run says what it will do before the target loads (the hub is out of reach here, so
    the load is where it stops). The embedded default and the small offline presets keep the 2-core demo; a
    named recipe is kept, and the demo's on a real target is announced."""
    for overrides in (["model=gemma4", "draft.use_aux_norm=true"], ["model=llama3_8b"],
                      ["model.path=/models/mine", "model.family=llama"]):
        c = load_config(["tracker=none", *overrides])
        assert (c.recipe_name, c.data.regenerate, c.draft.draft_vocab_size, c.draft.ttt_length, c.trainer.epochs,
                c.trainer.optimizer) == ("scale", True, 32000, 7, 2, "adamw") and c.data.max_length >= 2048, overrides
    for overrides in ([], ["model=llama3_tiny"], ["model=gemma3_270m"]):
        assert load_config(["tracker=none", *overrides]).recipe_name == "cpu_20min", overrides
    assert load_config(["model=llama3_8b", "recipe=none"]).recipe_name == "none"
    said = {}
    for recipe in ([], ["recipe=cpu_20min"]):
        run = subprocess.run([sys.executable, str(ROOT / "train.py"), "model=llama3_8b", "tracker=none", *recipe,
                              f"output_dir={tmp_path / str(len(recipe))}"], cwd=ROOT, capture_output=True, text=True,
                             timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert run.returncode == 1 and "is not reachable" in run.stderr and "Traceback" not in run.stderr
        said[tuple(recipe)] = [x for x in run.stdout.splitlines() if x.startswith("[")]
    assert said[()] == [said[()][0]] and said[()][0].startswith(
        "[recipe] scale: llama3_8b on builtin_chitchat+self_generated, the target's own answers")
    assert "rows up to 2048 tokens; draft vocabulary 32000, ttt length 7; 2 epochs" in said[()][0]
    demo = said[("recipe=cpu_20min",)]
    assert demo[0].startswith("[recipe] cpu_20min: llama3_8b") and "leave recipe out (recipe=scale" in demo[1]


def test_every_problem_is_said_at_once_and_train_py_says_them_before_building_anything(tmp_path):
    overrides = ["trainer.micro_batch_size=0", "export.format=sglang", "draft.num_layers=2", "eval.drafting=tree",
                 "eval.tree_budget=0"]
    problems = setting_problems(load_config(["tracker=none", *overrides]))
    assert len(problems) == 3 and "trainer.micro_batch_size=0: allowed [1, inf)" in problems[0]
    run = subprocess.run([sys.executable, str(ROOT / "train.py"), "model=llama3_tiny", "tracker=none", *overrides,
                          f"output_dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and run.stderr.startswith("error: trainer.micro_batch_size=0")
    assert "SGLang's EAGLE3 draft is one layer" in run.stderr and "Traceback" not in run.stderr
    assert "[target]" not in run.stdout  # refused before the target was built


@pytest.mark.parametrize("recipe", ["cpu_20min", "scale", "none"])
def test_every_registered_method_with_its_own_defaults_passes_the_settings_checks(recipe):
    """``python train.py draft=<name>`` as written, for every method registered: its own settings (EAGLE3's unroll,
    a block draft's block) default to what its checks take at the recipe's k, with no setting named here (a block
    draft's defaults were once refused: the recipe's EAGLE3 unroll was read as its block)."""
    for name, method in METHODS.items():
        config = load_config(["tracker=none", f"recipe={recipe}", f"draft={name}"])
        assert type(config.draft) is method.settings and setting_problems(config) == [], name
        assert method.scored_steps(config.draft) >= 1


def test_no_method_is_named_outside_its_own_module():
    """The house rule of the plug-ins: outside methods/, code asks the method (``draft_method(name).<what>``) and
    never compares a method's name. Config defaults and the exporters' own server vocabulary (speculators'
    model type "eagle3", the export format named dflash) are names of settings and formats, not branches."""
    # a comparison with a method's name, or a table keyed by the names (how the branches looked before)
    branch = re.compile(r"""method\s*(==|!=|\bin\b|\bnot in\b)\s*[("'\[]|[{,]\s*["'](eagle3|dflash2?|dspark)["']\s*:""")
    found = []
    for path in sorted((ROOT / "specforge_lite").rglob("*.py")):
        if "methods" in path.relative_to(ROOT).parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if branch.search(line.split("#")[0]):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def test_a_method_registered_elsewhere_is_checked_exported_and_labelled_without_touching_other_modules():
    """What adding a method costs outside its own module: nothing but the registration. A method registered
    here (EAGLE3's model under another name, its own refusal, label and export format) is chosen with
    draft=<name> and asked by the settings check, the export-format choice and the ranking's label, none of which
    was edited for it; its format is export.format=<its name> while it is registered, and refused for the others."""
    from specforge_lite.methods import register
    from specforge_lite.export import FORMATS, export_format

    base = draft_method("eagle3")
    own = type("PluginFormat", (type(base.export_formats[0]),), {"name": "plugin_test_format"})()
    variant = dataclasses.replace(base, name="eagle3_plugin_test",
                                  refused=lambda config: ["eagle3_plugin_test refuses everything"],
                                  label=lambda spec: "the plug-in test's draft",
                                  export_formats=(*base.export_formats, own))
    register(variant)
    try:
        config = load_config(["tracker=none", "draft=eagle3_plugin_test"])  # (a draft group option by registering)
        assert config.draft.method == "eagle3_plugin_test"
        assert "eagle3_plugin_test refuses everything" in setting_problems(config)
        assert export_format("vllm", "eagle3_plugin_test").name == "vllm"
        assert export_format("plugin_test_format", "eagle3_plugin_test") is own
        assert "export.format=plugin_test_format cannot write a eagle3 draft" in " ".join(
            setting_problems(load_config(["tracker=none", "export.format=plugin_test_format"])))
        assert draft_method("eagle3_plugin_test").label({}) == "the plug-in test's draft"
    finally:
        del METHODS["eagle3_plugin_test"]
    assert "plugin_test_format" not in FORMATS


@pytest.mark.parametrize("recipe", ["cpu_20min", "none"])
def test_each_method_owns_its_defaults_eagle3s_are_eagle_31s_and_no_documented_command_is_refused(recipe):
    """EAGLE 3.1's norms are EAGLE3's default (they won every comparison of docs/levers.md), and they are the
    method's, not the recipe's: a block draft and the per-aux norm (the brief's own example command) leave
    them off instead of being refused for them, and what the user sets explicitly wins. Read from the spec
    the run's draft is built with (what checkpoints and exports record)."""
    from transformers import LlamaConfig

    from specforge_lite.methods import draft_spec

    target = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256)

    def norms(*overrides):
        config = load_config(["tracker=none", f"recipe={recipe}", *overrides])
        assert setting_problems(config) == [], overrides
        spec = draft_spec(target, config.draft, [2, 4, 5], "input", 256, 128, 64)
        return tuple(getattr(spec, norm, None) for norm in ("norm_before_fc", "use_aux_norm", "norm_output"))

    assert norms() == (True, False, True)
    assert norms("draft.use_aux_norm=true") == (False, True, False)
    assert norms("draft.norm_before_fc=false", "draft.norm_output=false") == (False, False, False)
    assert norms("draft.norm_output=false") == (True, False, False)
    for method in ("dflash", "dspark", "dflash2"):
        # (a block draft's spec has no norms)
        assert norms(f"draft={method}", "draft.mask_token_id=1") == (None, None, None)
    refused = setting_problems(load_config(["tracker=none", "draft.use_aux_norm=true", "draft.norm_before_fc=true"]))
    assert any("not both" in p for p in refused)


def test_left_null_the_step_takes_the_way_measured_fastest_and_correct_on_its_device():
    """On a GPU the default step is flex attention with the compiled chains and 4096-row loss chunks (the H200's
    measurement, docs/benchmarks.md); on a CPU blockwise, eager, 512 rows; a value the user sets is kept."""
    import torch

    from specforge_lite.methods.eagle3.objective import TTTObjective

    def on(device: str, draft) -> dict:
        return {n: TTTObjective.device_defaults.value(n, getattr(draft, n), torch.device(device))
                for n in ("ttt_attention", "compile", "loss_chunk_rows")}

    default = load_config(["tracker=none"]).draft
    assert on("cuda", default) == {"ttt_attention": "flex", "compile": True, "loss_chunk_rows": 4096}
    assert on("cpu", default) == {"ttt_attention": "blockwise", "compile": False, "loss_chunk_rows": 512}
    chosen = load_config(["tracker=none", "draft.ttt_attention=sdpa", "draft.compile=false",
                          "draft.loss_chunk_rows=1024"]).draft
    assert on("cuda", chosen) == {"ttt_attention": "sdpa", "compile": False, "loss_chunk_rows": 1024}
    from specforge_lite.run import describe_step

    # the run's log says which way its step takes and that the device chose it
    assert describe_step(default, torch.device("cuda")) == (
        "draft.ttt_attention=flex (cuda's default), draft.compile=true (cuda's default), "
        "draft.loss_chunk_rows=4096 (cuda's default)")
    assert describe_step(chosen, torch.device("cpu")) == (
        "draft.ttt_attention=sdpa, draft.compile=false, draft.loss_chunk_rows=1024")
