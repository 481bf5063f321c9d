"""draft.init_layers_from_target: a draft that starts as the target's own layers after the top aux id,
checked against transformers' forward of the target (not against our code)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_llama, tiny_draft, tiny_target
from specforge_lite.methods.eagle3.ttt import TTTCache
from specforge_lite.targets.families import get_family


def test_warm_started_draft_computes_the_targets_next_layers_at_step_zero():
    """At step 0 a warm-started draft of two layers, fed the target's aux states, must give what the target
    itself holds two layers after the top aux id: transformers' hidden_states[top + 2] (the input of layer
    top + 2), whatever token the embedding half would have read. A draft built as usual does not."""
    target = tiny_target(aux_ids=[1, 3, 5])
    ids = torch.randint(0, target.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = target.model(ids, output_hidden_states=True).hidden_states  # [j]: the input of layer j
    captured = target.capture(ids)
    positions = torch.arange(ids.shape[1])[None].expand(2, -1)
    for layers in (1, 2):
        draft = tiny_draft(target, num_layers=layers)
        with torch.no_grad():
            cold = draft.step(ids, draft.project_aux(captured.aux), positions, TTTCache())
            draft.start_from_target([target.llama_layer(5 + i) for i in range(layers)], target.final_norm_weight())
            warm = draft.step(torch.zeros_like(ids), draft.project_aux(captured.aux), positions, TTTCache())
        torch.testing.assert_close(warm, reference[5 + layers], rtol=1e-4, atol=1e-4)
        assert (cold - reference[5 + layers]).abs().max() > 0.1
        torch.testing.assert_close(draft.norm.weight, target.model.model.norm.weight)


def test_layers_are_read_from_the_checkpoint_when_the_model_holds_none(tmp_path):
    """A store's target and a parts-only target keep their layers on the meta device: the layer comes from
    the checkpoint's safetensors, equal to the loaded model's."""
    model = make_tiny_llama()
    model.save_pretrained(tmp_path)
    with torch.device("meta"):
        meta = type(model)(model.config)
    family = get_family("llama")
    read = family.llama_layer(meta, str(tmp_path), 4)
    live = dict(model.model.layers[4].named_parameters())
    assert sorted(read) == sorted(live)
    for name, value in read.items():
        torch.testing.assert_close(value, live[name].detach())


def test_layers_that_are_not_llama_layers_and_missing_layers_are_refused(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from conftest import ROOT  # noqa: F401  (the project on the path)
    from specforge_lite.compose import load_config
    from specforge_lite.data.vocab import DraftVocab
    from specforge_lite.run import build_draft

    qwen3 = Qwen3ForCausalLM(Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256))
    with pytest.raises(ValueError, match=r"not a plain Llama layer \(extra \['self_attn.k_norm.weight'"):
        get_family("qwen3").llama_layer(qwen3, "", 2)
    target = tiny_target(aux_ids=[1, 3, 8])  # 8: the last layer's output, which no layer follows
    vocab = DraftVocab(torch.arange(128), target.vocab_size, 1.0)
    config = load_config(["model=llama3_tiny", "tracker=none", "draft.init_layers_from_target=true"])
    with pytest.raises(ValueError, match="start as target layers 8.. after the top aux id 8, and the target has 8"):
        build_draft(config, target, vocab)
