"""Answer engines for regeneration: the lean continuous-batching decoder against HF's own generate, and
its sampling against naive references."""

from __future__ import annotations

import pytest
import torch

from specforge_lite.compose import load_config
from specforge_lite.data.regenerate import PromptQueue
from specforge_lite.targets import build_target
from specforge_lite.targets.lean import build_lean_forward
from specforge_lite.targets.lean.decode import LeanDecoder

NEW = 14


def sharpened_target(preset: str):
    """A tiny preset whose head is scaled up, so greedy choices are never near-ties that summation order
    could flip (a real target's are peaked too)."""
    target = build_target(load_config([f"model={preset}", "tracker=none"]))
    with torch.no_grad():
        target.family.lm_head_weight(target.model).mul_(8.0)
    target.model.config.use_cache = True
    return target


def hf_alone(target, prompt: list[int], stops: list[int]) -> list[int]:
    """transformers' generate on this prompt alone (no padding), cut before the stop token."""
    out = target.model.generate(input_ids=torch.tensor([prompt]),
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=NEW, do_sample=False, eos_token_id=stops or None, pad_token_id=0)
    row = out[0, len(prompt):].tolist()
    cut = next((j for j, t in enumerate(row) if t in stops), len(row))
    return row[:cut]


def lean_decoder(target, slots: int, stops: set[int], temperature: float = 0.0) -> LeanDecoder:
    family, model = target.family, target.model
    weight = family.lm_head_weight(model)
    head = lambda h: family.postprocess_logits(h @ weight.T, model.config)  # noqa: E731
    return LeanDecoder(build_lean_forward(family, model), head, slots, NEW, stops, temperature)


def run(decoder: LeanDecoder, prompts: list[list[int]], seeds=None) -> dict:
    queue = PromptQueue()
    for i, p in enumerate(prompts):
        queue.push(i, p, (seeds or [0] * len(prompts))[i])
    return dict(decoder.stream(queue))


@pytest.mark.parametrize("preset", ["llama3_tiny", "qwen3_tiny", "phi3_tiny", "mistral_tiny", "gemma3_tiny"])
def test_continuous_batching_equals_hf_generate_one_prompt_at_a_time(preset):
    """Twelve prompts through nine slots: rows stop at different steps and free slots are refilled
    mid-run; most prompts share a prefix (computed once, then copied into the slots of later prompts),
    two do not; the two long ones take the decoder's long-row attention path. Gemma 3's 16-token
    sliding window is shorter than most sequences."""
    target = sharpened_target(preset)
    g = torch.Generator().manual_seed(1)
    shared = [5001, 5002, 5003, 5004, 5005, 5006]
    sizes = (3, 40, 9, 27, 4, 33, 6, 2, 11, 8, 5, 7)
    prompts = [(shared if j not in (2, 9) else []) + torch.randint(5, 40000, (n,), generator=g).tolist()
               for j, n in enumerate(sizes)]
    free = [hf_alone(target, p, []) for p in prompts]
    # stop tokens that end some answers early, at different steps: where an answer last turns to a new token
    turns = [max((t for t in range(1, len(a)) if a[t] not in a[:t]), default=0) for a in free]
    stops = sorted({free[j][turns[j]] for j in (1, 3, 5, 7, 8) if turns[j]})
    expected = [hf_alone(target, p, stops) for p in prompts]
    assert len({len(e) for e in expected}) >= 3  # the rows really finish at different times
    decoder = lean_decoder(target, slots=9, stops=set(stops))
    got = run(decoder, prompts)
    assert [got[i] for i in range(len(prompts))] == expected
    assert decoder._prefix == shared  # ...and the later prompts' slots started from the copied prefix
    # nothing computed for rows that had stopped: one row-step per answer token
    assert decoder.decode_rows == decoder.tokens_generated


def test_follow_up_prompts_pushed_while_streaming_are_answered():
    """A prompt pushed onto the queue after the stream started (a conversation's next turn) is taken."""
    target = sharpened_target("llama3_tiny")
    decoder = lean_decoder(target, slots=2, stops=set())
    queue = PromptQueue()
    queue.push("a", [11, 12, 13], 0)
    answers = {}
    for key, tokens in decoder.stream(queue):
        answers[key] = tokens
        if key == "a":
            queue.push("b", [11, 12, 13, *tokens, 14], 0, first=True)
    assert set(answers) == {"a", "b"}
    assert answers["b"] == hf_alone(target, [11, 12, 13, *answers["a"], 14], [])


def test_sampled_answers_follow_their_seed_not_their_batch():
    target = sharpened_target("llama3_tiny")
    with torch.no_grad():
        target.family.lm_head_weight(target.model).div_(8.0)  # a flat distribution: samples vary
    prompts = [[20, 21, 22], [30, 31], [40, 41, 42, 43]]
    together = run(lean_decoder(target, 3, set(), temperature=1.0), prompts, seeds=[7, 8, 9])
    alone = run(lean_decoder(target, 1, set(), temperature=1.0), prompts[1:2], seeds=[8])
    other_seed = run(lean_decoder(target, 1, set(), temperature=1.0), prompts[1:2], seeds=[99])
    assert together[1] == alone[0]
    assert other_seed[0] != alone[0]


def test_top_p_keeps_the_smallest_likeliest_set_like_a_full_sort():
    from specforge_lite.targets.lean.decode import top_p_filter

    g = torch.Generator().manual_seed(0)
    peaked = torch.softmax(torch.randn(3, 5000, generator=g) * 6, -1)  # top-p inside the first 64 tokens
    flat = torch.softmax(torch.randn(2, 5000, generator=g) * 0.3, -1)  # top-p needs thousands: the sort path
    probs = torch.cat([peaked, flat])

    def naive(p, top_p):
        out = torch.zeros_like(p)
        for r in range(p.shape[0]):
            mass = 0.0
            for j in p[r].argsort(descending=True).tolist():
                if mass > top_p:
                    break
                out[r, j] = p[r, j]
                mass += float(p[r, j])
        return out

    for top_p in (0.5, 0.95):
        assert torch.allclose(top_p_filter(probs, top_p, first=64), naive(probs, top_p), atol=1e-7)


def test_sampled_tokens_follow_the_distribution():
    from test_spec_decode import chi_square_p_value

    from specforge_lite.targets.lean.decode import sample_rows

    probs = torch.tensor([0.5, 0.0, 0.2, 0.15, 0.1, 0.05])
    draws = sample_rows(probs.repeat(4000, 1) * 3.0,  # unnormalised on purpose
                        [torch.Generator().manual_seed(i) for i in range(4000)])
    counts = torch.bincount(draws, minlength=6).float()
    assert counts[1] == 0  # a token without mass is never drawn
    assert chi_square_p_value(counts[probs > 0], probs[probs > 0]) > 1e-3
