"""The capture convention against HF's own output_hidden_states, computed independently."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_target, tiny_vocab
from specforge_lite.targets import Teacher
from specforge_lite.targets.capture import resolve_aux_layer_ids


def reference_states(model, input_ids):
    """HF output_hidden_states plus the last layer's pre-norm output from a hook written here."""
    pre_norm = {}
    handle = model.model.layers[-1].register_forward_hook(
        lambda m, a, out: pre_norm.setdefault("h", out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        out = model(input_ids=input_ids, output_hidden_states=True)
    handle.remove()
    return out, pre_norm["h"]


def check_convention(target, input_ids, atol):
    L = target.num_layers
    ref, pre_norm = reference_states(target.model, input_ids)
    got = target.capture(input_ids)
    for aux_id, state in zip(target.aux_layer_ids, got.aux):
        expected = pre_norm if aux_id == L else ref.hidden_states[aux_id]
        torch.testing.assert_close(state, expected, atol=atol, rtol=0)
    # HF's last entry is after the final norm (what the lm_head reads), not the id-L aux state.
    torch.testing.assert_close(got.final_hidden, ref.hidden_states[L], atol=atol, rtol=0)
    return ref


def test_every_id_matches_hf_hidden_states_on_tiny_llama():
    L = 6
    target = tiny_target(aux_ids=list(range(L + 1)), num_layers=L)
    ids = torch.randint(0, target.vocab_size, (2, 17))
    ref = check_convention(target, ids, atol=1e-6)
    assert not torch.allclose(ref.hidden_states[L], target.capture(ids).aux[-1])  # pre- and post-norm differ


def test_capture_never_asks_for_all_hidden_states():
    target = tiny_target()
    decoder = target.model.model
    seen = {}
    original = decoder.forward
    decoder.forward = lambda *a, **kw: (seen.update(kw), original(*a, **kw))[1]
    target.capture(torch.randint(0, target.vocab_size, (1, 9)))
    assert not seen.get("output_hidden_states")
    assert seen.get("use_cache") is False


def test_teacher_is_the_targets_logits_on_the_draft_vocab():
    target = tiny_target()
    vocab = tiny_vocab(target, 100)
    teacher = Teacher(target, vocab.draft_to_target, vocab.t2d)
    ids = torch.randint(0, target.vocab_size, (2, 11))
    with torch.no_grad():
        full = target.model(input_ids=ids).logits
    got = target.capture(ids)
    logits, in_vocab = teacher(got)
    torch.testing.assert_close(logits, full[..., vocab.draft_to_target], atol=1e-5, rtol=0)
    assert torch.equal(in_vocab, vocab.t2d[full.argmax(-1)])
    needed = torch.zeros_like(in_vocab)
    needed[:, 3] = True
    _, partial = teacher(got, needed)
    assert torch.equal(partial, in_vocab & needed)


def test_default_ids_and_bad_ids():
    assert resolve_aux_layer_ids(None, 30) == [2, 15, 27]
    with pytest.raises(ValueError, match="out of range.*Valid ids are 0..30"):
        resolve_aux_layer_ids([2, 15, 31], 30)
    with pytest.raises(ValueError, match="repeats"):
        resolve_aux_layer_ids([2, 2, 5], 30)
    # servers concatenate the aux states in layer order: any other order would permute fc's columns
    with pytest.raises(ValueError, match=r"not in ascending order.*layer order.*draft.aux_layer_ids=\[2, 15, 27\]"):
        resolve_aux_layer_ids([27, 2, 15], 30)


def test_real_smollm2_capture_matches_hf(smollm2):
    from specforge_lite.targets import HFTarget

    config, target, tokenizer = smollm2
    assert target.aux_layer_ids == [2, 15, 27]
    ids = tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    every = HFTarget(target.model, target.family, [0, 2, 15, 27, 30])  # extra hooks on the same weights
    try:
        check_convention(every, ids, atol=1e-4)
        check_convention(target, ids, atol=1e-4)
    finally:
        every.close()
