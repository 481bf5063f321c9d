"""Sequence packing (data.packing): packed rows give the same loss, metrics and gradients as the same
conversations unpacked, on both target backends and on a sliding-window family."""

from __future__ import annotations

import pytest
import torch

from specforge_lite.methods.eagle3.settings import Eagle3Settings
from specforge_lite.compose import load_config
from specforge_lite.data.loader import collate, collate_packed, pack
from specforge_lite.data.vocab import DraftVocab
from specforge_lite.methods.eagle3.objective import TTTObjective
from specforge_lite.methods import draft_spec
from specforge_lite.methods.eagle3.model import Eagle3Draft
from specforge_lite.targets import build_target
from specforge_lite.targets import Teacher

CFG = Eagle3Settings(ttt_length=4)


def conversations(vocab: int, lengths=(21, 9, 26, 14, 7, 18), seed: int = 0) -> list[dict]:
    """Rows with a prompt (no loss) then an answer (loss), longer than the tiny presets' 16-token windows."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        prompt = int(torch.randint(2, 6, (1,), generator=g))
        rows.append({"input_ids": torch.randint(0, vocab, (n,), generator=g).tolist(),
                     "loss_mask": [0] * prompt + [1] * (n - prompt)})
    return rows


def make_draft(target, seed: int = 0) -> Eagle3Draft:
    # the whole vocabulary: every target argmax is in it, so every answer token is scored
    vocab = DraftVocab(torch.arange(target.vocab_size), target.vocab_size, float("nan"))
    spec = draft_spec(target.config, CFG, target.aux_layer_ids, target.convention, target.vocab_size,
                      vocab.size, target.hidden_size)
    torch.manual_seed(seed)
    draft = Eagle3Draft(spec)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    draft.set_embedding(target.embedding_weight())
    with torch.no_grad():  # a head that reads its input sharply, so the loss depends on what is attended
        draft.lm_head.weight.copy_(target.full_head()[0].float() * 30)
    return draft


def test_pack_is_first_fit_in_order_and_keeps_every_token():
    rows = conversations(100)
    bins = pack(rows, 32)
    assert [[len(r["input_ids"]) for r in b] for b in bins] == [[21, 9], [26], [14, 7], [18]]
    batch = collate_packed(rows, 0, 32)
    assert batch.input_ids.shape == (4, 30)
    assert int(batch.attention_mask.sum()) == sum(len(r["input_ids"]) for r in rows)
    assert batch.position_ids[0, :30].tolist() == list(range(21)) + list(range(9))
    assert batch.loss_mask[0, 21:30].tolist() == rows[1]["loss_mask"]


@pytest.mark.parametrize("preset,backend", [("llama3_tiny", "hf"), ("llama3_tiny", "lean"), ("gemma3_tiny", "hf"),
                                            ("gemma3_tiny", "lean")])
def test_packed_and_unpacked_losses_are_equal(preset, backend):
    target = build_target(load_config([f"model={preset}", "tracker=none", f"target.backend={backend}"]))
    draft = make_draft(target)
    teacher, objective = Teacher(target, draft.draft_vocab_ids(), draft.t2d), TTTObjective.from_config(CFG)
    rows = conversations(target.vocab_size)
    unpacked = collate(rows, 0)
    packed = collate_packed(rows, 0, 32)
    assert packed.input_ids.shape[0] < unpacked.input_ids.shape[0]

    def run(batch):
        draft.zero_grad()
        out = objective(draft, teacher, batch)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}

    (ref, ref_grads), (got, got_grads) = run(unpacked), run(packed)
    assert int(ref.steps[-1].valid) > 40
    assert [int(s.valid) for s in got.steps] == [int(s.valid) for s in ref.steps]
    assert [int(s.correct) for s in got.steps] == [int(s.correct) for s in ref.steps]
    assert torch.allclose(got.loss, ref.loss, rtol=1e-5, atol=1e-6), (float(got.loss), float(ref.loss))
    for a, b in zip(got.steps, ref.steps):
        assert abs(float(a.loss) - float(b.loss)) <= 1e-5 * abs(float(b.loss)), (float(a.loss), float(b.loss))
    for name, g in ref_grads.items():
        assert torch.allclose(got_grads[name], g, rtol=1e-4, atol=1e-6), name

    # The same packed rows read as one sequence each (no position ids) give another loss: the equality
    # above holds because attention and TTT targets stop at conversation boundaries.
    packed.position_ids = None
    leaked = objective(draft, teacher, packed)
    assert max(abs(float(a.loss) - float(b.loss)) for a, b in zip(leaked.steps, ref.steps)) > 1e-3


def test_packing_is_refused_where_conversations_cannot_be_kept_apart():
    from specforge_lite.run import packing_length

    config = load_config(["model=qwen3_next_tiny", "tracker=none", "data.packing=true"])
    target = build_target(config)
    with pytest.raises(ValueError, match="data.packing=false"):
        packing_length(config, target)
    with pytest.raises(ValueError, match="packed rows"):
        target.capture(torch.tensor([[1, 2, 3, 4]]), None, position_ids=torch.tensor([[0, 1, 0, 1]]))
