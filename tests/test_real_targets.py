"""Real-model parity: SmolLM2-135M-Instruct (Llama layout) and Gemma-3-270M (scaled embedding, (1 + w)
norms, 5:1 sliding/full attention, tied 262k head), both fetched from the package registry. The lean
backend's captured states and teacher equal the HF backend's, and both equal HF's own full forward."""

from __future__ import annotations

import pytest
import torch

from specforge_lite.compose import load_config
from specforge_lite.data.vocab import DraftVocab
from specforge_lite.draft.objective import shift_left
from specforge_lite.targets import build_target
from specforge_lite.targets import HFTarget, Teacher

pytestmark = pytest.mark.slow


def _check(preset: str, seq: int):
    hf = build_target(load_config([f"model={preset}", "tracker=none"]))
    L = hf.num_layers
    lean = HFTarget(hf.model, hf.family, hf.aux_layer_ids, hf.location, backend="lean")
    assert lean.lean is not None
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf.vocab_size, (2, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[1, seq // 2 :] = 0
    real = mask.bool()
    needed = shift_left(mask, 1).bool() & real
    draft_ids = torch.linspace(0, hf.vocab_size - 1, 4096).long().unique()
    vocab = DraftVocab(draft_ids, hf.vocab_size, float("nan"))

    seen = {}
    handle = hf.family.final_norm(hf.model).register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    with torch.no_grad():
        out = hf.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    handle.remove()
    ref = [out.hidden_states[i] if i < L else seen["x"] for i in hf.aux_layer_ids] + [out.hidden_states[-1]]
    ref_teacher = out.logits[..., draft_ids]
    del out
    results = {}
    for name, target in (("hf", hf), ("lean", lean)):
        cap = target.capture(ids, mask)
        logits, in_vocab = Teacher(target, vocab.draft_to_target, vocab.t2d)(cap, needed)
        results[name] = cap.aux + [cap.final_hidden]
        for i, (mine, theirs) in enumerate(zip(results[name], ref)):
            scale = float(theirs[real].abs().max())
            assert float((mine[real] - theirs[real]).abs().max()) <= 2e-5 * scale, (name, i)
        assert torch.allclose(logits[needed], ref_teacher[needed], atol=2e-4, rtol=1e-4), name
    for a, b in zip(results["hf"], results["lean"]):
        assert float((a[real] - b[real]).abs().max()) <= 2e-5 * float(a[real].abs().max())
    return hf


def test_smollm2_lean_backend_parity():
    _check("smollm2_135m", 96)


def test_gemma3_270m_lean_backend_parity():
    """Sequence longer than nothing in particular: the 512-token window is exercised by sliding layers at 600."""
    target = _check("gemma3_270m", 600)
    assert target.vocab_size == 262144 and target.num_layers == 18


def test_gemma3_270m_has_a_usable_chat_template():
    """A base checkpoint ships no template; the family's Gemma turn format is used and masks only the answer."""
    from specforge_lite.data.chat import tokenize_conversation
    from specforge_lite.targets import load_tokenizer

    target = build_target(load_config(["model=gemma3_270m", "tracker=none"]))
    tok = load_tokenizer(target)
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}]
    ids, mask, _ = tokenize_conversation(tok, msgs, 64)
    text = tok.decode([t for t, m in zip(ids, mask) if m])
    assert text.strip() == "Hello! How can I help?<end_of_turn>"
    assert tok.decode(ids).startswith("<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n")
