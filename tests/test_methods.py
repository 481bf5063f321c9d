"""The draft methods as folders (specforge_lite/methods/<name>/): a saved spec of any method, written before the
methods had specs of their own (one flat spec of every method's fields), reads as its method's spec."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import LlamaConfig

from specforge_lite.compose import load_config
from specforge_lite.methods import METHODS, draft_spec, read_spec
from specforge_lite.settings import setting_problems

# The fields of the one flat spec every draft recorded before each method had its own, at the values a draft of
# another method recorded for them (written out here, as those spec.json files hold them).
FLAT_SPEC_OFF = {"use_aux_norm": False, "num_layers": 1, "norm_before_residual": False, "norm_before_fc": False,
                 "norm_output": False, "parallel_drafting": False, "mask_token_id": None, "block_size": None,
                 "method": "eagle3", "markov_rank": 0, "conv_kernel_size": 0, "conv_group_size": 0,
                 "selector_rank": 0, "selector_top_k": 0, "attention_bias": False, "mlp_bias": False, "extra": {}}
TARGET = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256)


def new_spec(method: str):
    slots = METHODS[method].has_mask_slots(METHODS[method].settings())  # (a mask token is read by mask slots only)
    config = load_config(["tracker=none", f"draft={method}", *(["draft.mask_token_id=1"] if slots else [])])
    return draft_spec(TARGET, config.draft, [2, 4, 5], "input", 256, 256, 64)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_flat_spec_written_before_the_methods_had_their_own_reads_as_the_methods_spec(method):
    spec = new_spec(method)
    flat = {**FLAT_SPEC_OFF, **spec.to_dict()}
    assert set(flat) - set(spec.to_dict()) or method == "eagle3"  # (the flat spec holds other methods' fields)
    assert read_spec(flat) == spec
    assert read_spec(spec.to_dict()) == spec  # (and a spec written now)


def test_a_spec_without_a_method_is_eagle3s_and_a_field_of_another_method_that_is_on_is_refused():
    spec = new_spec("eagle3")
    assert read_spec({k: v for k, v in spec.to_dict().items() if k != "method"}) == spec
    flat = {**FLAT_SPEC_OFF, **new_spec("dflash").to_dict(), "use_aux_norm": True}
    with pytest.raises(ValueError, match=r"a spec of a dflash draft records \{'use_aux_norm': True\}"):
        read_spec(flat)


def test_each_methods_spec_holds_the_shared_fields_and_its_own_only():
    shared = {f.name for f in dataclasses.fields(type(new_spec("eagle3")))} & {
        f.name for f in dataclasses.fields(type(new_spec("dflash")))}
    assert {"use_aux_norm", "block_size", "markov_rank", "selector_rank"}.isdisjoint(shared)
    assert "block_size" not in new_spec("eagle3").to_dict() and "use_aux_norm" not in new_spec("dspark").to_dict()


def test_draft_name_selects_settings_that_exist_for_that_method_only_and_train_py_refuses_others_in_one_line(tmp_path):
    """draft=dflash composes DFlash's settings class, which has no EAGLE3 option: one given is refused before
    anything runs, in one line, by Python's composition and by train.py alike. The mission's command still
    composes as written (draft=eagle3 is the default group), and draft.method=<name> still chooses a method."""
    import subprocess
    import sys

    from conftest import ROOT

    dflash = load_config(["tracker=none", "draft=dflash"]).draft
    assert type(dflash) is METHODS["dflash"].settings and not hasattr(dflash, "use_aux_norm")
    assert type(load_config(["tracker=none", "draft.method=dspark"]).draft) is METHODS["dspark"].settings
    mission = load_config(["model=gemma4", "draft.use_aux_norm=true"]).draft
    assert mission.method == "eagle3" and mission.use_aux_norm is True
    with pytest.raises(ValueError, match="draft=dflash does not take draft.use_aux_norm"):
        load_config(["tracker=none", "draft=dflash", "draft.use_aux_norm=true"])
    run = subprocess.run([sys.executable, str(ROOT / "train.py"), "draft=dflash", "draft.use_aux_norm=true",
                          "tracker=none", f"output_dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 1 and run.stderr.startswith("error: draft=dflash does not take draft.use_aux_norm")
    assert len(run.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_a_run_config_saved_with_every_methods_draft_settings_reads_as_its_methods():
    """A run's config.yaml saved before each method had its own settings holds all of them: another method's
    at its default reads as nothing, one that differs is refused (that run could not have had it)."""
    from omegaconf import OmegaConf

    from specforge_lite.compose import to_config

    flat = {"use_aux_norm": False, "norm_before_fc": None, "norm_output": None, "norm_before_residual": False,
            "parallel_drafting": False, "loss": "soft_ce", "init_layers_from_target": False,
            "ttt_attention": "blockwise", "checkpointing": False, "markov_rank": 64, "confidence_weight": 1.0,
            "conv_kernel_size": 2, "conv_group_size": 16, "selector_top_k": 16, "selector_rank": 64,
            "selector_weight": 1.0}
    saved = OmegaConf.to_container(OmegaConf.structured(load_config(["tracker=none", "draft=dspark"])))
    saved["draft"] = {**flat, **saved["draft"], "markov_rank": 8}
    config = to_config(OmegaConf.create(saved))
    assert type(config.draft) is METHODS["dspark"].settings and config.draft.markov_rank == 8
    saved["draft"]["use_aux_norm"] = True
    with pytest.raises(ValueError, match=r"\{'use_aux_norm': True\} are not settings of a dspark draft"):
        to_config(OmegaConf.create(saved))


# The draft settings a run's config.yaml held before the block drafts had a block of their own: draft.ttt_length
# (EAGLE3's unroll) was a block draft's k, and a config saved before each method had its own settings held every
# method's, the others' at their defaults (written out here, as those files hold them).
EARLIER_DRAFT = {"ttt_length": 5, "use_aux_norm": False, "norm_before_fc": None, "norm_output": None,
                 "norm_before_residual": False, "parallel_drafting": False, "loss": "soft_ce",
                 "init_layers_from_target": False, "ttt_attention": "blockwise", "checkpointing": False,
                 "markov_rank": 64, "confidence_weight": 1.0, "conv_kernel_size": 2, "conv_group_size": 16,
                 "selector_top_k": 16, "selector_rank": 64, "selector_weight": 1.0}


@pytest.mark.parametrize("method, block_size", [("eagle3", None), ("dflash", 6), ("dspark", 5), ("dflash2", 6)])
def test_a_run_config_of_an_earlier_version_reads_a_block_drafts_ttt_length_as_the_block_it_trained(
        tmp_path, method, block_size):
    """A block draft's k was draft.ttt_length: its config.yaml reads as the block that k gave the draft's spec (DFlash
    and DFlash 2: the next token and k mask slots; DSpark: k slots), so the spec, and the export, are the ones that
    run wrote; EAGLE3 keeps its unroll."""
    from omegaconf import OmegaConf

    from specforge_lite.compose import read_config_file

    saved = OmegaConf.to_container(OmegaConf.structured(load_config(["tracker=none", f"draft={method}",
                                                                     "eval.num_draft_tokens=5"])))
    saved["draft"] = {**EARLIER_DRAFT, **{k: v for k, v in saved["draft"].items() if k not in ("block_size",
                                                                                                  "ttt_length")}}
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    config = read_config_file(tmp_path / "config.yaml")
    assert type(config.draft) is METHODS[method].settings
    if block_size is None:
        assert config.draft.ttt_length == 5
        return
    assert config.draft.block_size == block_size and not hasattr(config.draft, "ttt_length")
    assert setting_problems(config) == []  # (served at the k it was trained for)
    spec = draft_spec(TARGET, dataclasses.replace(config.draft, mask_token_id=1), [2, 4, 5], "input", 256, 256, 64)
    assert spec.block_size == block_size


@pytest.mark.parametrize("method", ["dflash", "dspark", "dflash2"])
def test_a_block_draft_of_an_earlier_version_is_continued_with_its_block_size(method):
    """draft.init_from of a block draft whose spec an earlier version wrote (every method's fields): the settings
    that continue it name its block."""
    from specforge_lite.methods import shape_settings

    spec = read_spec({**FLAT_SPEC_OFF, **new_spec(method).to_dict(), "block_size": 6})
    settings = load_config(["tracker=none", f"draft={method}"]).draft
    assert shape_settings(settings, spec) == {"block_size": 6}
    assert shape_settings(dataclasses.replace(settings, block_size=6), spec) == {}


def test_each_methods_settings_hold_the_shared_ones_and_its_own_only():
    own = {name: {f.name for f in dataclasses.fields(m.settings)} for name, m in METHODS.items()}
    assert {"use_aux_norm", "parallel_drafting", "ttt_attention", "checkpointing"} <= own["eagle3"]
    for name in ("dflash", "dspark", "dflash2"):
        assert not own[name] & {"use_aux_norm", "norm_before_fc", "parallel_drafting", "checkpointing",
                                "init_layers_from_target", "ttt_attention"}, name
    assert "loss" not in own["dspark"] and "markov_rank" not in own["dflash2"] | own["eagle3"]


def test_the_shared_export_interface_asks_nothing_of_a_method_and_eagle3s_formats_refuse_what_is_eagle3s():
    """formats/ knows no method: a format written on ``ExportFormat`` alone refuses nothing of a block draft (whose
    settings and spec have no P-EAGLE option to read), and P-EAGLE's mask slots are refused by the EAGLE3 formats
    that cannot write them (SGLang's, speculators'), not by the interface."""
    from specforge_lite.export import export_format
    from specforge_lite.formats import ExportFormat

    bare = type("BareFormat", (ExportFormat,), {"name": "bare"})()
    for method in ("dflash", "dspark", "dflash2"):
        settings = load_config(["tracker=none", f"draft={method}", "draft.mask_token_id=1"]).draft
        spec = draft_spec(TARGET, settings, [2, 4, 5], "input", 256, 256, 64)
        assert bare.refusals(spec) == [] and bare.refusals(settings) == []
    peagle = load_config(["tracker=none", "draft.parallel_drafting=true", "draft.mask_token_id=1"]).draft
    assert export_format("vllm", "eagle3").refusals(peagle) == []
    for fmt in ("sglang", "speculators"):
        assert export_format(fmt, "eagle3").refusals(peagle)[0].startswith(
            f"draft.parallel_drafting=true: the {fmt} format has no mask slots")
