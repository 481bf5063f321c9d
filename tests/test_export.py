"""Exports: every field the servers read, their id conventions, weight names, and a lossless round trip."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import EAGLE31, ROOT, file_size_limit, tiny_draft, tiny_target
from specforge_lite.methods.eagle3.ttt import TTTCache
from specforge_lite.export import export_draft, load_export
from specforge_lite.formats import ExportRefused
from specforge_lite.export.for_target import draft_from_weights

SERVER_NAMES = {"fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
                "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
                "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
                "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight"}


def edited_copy(export, tmp_path, edit_config=None, edit_weights=None):
    """A copy of an export folder (as b0, b1, ... in tmp_path) with its config and weights edited in place."""
    d = tmp_path / f"b{len(list(tmp_path.iterdir()))}"
    shutil.copytree(export, d)
    config = json.loads((d / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (d / "config.json").write_text(json.dumps(config))
    weights = load_file(str(d / "model.safetensors"))
    if edit_weights:
        edit_weights(weights)
    save_file(weights, str(d / "model.safetensors"))
    return d


def draft_logits(draft, target, ids, steps=3):
    aux = target.capture(ids).aux
    T = ids.shape[1]
    hidden, cache, out = draft.project_aux(aux), TTTCache(), []
    with torch.no_grad():
        for k in range(steps):
            hidden = draft.step(torch.roll(ids, -1 - k, 1), hidden, torch.arange(T)[None] + k, cache)
            out.append(draft.compute_logits(hidden))
    return torch.stack(out)


@pytest.mark.parametrize("use_aux_norm", [False, True])
def test_vllm_export_fields_names_and_round_trip(tmp_path, use_aux_norm):
    target = tiny_target(aux_ids=[1, 3, 6])
    draft = tiny_draft(target, draft_vocab_size=100, use_aux_norm=use_aux_norm)
    out = export_draft(draft.trainable_state_dict(), draft.spec, "vllm", tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["vocab_size"] == target.vocab_size and cfg["draft_vocab_size"] == 100
    assert cfg["target_hidden_size"] == target.hidden_size and cfg["tie_word_embeddings"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]  # vLLM: input of layer i, as trained
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 6], "use_aux_hidden_state": True}
    assert cfg["norm_before_residual"] is False and cfg["norm_output"] is False
    assert cfg.get("fc_norm", False) is use_aux_norm and cfg.get("use_aux_norm", False) is use_aux_norm
    w = load_file(str(out / "model.safetensors"))
    expected = SERVER_NAMES | {"d2t", "t2d"} | ({f"fc_norm.{i}.weight" for i in range(3)} if use_aux_norm else set())
    assert set(w) == expected
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    assert w["fc.weight"].shape == (target.hidden_size, 3 * target.hidden_size)
    assert w["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * target.hidden_size
    assert w["lm_head.weight"].shape == (100, target.hidden_size)

    spec, weights = load_export(out)
    back = draft_from_weights(spec, weights, target)
    ids = torch.randint(0, target.vocab_size, (2, 10))
    torch.testing.assert_close(draft_logits(back, target, ids), draft_logits(draft, target, ids), atol=0, rtol=0)


def test_vllm_full_vocab_leaves_out_maps_and_sglang_keeps_them(tmp_path):
    target = tiny_target()
    draft = tiny_draft(target, draft_vocab_size=target.vocab_size)
    export_draft(draft.trainable_state_dict(), draft.spec, "vllm", tmp_path / "v")
    export_draft(draft.trainable_state_dict(), draft.spec, "sglang", tmp_path / "s")
    assert "d2t" not in load_file(str(tmp_path / "v" / "model.safetensors"))
    assert "d2t" in load_file(str(tmp_path / "s" / "model.safetensors"))
    spec, weights = load_export(tmp_path / "v")  # identity maps restored on import
    assert int(weights["d2t"].abs().sum()) == 0 and bool(weights["t2d"].all())


def test_sglang_ids_are_shifted_to_its_output_convention(tmp_path):
    target = tiny_target(num_layers=12)  # default ids [2, 6, 9]
    draft = tiny_draft(target)
    out = export_draft(draft.trainable_state_dict(), draft.spec, "sglang", tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 5, 8]  # SGLang adds 1 back: inputs of 2, 6, 9
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 5, 8]
    warned = []
    odd = tiny_draft(tiny_target(aux_ids=[3, 6, 9], num_layers=12))
    export_draft(odd.trainable_state_dict(), odd.spec, "sglang", tmp_path / "odd", warn=warned.append)
    assert warned and "first id is 1" in warned[0]
    zero = tiny_draft(tiny_target(aux_ids=[0, 3, 6]))
    with pytest.raises(ExportRefused, match="aux id 0"):
        export_draft(zero.trainable_state_dict(), zero.spec, "sglang", tmp_path / "zero")


def test_bf16_export_and_hidden_size_mismatch(tmp_path):
    target = tiny_target()
    draft = tiny_draft(target)
    out = export_draft(draft.trainable_state_dict(), draft.spec, "vllm", tmp_path, dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_file(str(out / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    spec, weights = load_export(out)
    other = tiny_target(vocab=300)
    with pytest.raises(ValueError, match="trained for a target with hidden size"):
        draft_from_weights(spec, weights, other)


def test_cli_reexports_a_run(tmp_path):
    from test_training import run_training

    run_training(tmp_path / "run", max_steps=2)
    out = tmp_path / "sg"
    proc = subprocess.run([sys.executable, "-m", "specforge_lite.export", "--run-dir", str(tmp_path / "run"),
                           "--format", "sglang", "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["specforge_lite"]["format"] == "sglang"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in cfg["specforge_lite"]["aux_layer_ids"]]
    missing = subprocess.run([sys.executable, "-m", "specforge_lite.export", "--run-dir", str(tmp_path / "none"),
                              "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert missing.returncode != 0 and "no checkpoint" in missing.stderr


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
@pytest.mark.parametrize("variant", ["eagle3", "fc_norm", "eagle3.1", "peagle"])
def test_every_format_round_trips_to_identical_logits_and_passes_the_check(tmp_path, fmt, variant):
    from specforge_lite.export.check import check_export

    target = tiny_target(aux_ids=[2, 4, 6])
    options = {"eagle3": {}, "fc_norm": {"use_aux_norm": True}, "eagle3.1": EAGLE31,
               "peagle": {"parallel_drafting": True, "mask_token_id": 5, "norm_before_fc": True}}[variant]
    draft = tiny_draft(target, draft_vocab_size=100, **options)
    export = functools.partial(export_draft, draft.trainable_state_dict(), draft.spec, fmt, tmp_path,
                               verifier={"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]})
    if fmt == "sglang" and variant == "eagle3.1":  # two layers: SGLang's draft is one
        with pytest.raises(ExportRefused, match="one layer"):
            export()
        return
    if fmt != "vllm" and variant == "peagle":  # mask slots are written for vLLM only
        with pytest.raises(ExportRefused, match="export.format=vllm"):
            export()
        return
    out = export()
    report = check_export(out)
    assert report.ok, report.text()
    assert not [w for w in report.warnings if "norm_before_residual" in w]
    spec, weights = load_export(out)
    back = draft_from_weights(spec, weights, target)
    ids = torch.randint(0, target.vocab_size, (2, 10))
    torch.testing.assert_close(draft_logits(back, target, ids), draft_logits(draft, target, ids), atol=0, rtol=0)
    if variant == "peagle":  # the mask slots read back too: their token and fused state
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["parallel_drafting"] is True and cfg["mask_token_id"] == 5
        for d in (back, draft):
            d.slot = d.next_step_inputs(ids[:, :3], torch.zeros(2, 3, draft.spec.hidden_size))
        assert torch.equal(back.slot[0], draft.slot[0]) and torch.equal(back.slot[1], draft.slot[1])


def test_the_check_names_what_vllm_needs_for_parallel_drafting(tmp_path):
    """P-EAGLE folders: vLLM refuses parallel drafting without mask_hidden and cannot run the mask slots
    without their token id; a mask_hidden served without the flag would draft step by step."""
    from safetensors.torch import load_file, save_file

    from specforge_lite.export.check import check_export

    target = tiny_target(aux_ids=[2, 4, 6])
    draft = tiny_draft(target, draft_vocab_size=100, parallel_drafting=True, mask_token_id=5)
    out = export_draft(draft.trainable_state_dict(), draft.spec, "vllm", tmp_path / "ok")
    report = check_export(out)
    assert report.ok and "parallel_drafting=true" in report.servers["vLLM"], report.text()
    weights, cfg = load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())
    save_file({k: v for k, v in weights.items() if k != "mask_hidden"}, str(out / "model.safetensors"))
    assert any("no mask_hidden" in e for e in check_export(out).errors)
    save_file(weights, str(out / "model.safetensors"))
    for key in ("parallel_drafting", "mask_token_id"):
        del cfg[key]
    (out / "config.json").write_text(json.dumps(cfg))
    report = check_export(out)
    assert any("no mask_token_id" in e for e in report.errors)
    assert any("parallel_drafting is not written" in w for w in report.warnings)


def test_speculators_export_follows_its_config_and_names(tmp_path):
    target = tiny_target(aux_ids=[2, 4, 6])
    draft = tiny_draft(target, draft_vocab_size=100, use_aux_norm=True)
    out = export_draft(draft.trainable_state_dict(), draft.spec, "speculators", tmp_path,
                       verifier={"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]},
                       num_speculative_tokens=5)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["speculators_model_type"] == "eagle3"
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["vocab_size"] == target.vocab_size  # the TARGET vocabulary
    assert layer["hidden_size"] == target.hidden_size and layer["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 100 and cfg["target_hidden_size"] == target.hidden_size
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]  # input of layer i, as trained
    assert cfg["norm_before_residual"] is False  # written: the adapter would take true when absent
    assert cfg["fc_norm"] is True and cfg["norm_before_fc"] is False and cfg["norm_output"] is False
    assert cfg["speculators_config"] == {
        "algorithm": "eagle3", "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]}}
    w = load_file(str(out / "model.safetensors"))
    assert {n.replace("midlayer.", "layers.0.") for n in SERVER_NAMES} | {"d2t", "t2d"} | {
        f"fc_norm.{i}.weight" for i in range(3)} == set(w)


def test_eagle31_exports_carry_the_flags_and_layers_each_server_reads(tmp_path):
    """EAGLE 3.1 with two layers, as vLLM's llama_eagle3 and speculators' Eagle3 read it: the flags at the top
    level, input_norm over the concatenated aux states, layer 1 as layers.1.* (H wide, no hidden_norm);
    --check names the ways a server would run it otherwise."""
    from specforge_lite.export.check import check_export

    target = tiny_target(aux_ids=[2, 4, 6])
    draft = tiny_draft(target, draft_vocab_size=100, **EAGLE31)
    H = target.hidden_size
    verifier = {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]}
    vl = export_draft(draft.trainable_state_dict(), draft.spec, "vllm", tmp_path / "vl")
    sp = export_draft(draft.trainable_state_dict(), draft.spec, "speculators", tmp_path / "sp", verifier=verifier)
    cfg, scfg = json.loads((vl / "config.json").read_text()), json.loads((sp / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and scfg["transformer_layer_config"]["num_hidden_layers"] == 2
    for c in (cfg, scfg):
        assert c["norm_before_fc"] is True and c["norm_output"] is True and c.get("fc_norm", False) is False
    later = {n.replace("midlayer.", "layers.1.") for n in SERVER_NAMES if n.startswith("midlayer.")} - {
        "layers.1.hidden_norm.weight"}
    w, sw = load_file(str(vl / "model.safetensors")), load_file(str(sp / "model.safetensors"))
    assert set(w) == SERVER_NAMES | later | {"input_norm.weight", "d2t", "t2d"}
    assert set(sw) == {n.replace("midlayer.", "layers.0.") for n in set(w)}
    assert w["input_norm.weight"].shape == (3 * H,) and w["layers.1.self_attn.q_proj.weight"].shape[1] == H
    report = check_export(vl)
    assert report.ok and "norm_before_fc=True, norm_output=True, layers=2" in report.servers["vLLM"], report.text()
    assert "cannot serve" in report.servers["SGLang"] and any("SGLang cannot serve" in x for x in report.warnings)

    def broken(edit_config=None, edit_weights=None):
        return check_export(edited_copy(vl, tmp_path, edit_config, edit_weights)).errors

    assert any("vLLM drops it in silence" in e for e in broken(lambda c: c.update(norm_before_fc=False)))
    assert any("weight input_norm.weight is missing" in e
               for e in broken(edit_weights=lambda w: w.pop("input_norm.weight")))
    assert any("layers.1.self_attn.q_proj.weight is missing" in e
               for e in broken(edit_weights=lambda w: w.pop("layers.1.self_attn.q_proj.weight")))
    assert any("servers would never run that layer" in e for e in broken(lambda c: c.update(num_hidden_layers=1)))
    assert any("both set" in e for e in broken(lambda c: c.update(fc_norm=True)))


def test_a_residual_normed_draft_is_written_for_vllm_and_refused_for_sglang(tmp_path):
    """draft.norm_before_residual: vLLM and speculators read the flag (written true, read back to the same
    logits); no SGLang build does, so the sglang export refuses the draft and --check says SGLang cannot
    serve the vLLM folder."""
    from specforge_lite.export.check import check_export

    target = tiny_target(aux_ids=[2, 4, 6])
    draft = tiny_draft(target, draft_vocab_size=100, norm_before_residual=True)
    with torch.no_grad():
        draft.midlayer.hidden_norm.weight.uniform_(0.5, 1.5)
    vl = export_draft(draft.trainable_state_dict(), draft.spec, "vllm", tmp_path / "vl")
    assert json.loads((vl / "config.json").read_text())["norm_before_residual"] is True
    back = draft_from_weights(*load_export(vl), target)
    assert back.spec.norm_before_residual is True
    ids = torch.randint(0, target.vocab_size, (1, 10))
    aux = target.capture(ids).aux
    with torch.no_grad():
        ours, theirs = (d.compute_logits(d.step(ids, d.project_aux(aux), torch.arange(10)[None], TTTCache()))
                        for d in (draft, back))
    torch.testing.assert_close(theirs, ours)
    report = check_export(vl)
    assert report.ok and "norm_before_residual" in report.servers["SGLang"], report.text()
    with pytest.raises(ExportRefused, match="draft.norm_before_residual=false to serve on SGLang"):
        export_draft(draft.trainable_state_dict(), draft.spec, "sglang", tmp_path / "sg")


def test_sglang_contract_fields_names_shapes_and_dtypes(tmp_path):
    """What SGLang's llama_eagle3.py reads (eagle3-contracts.md section 2), checked field by field; the
    same weights are what the vLLM path serves (the vLLM export differs only in ids and d2t rules)."""
    target = tiny_target(aux_ids=[2, 4, 6])
    draft = tiny_draft(target, draft_vocab_size=target.vocab_size, use_aux_norm=True)
    sg = export_draft(draft.trainable_state_dict(), draft.spec, "sglang", tmp_path / "sg", dtype="bfloat16")
    vl = export_draft(draft.trainable_state_dict(), draft.spec, "vllm", tmp_path / "vl", dtype="bfloat16")
    cfg = json.loads((sg / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "rope_theta", "max_position_embeddings", "hidden_act", "num_hidden_layers"):
        assert key in cfg, key
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["vocab_size"] == target.vocab_size and cfg["draft_vocab_size"] == target.vocab_size
    assert cfg["tie_word_embeddings"] is False and cfg["target_hidden_size"] == target.hidden_size
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": True}
    assert cfg["fc_norm"] is True and cfg["use_aux_norm"] is True  # and the legacy alias
    H = target.hidden_size
    sw, vw = load_file(str(sg / "model.safetensors")), load_file(str(vl / "model.safetensors"))
    assert sw["fc.weight"].shape == (H, 3 * H) and sw["lm_head.weight"].shape == (target.vocab_size, H)
    assert sw["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H  # cat(embedding, hidden), embedding first
    assert sw["d2t"].dtype == torch.int64 and sw["d2t"].shape == (target.vocab_size,)  # kept for a full vocab
    assert all(v.dtype == torch.bfloat16 for k, v in sw.items() if k not in ("d2t", "t2d"))
    assert "embed_tokens.weight" not in sw  # SGLang substitutes the target's embedding
    for name, tensor in vw.items():  # the same weights go to vLLM
        assert torch.equal(tensor, sw[name]), name


def test_check_names_what_a_server_would_misread(tmp_path):
    from specforge_lite.export.check import check_export

    target = tiny_target(aux_ids=[2, 4, 6])
    draft = tiny_draft(target, draft_vocab_size=100, use_aux_norm=True)
    out = export_draft(draft.trainable_state_dict(), draft.spec, "vllm", tmp_path / "ok")
    good = check_export(out)
    assert good.ok and "input of layers [2, 4, 6]" in good.servers["vLLM"] and "[1, 2, 3]" not in good.text()

    def broken(edit_config=None, edit_weights=None):
        return check_export(edited_copy(out, tmp_path, edit_config, edit_weights))

    def no_ids(c):
        del c["eagle_aux_hidden_state_layer_ids"], c["eagle_config"]

    assert any("fall back to their default ids" in e for e in broken(no_ids).errors)
    assert any("fc_norm is not set" in e for e in broken(lambda c: (c.pop("fc_norm"), c.pop("use_aux_norm"))).errors)
    assert any("unknown weight names ['model.fc.weight']" in e
               for e in broken(edit_weights=lambda w: w.__setitem__("model.fc.weight", w.pop("fc.weight"))).errors)
    nested = broken(lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2, 3]))
    assert any("differ" in e for e in nested.errors)
    assert any("norm_before_residual" in w for w in broken(lambda c: c.pop("norm_before_residual")).warnings)
    assert any("no d2t" in e for e in broken(edit_weights=lambda w: w.pop("d2t")).errors)
    unsorted = broken(lambda c: (c.update(eagle_aux_hidden_state_layer_ids=[6, 2, 4]),
                                 c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[6, 2, 4])))
    assert any("not ascending" in e for e in unsorted.errors)
    assert any("runs silu only" in e for e in broken(lambda c: c.update(hidden_act="gelu_pytorch_tanh")).errors)
    cli = subprocess.run([sys.executable, "-m", "specforge_lite.export", "--check", str(tmp_path / "b1")], cwd=ROOT,
                         capture_output=True, text=True)
    assert cli.returncode == 1 and "NOT SERVABLE" in cli.stdout


def test_every_familys_draft_is_a_silu_llama_layer_and_other_activations_are_refused(tmp_path):
    """A Gemma target (gelu_pytorch_tanh) still gets a silu draft: the servers' Llama draft runs nothing else.
    A checkpoint trained with another activation is refused at export, never relabelled."""
    from dataclasses import replace

    from specforge_lite.compose import load_config
    from specforge_lite.methods import draft_spec
    from specforge_lite.methods.eagle3.settings import Eagle3Settings
    from specforge_lite.targets import build_target

    gemma = build_target(load_config(["model=gemma3_tiny", "tracker=none"]))
    assert gemma.config.get_text_config().hidden_activation == "gelu_pytorch_tanh"
    spec = draft_spec(gemma.config, Eagle3Settings(), gemma.aux_layer_ids, gemma.convention,
                      gemma.vocab_size, 64, gemma.hidden_size)
    assert spec.hidden_act == "silu"
    target = tiny_target(aux_ids=[2, 4, 6])
    draft = tiny_draft(target, draft_vocab_size=100)
    out = export_draft(draft.trainable_state_dict(), draft.spec, "vllm", tmp_path / "silu")
    assert json.loads((out / "config.json").read_text())["hidden_act"] == "silu"
    old = replace(draft.spec, hidden_act="gelu_pytorch_tanh")
    with pytest.raises(ValueError, match="trained with hidden_act='gelu_pytorch_tanh'.*silu only.*Retrain"):
        export_draft(draft.trainable_state_dict(), old, "vllm", tmp_path / "gelu")
    assert not (tmp_path / "gelu").exists()


def test_check_compares_the_ids_each_server_reads_with_the_trained_ones(tmp_path):
    """An SGLang folder (ids written as layer outputs) checked for vLLM, or a vLLM folder checked for SGLang,
    fails naming the one-layer shift; each folder checked for its own server passes; a folder whose ids were
    edited away from the trained ones (provenance) fails for its own server. Fails when the check reads
    only the config's ids (every folder below has well-formed ones)."""
    from specforge_lite.export.check import check_export

    target = tiny_target(aux_ids=[2, 4, 6])
    draft = tiny_draft(target, draft_vocab_size=100)
    sglang = export_draft(draft.trainable_state_dict(), draft.spec, "sglang", tmp_path / "sglang")
    vllm = export_draft(draft.trainable_state_dict(), draft.spec, "vllm", tmp_path / "vllm")
    assert check_export(sglang).ok and check_export(vllm).ok
    assert check_export(sglang, "sglang").ok and check_export(vllm, "vllm").ok
    as_vllm = check_export(sglang, "vllm")
    assert not as_vllm.ok and any("vLLM would capture aux ids [1, 3, 5]" in e and "shifted by -1 layer" in e
                                  and "trained on [2, 4, 6]" in e for e in as_vllm.errors), as_vllm.text()
    as_sglang = check_export(vllm, "sglang")
    assert not as_sglang.ok and any("SGLang would capture aux ids [3, 5, 7]" in e and "shifted by +1 layer" in e
                                    for e in as_sglang.errors), as_sglang.text()
    assert any("SGLang would capture" in w for w in check_export(vllm).warnings)  # another server: a warning
    def shift_ids(c):
        c["eagle_aux_hidden_state_layer_ids"] = c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 5]

    edited = edited_copy(vllm, tmp_path, shift_ids)
    assert any("shifted by -1" in e for e in check_export(edited).errors)
    cli = subprocess.run([sys.executable, "-m", "specforge_lite.export", "--check", str(sglang), "--server", "vllm"],
                         cwd=ROOT, capture_output=True, text=True)
    assert cli.returncode == 1 and "shifted by -1" in cli.stdout, cli.stdout + cli.stderr


def test_mask_slots_embed_a_token_no_conversation_uses(smollm2, tmp_path):
    """P-EAGLE and DFlash drafts built by the trainer for the real SmolLM2 (whose id 0 is its end-of-text token,
    in every training row) embed an unused special token in their mask slots, and the export records it; a
    tokenizer's own mask token wins; an explicit draft.mask_token_id is kept. Fails when the mask token
    defaults to id 0."""
    from specforge_lite.compose import load_config
    from specforge_lite.data.vocab import DraftVocab, choose_mask_token
    from specforge_lite.run import build_draft

    _, target, tokenizer = smollm2
    vocab = DraftVocab(torch.arange(0, target.vocab_size, 64), target.vocab_size, float("nan"))
    used = set(tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant",
                                                                                 "content": "hello"}], tokenize=True))
    for method in (["draft.parallel_drafting=true"], ["draft=dflash", "eval.num_draft_tokens=3"]):
        config = load_config(["tracker=none", *method])
        logged = []
        draft = build_draft(config, target, vocab, tokenizer, log=logged.append)
        token = draft.spec.mask_token_id
        assert token not in used and token not in (tokenizer.eos_token_id, tokenizer.bos_token_id), (method, token)
        assert token not in tokenizer("Hello! How are you? 12 + 7 = 19.")["input_ids"]
        assert any(f"token {token}" in m for m in logged), logged
        out = export_draft(draft.trainable_state_dict(), draft.spec, "vllm", tmp_path / method[0].split("=")[0])
        cfg = json.loads((out / "config.json").read_text())
        assert (cfg.get("mask_token_id") or cfg["dflash_config"]["mask_token_id"]) == token
    explicit = build_draft(load_config(["tracker=none", "draft.parallel_drafting=true", "draft.mask_token_id=9"]),
                           target, vocab, tokenizer, log=lambda m: None)
    assert explicit.spec.mask_token_id == 9
    tokenizer_with_mask = type("T", (), {"mask_token_id": 42, "mask_token": "<mask>"})()
    assert choose_mask_token(tokenizer_with_mask, target.vocab_size)[0] == 42


def test_an_export_cut_short_leaves_no_config_and_says_why(tmp_path):
    """A write that fails while the weights are written (a file-size limit, failing like a full disk, inside
    safetensors' own writer): the folder is left without config.json (what every tool and server reads first),
    so a half-written export is never taken for a whole one; the error says where and why. Written again with
    room, it is whole."""
    from specforge_lite.formats import layout

    draft = tiny_draft(tiny_target())
    out = export_draft(draft.trainable_state_dict(), draft.spec, "vllm", tmp_path / "final")
    assert (out / "config.json").is_file()
    with file_size_limit(4096), pytest.raises(layout.ExportWriteError, match=f"{out} could not be written .*File "
                                                                                "too large"):
        export_draft(draft.trainable_state_dict(), draft.spec, "vllm", out)
    assert not (out / "config.json").exists() and [p.name for p in out.iterdir()] == ["model.safetensors"]
    export_draft(draft.trainable_state_dict(), draft.spec, "vllm", out)
    assert load_export(out)[0] == draft.spec


def test_the_fitted_calibration_is_recorded_in_the_export_and_nothing_else_changes(tmp_path):
    """The evaluation's Platt fit goes into the export's provenance block (servers ignore it); the weights,
    every field a server reads and the check's verdict stay as they were."""
    import json

    from specforge_lite.export import export_draft, load_export, record_confidence_calibration
    from specforge_lite.export.check import check_export

    draft = tiny_draft(tiny_target(aux_ids=[0, 3, 6]))
    out = export_draft(draft.trainable_state_dict(), draft.spec, "vllm", tmp_path / "v")
    before = json.loads((out / "config.json").read_text())
    weights = (out / "model.safetensors").read_bytes()
    fit = {"kind": "platt", "a": 0.61, "b": -0.2, "fit_positions": 50, "judged_positions": 48,
           "ece_before": 0.2, "ece_after": 0.05}
    record_confidence_calibration(out, fit)
    after = json.loads((out / "config.json").read_text())
    assert after["specforge_lite"].pop("confidence_calibration") == {k: fit[k] for k in ("kind", "a", "b",
                                                                                         "ece_before", "ece_after")}
    assert after == before and (out / "model.safetensors").read_bytes() == weights
    assert check_export(out).ok and load_export(out)[0] == draft.spec
