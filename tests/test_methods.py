"""The draft methods as folders (specforge_lite/methods/<name>/): a saved spec of any method, written before the
methods had specs of their own (one flat spec of every method's fields), reads as its method's spec."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import LlamaConfig

from specforge_lite.config import load_config
from specforge_lite.methods import METHODS, draft_spec, read_spec

# The fields of the one flat spec every draft recorded before each method had its own, at the values a draft of
# another method recorded for them (written out here, as those spec.json files hold them).
FLAT_SPEC_OFF = {"use_aux_norm": False, "num_layers": 1, "norm_before_residual": False, "norm_before_fc": False,
                 "norm_output": False, "parallel_drafting": False, "mask_token_id": None, "block_size": None,
                 "method": "eagle3", "markov_rank": 0, "conv_kernel_size": 0, "conv_group_size": 0,
                 "selector_rank": 0, "selector_top_k": 0, "attention_bias": False, "mlp_bias": False, "extra": {}}
TARGET = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256)


def new_spec(method: str):
    block = ["draft.ttt_length=3", "eval.num_draft_tokens=3"] if method != "eagle3" else []
    config = load_config(["tracker=none", f"draft.method={method}", "draft.mask_token_id=1", *block])
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
