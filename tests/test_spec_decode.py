"""Speculative decoding reproduces the target's greedy output token for token."""

from __future__ import annotations

import pytest
import torch

from conftest import EAGLE31, tiny_draft, tiny_target
from specforge_lite.evaluate import confidence, spec_decode
from specforge_lite.methods.eagle3 import drafting
from specforge_lite.methods.eagle3.drafting import DraftContext, draft_chain
from specforge_lite.evaluate.spec_decode import (acceptance_by_context_length, acceptance_summary, greedy_generate,
                                                 speculative_generate)


def hf_greedy(target, prompt, max_new_tokens, eos=None):
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    do_sample=False, eos_token_id=eos, pad_token_id=0, use_cache=True)
    return out[0, len(prompt):].tolist()


def test_greedy_helper_matches_hf_generate():
    target = tiny_target()
    prompt = torch.randint(0, target.vocab_size, (9,)).tolist()
    assert greedy_generate(target, prompt, 20, stop_ids=set()) == hf_greedy(target, prompt, 20)


def greedy_case(new_tokens: int = 40):
    """A tiny target, a draft for it, a random prompt and the target's greedy continuation of it."""
    target = tiny_target()
    draft = tiny_draft(target)
    prompt = torch.randint(0, target.vocab_size, (7,)).tolist()
    return target, draft, prompt, hf_greedy(target, prompt, new_tokens)


def test_speculative_equals_greedy_with_a_trained_like_oracle(monkeypatch):
    """A draft that is right at some positions and wrong at others exercises every acceptance count
    and the KV-cache rollback; the output must still be the target's greedy continuation."""
    target, draft, prompt, truth = greedy_case()
    full = prompt + truth
    calls = {"n": 0}

    def oracle(draft_, aux_ctx, context, next_token, k):
        start = len(context) + 1  # proposals continue after next_token
        good = full[start : start + k] + [0] * k
        wrong_at = calls["n"] % (k + 1)  # 0..k correct tokens before the first wrong one
        calls["n"] += 1
        return [t if i < wrong_at else (t + 1) % target.vocab_size for i, t in enumerate(good[:k])]

    monkeypatch.setattr(drafting, "draft_chain", oracle)
    gen = speculative_generate(target, draft, prompt, 40, k=3, stop_ids=set())
    assert gen.tokens == truth
    assert set(gen.accepted) == {0, 1, 2, 3}


def test_speculative_equals_greedy_with_the_real_draft_and_stop_token():
    target = tiny_target()
    draft = tiny_draft(target)
    for seed in range(3):
        torch.manual_seed(seed)
        prompt = torch.randint(0, target.vocab_size, (11,)).tolist()
        truth = hf_greedy(target, prompt, 30)
        stop = {truth[12]}
        expect = truth[: truth.index(truth[12]) + 1]
        assert speculative_generate(target, draft, prompt, 30, k=4, stop_ids=stop).tokens == expect
        assert speculative_generate(target, draft, prompt, 30, k=2, stop_ids=set()).tokens == truth


def test_acceptance_summary():
    s = acceptance_summary([0, 3, 1, 2], k=3)
    assert s["mean_acceptance_length"] == 1 + 6 / 4
    assert s["per_position_acceptance"] == [0.75, 0.5, 0.25]
    assert s["per_position_conditional_acceptance"][1] == 0.5 / 0.75


def uncached_chain(draft, aux, context, next_token, k):
    """The draft's first step over the whole context every round, then k - 1 chain steps at the last row
    (what evaluation did before it kept a draft KV cache): the last row's state and the proposals."""
    from specforge_lite.methods.eagle3.ttt import TTTCache

    n, cache = len(context), TTTCache()
    h = draft.step(torch.tensor([context[1:] + [next_token]]), draft.project_aux(aux), torch.arange(n)[None],
                   cache)[:, -1:]
    first, proposals = h, []
    for j in range(k):
        proposals.append(int(draft.draft_to_target(draft.compute_logits(h)[0, -1].argmax())))
        h = draft.step(torch.tensor([[proposals[-1]]]), h, torch.tensor([[n + j]]), cache, q_offset=n - 1)
    return first, proposals


@torch.no_grad()
def test_draft_kv_cache_equals_recomputing_the_context_every_round():
    """Rounds that keep the draft's context keys (DraftContext) and run only the newly committed rows give
    the same last-row state (1e-5) and the same proposals as re-running the draft over the whole context,
    for rounds committing 1 to k + 1 rows; the tree drafter too; and for an EAGLE 3.1 draft of two layers
    (each layer keeps its own context keys)."""
    target = tiny_target()
    for draft in (tiny_draft(target, seed=3), tiny_draft(target, seed=3, **EAGLE31)):
        _kept_keys_equal_recomputing(target, draft)


def _kept_keys_equal_recomputing(target, draft):
    import pytest

    from specforge_lite.methods.eagle3.drafting import draft_tree

    ids = torch.randint(0, target.vocab_size, (1, 40))
    aux = target.capture(ids).aux
    chain, tree, n = DraftContext(draft), DraftContext(draft), 6
    for commit in [1, 4, 2, 3, 1, 4, 4, 2, 1, 3]:
        context, nxt = ids[0, :n].tolist(), int(ids[0, n])
        new_rows = [a[:, chain.rows:n] for a in aux]
        want_h, want = uncached_chain(draft, [a[:, :n] for a in aux], context, nxt, 3)
        _, got_h = DraftContext(draft).open_round([a[:, :n] for a in aux], context, nxt)
        torch.testing.assert_close(got_h, want_h, atol=1e-5, rtol=1e-5)
        assert draft_chain(chain, new_rows, context, nxt, 3) == want
        cached_tree = draft_tree(tree, new_rows, context, nxt, 3, 3, 9)
        fresh_tree = draft_tree(DraftContext(draft), [a[:, :n] for a in aux], context, nxt, 3, 3, 9)
        assert cached_tree.tokens == fresh_tree.tokens
        assert cached_tree.scores == pytest.approx(fresh_tree.scores, abs=1e-4)
        n += commit
    with pytest.raises(ValueError, match="new rows"):
        draft_chain(chain, [a[:, :n] for a in aux], ids[0, :n].tolist(), int(ids[0, n]), 3)


def test_acceptance_by_context_length():
    by = acceptance_by_context_length([3, 0, 1, 2, 2], [10, 1023, 1024, 5000, 20000], k=3, edges=[1024, 4096, 16384])
    assert list(by) == ["<1k", "1k-4k", "4k-16k", ">=16k"]
    assert by["<1k"]["rounds"] == 2 and by["<1k"]["mean_acceptance_length"] == 1 + 3 / 2
    assert by["1k-4k"]["mean_acceptance_length"] == 2.0 and by[">=16k"]["rounds"] == 1
    empty = acceptance_by_context_length([1], [10], k=3, edges=[1000])
    assert empty[">=1000"] == {"rounds": 0, "mean_acceptance_length": None}


def test_smollm2_speculative_equals_greedy(smollm2):
    from specforge_lite.methods.eagle3.settings import Eagle3Settings
    from specforge_lite.data.vocab import DraftVocab
    from specforge_lite.methods import draft_spec
    from specforge_lite.methods.eagle3.model import Eagle3Draft
    from specforge_lite.generation import stop_ids

    config, target, tok = smollm2
    vocab = DraftVocab(torch.arange(0, 8000).long(), target.vocab_size, 1.0)
    spec = draft_spec(target.config, Eagle3Settings(), target.aux_layer_ids, target.convention,
                      target.vocab_size, vocab.size, target.hidden_size)
    torch.manual_seed(0)
    draft = Eagle3Draft(spec)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    draft.init_lm_head_from_target(target.full_head()[0], vocab.draft_to_target)
    draft.set_embedding(target.embedding_weight())
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name three colours."}], add_generation_prompt=True)
    prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    stops = stop_ids(tok, target)
    truth = hf_greedy(target, prompt, 24, eos=sorted(stops))
    got = speculative_generate(target, draft, prompt, 24, k=3, stop_ids=stops)
    assert got.tokens == truth


def second_token_distribution(target, prompt, temperature):
    """p(x2 | prompt) = sum_x1 p(x1 | prompt) p(x2 | prompt, x1) at ``temperature``, exactly, from the
    target in one batched forward."""
    V = target.vocab_size
    with torch.no_grad():
        p1 = torch.softmax(target.model(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        both = torch.tensor([prompt + [x] for x in range(V)])
        p2 = torch.softmax(target.model(both).logits[:, -1] / temperature, -1)  # [x1, x2]
    return (p1[:, None] * p2).sum(0)


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's test of observed counts against expected probabilities (bins under 5 expected pooled)."""
    exp = expected_probs * counts.sum()
    big = exp >= 5
    obs_bins, exp_bins = counts[big], exp[big]
    if bool((~big).any()):  # (an empty pooled bin would be 0/0)
        obs_bins = torch.cat([obs_bins, counts[~big].sum()[None]])
        exp_bins = torch.cat([exp_bins, exp[~big].sum()[None]])
    chi2 = float(((obs_bins - exp_bins) ** 2 / exp_bins).sum())
    dof = len(obs_bins) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(chi2 / 2)))


def test_speculative_sampling_draws_from_the_target_distribution():
    """At temperature > 0 the second generated token (the first one speculated) must follow the target's
    own distribution p(x2 | prompt) = sum_x1 p(x1) p(x2 | x1), computed here exactly from the target in
    one batched forward; a chi-square test over 1000 draws with a draft that differs from the target
    (half the vocabulary, frequent rejections)."""
    from specforge_lite.evaluate.spec_decode import speculative_sample

    target = tiny_target(aux_ids=[0, 1, 2], num_layers=2)
    draft = tiny_draft(target, draft_vocab_size=128, seed=1)
    T, V = 8.0, target.vocab_size
    prompt = [5, 17, 42, 99, 3]
    expected_x2 = second_token_distribution(target, prompt, T)

    g = torch.Generator().manual_seed(0)
    counts, rounds, accepted = torch.zeros(V), 0, 0
    n = 1000
    for _ in range(n):
        gen = speculative_sample(target, draft, prompt, 2, 3, set(), T, g)
        counts[gen.tokens[1]] += 1
        rounds, accepted = rounds + len(gen.accepted), accepted + sum(min(a, 1) for a in gen.accepted)
    assert 0.05 < accepted / rounds < 0.9  # the draft is right sometimes and wrong often: both paths run
    p_value = chi_square_p_value(counts, expected_x2)
    assert p_value > 1e-3, p_value


# ---- tree drafting -------------------------------------------------------------------------------------

def _oracle_tree(full, round_no, context_len, depth, vocab):
    """A tree whose true path (the target's greedy continuation in ``full``) sits at a different sibling rank
    each round and stops after a round-dependent depth; every other node is a wrong token."""
    from specforge_lite.draft.drafting import DraftTree

    tokens, parents, depths, scores = [], [], [], []
    parent, good_depth = -1, round_no % (depth + 1)  # 0..depth correct levels
    for d in range(1, depth + 1):
        truth = full[context_len + d]
        rank = (round_no + d) % 3
        level = [(truth + 1 + j) % vocab for j in range(3)]
        if d <= good_depth:
            level[rank] = truth
        first = len(tokens)
        for j, tok in enumerate(level):
            tokens.append(tok)
            parents.append(parent)
            depths.append(d)
            scores.append(-float(d) - 0.1 * j)
        parent = first + (rank if d <= good_depth else 0)
    return DraftTree(tokens, parents, depths, scores)


def test_tree_decoding_equals_greedy_whatever_branch_is_right(monkeypatch):
    """Greedy tree verification keeps only the accepted path's KV entries (not a contiguous prefix); the
    output must be the target's greedy continuation for every accepted depth and sibling rank."""
    from specforge_lite.evaluate import tree as tree_mod

    target, draft, prompt, truth = greedy_case()
    full = prompt + truth
    calls = {"n": 0}

    def oracle(draft_, aux_ctx, context, next_token, depth, topk, budget):
        calls["n"] += 1
        return _oracle_tree(full, calls["n"], len(context), depth, target.vocab_size)

    monkeypatch.setattr(drafting, "draft_tree", oracle)
    gen = tree_mod.tree_generate(target, draft, prompt, 40, depth=3, topk=3, budget=9, stop_ids=set())
    assert gen.tokens == truth
    assert set(gen.accepted) == {0, 1, 2, 3}


def test_tree_drafting_scores_equal_chain_unrolls_along_each_path():
    """Every node's cumulative score from the tree (one batched step per depth, TreeCache masks) equals
    the log-probabilities of feeding its path token by token through the TTT chain pattern."""
    from specforge_lite.methods.eagle3.ttt import TTTCache
    from specforge_lite.methods.eagle3.drafting import draft_tree

    target = tiny_target()
    draft = tiny_draft(target, seed=3)
    prompt = torch.randint(0, target.vocab_size, (9,)).tolist()
    cache = spec_decode._new_cache(target)
    aux, logits = target.forward_cached(torch.tensor([prompt]), cache)
    context, nxt = prompt[:-1], prompt[-1]
    aux = [a[:, :-1] for a in aux]
    tree = draft_tree(DraftContext(draft), aux, context, nxt, depth=3, topk=3, budget=12)
    assert len(tree.tokens) == 12 and max(tree.depths) == 3
    t2d = {int(t): i for i, t in enumerate(draft.draft_vocab_ids())}
    n = len(context)
    for i in range(len(tree.tokens)):
        path, node = [], i
        while node >= 0:
            path.insert(0, tree.tokens[node])
            node = tree.parents[node]
        with torch.no_grad():
            ttt = TTTCache()
            h = draft.step(torch.tensor([context[1:] + [nxt]]), draft.project_aux(aux), torch.arange(n)[None],
                           ttt)[:, -1:]
            score = 0.0
            for j, tok in enumerate(path):
                score += float(torch.log_softmax(draft.compute_logits(h)[0, -1].float(), -1)[t2d[tok]])
                h = draft.step(torch.tensor([[tok]]), h, torch.tensor([[n + j]]), ttt, q_offset=n - 1)
        assert abs(score - tree.scores[i]) < 1e-4, (i, path, score, tree.scores[i])


def test_tree_sampling_draws_from_the_target_distribution(monkeypatch):
    """Tree verification at temperature > 0 keeps the target's distribution: the first speculated token
    follows sum_x1 p(x1) p(x2 | x1) (chi-square over 1000 draws). The tree holds the target's own three
    likeliest tokens at each level plus a wrong one, so both accepting and rejecting branches run."""
    from specforge_lite.draft.drafting import DraftTree
    from specforge_lite.evaluate import tree as tree_mod

    target = tiny_target(aux_ids=[0, 1, 2], num_layers=2)
    draft = tiny_draft(target, draft_vocab_size=128, seed=1)
    T, V = 2.0, target.vocab_size
    prompt = [5, 17, 42, 99, 3]
    expected_x2 = second_token_distribution(target, prompt, T)

    def likely_tree(draft_, aux_ctx, context, next_token, depth, topk, budget):
        with torch.no_grad():
            row = target.model(torch.tensor([context + [next_token]])).logits[0, -1]
        top = row.topk(3).indices.tolist()
        return DraftTree(top + [(top[0] + 7) % V], [-1] * 4, [1] * 4, [-0.1, -0.2, -0.3, -0.4])

    monkeypatch.setattr(drafting, "draft_tree", likely_tree)
    g = torch.Generator().manual_seed(0)
    counts, rounds, accepted, n = torch.zeros(V), 0, 0, 1000
    for _ in range(n):
        gen = tree_mod.tree_generate(target, draft, prompt, 2, depth=1, topk=4, budget=4, stop_ids=set(),
                                     temperature=T, generator=g)
        counts[gen.tokens[1]] += 1
        rounds, accepted = rounds + len(gen.accepted), accepted + sum(gen.accepted)
    assert 0.3 < accepted / rounds < 0.9
    p_value = chi_square_p_value(counts, expected_x2)
    assert p_value > 1e-3, p_value


def test_tree_decoding_refuses_targets_that_cannot_verify_a_tree():
    import pytest

    from specforge_lite.evaluate.tree import tree_generate
    from specforge_lite.targets.families import get_family

    target = tiny_target()
    draft = tiny_draft(target)
    target.family = get_family("qwen3_next")
    with pytest.raises(ValueError, match="eval.drafting=chain"):
        tree_generate(target, draft, [1, 2, 3], 5, depth=2, topk=2, budget=4, stop_ids=set())


def test_parallel_draft_proposes_in_one_forward_what_the_chain_proposes():
    """P-EAGLE drafting as vLLM runs it: each round is ONE draft forward (the new rows and k-1 mask slots),
    and it proposes what the k-step chain (draft_chain, each later step reading the mask slot's inputs)
    proposes, round after round with the committed rows' keys kept, for rounds committing 1 to k+1 rows;
    speculative decoding with it still equals greedy. Fails when the parallel draft runs k forwards."""
    from specforge_lite.methods import draft_method
    from specforge_lite.methods.eagle3.parallel import ParallelDraftContext
    from specforge_lite.evaluate.spec_decode import greedy_generate

    target = tiny_target()
    for options in ({}, EAGLE31):
        draft = tiny_draft(target, seed=5, parallel_drafting=True, mask_token_id=7, **options)
        ids = torch.randint(0, target.vocab_size, (1, 40))
        aux = target.capture(ids).aux
        for k in (1, 3, 5):
            drafted = draft_method(draft.spec.method).drafting(draft)
            assert isinstance(drafted, ParallelDraftContext)
            chain, n, forwards = DraftContext(draft), 6, []
            real_step = draft.step
            for commit in [1, 4, 2, 3, 1, 4]:
                context, nxt = ids[0, :n].tolist(), int(ids[0, n])
                want = draft_chain(chain, [a[:, chain.rows:n] for a in aux], context, nxt, k)
                draft.step = lambda *a, **kw: forwards.append(1) or real_step(*a, **kw)
                try:
                    got = drafted.propose([a[:, drafted.rows:n] for a in aux], context, nxt, k)
                finally:
                    del draft.step
                assert got == want, (options, k, n)
                # and the draft's probability of each token, computed in the one forward as in the k steps
                torch.testing.assert_close(torch.tensor(drafted.confidences), torch.tensor(chain.confidences))
                n += commit
            assert len(forwards) == 6, f"k={k}: {len(forwards)} draft forwards in 6 rounds"
    prompt = ids[0, :8].tolist()
    out = spec_decode.speculative_generate(target, draft, prompt, 20, 3, set())
    assert out.tokens == greedy_generate(target, prompt, 20, set())


def test_calibration_error_per_position_against_a_count_by_hand():
    """Three rounds at k=2: position 1 reached by all three, position 2 by the two that accepted position 1.
    Position 1: confidences 0.95 (accepted), 0.91 (accepted), 0.15 (not): bins 0.9 (mean 0.93, both hit)
    and 0.1 (0.15, no hit): ECE = (2 * 0.07 + 0.15) / 3. Position 2: 0.55 (hit), 0.52 (missed): one bin,
    mean 0.535 and half hit: ECE 0.035."""
    cal = confidence.calibration([2, 1, 0], [[0.95, 0.55], [0.91, 0.52], [0.15, 0.9]], k=2)
    assert cal["rounds_reached_per_position"] == [3, 2]
    assert abs(cal["ece_per_position"][0] - (2 * 0.07 + 0.15) / 3) < 1e-9
    assert abs(cal["ece_per_position"][1] - 0.035) < 1e-9
    assert abs(cal["mean_confidence_per_position"][0] - (0.95 + 0.91 + 0.15) / 3) < 1e-9
    assert confidence.calibration([0], [[]], k=1)["ece_per_position"] == [None]  # (not recorded)



def test_adaptive_verification_against_a_count_by_hand():
    """Three rounds at k=2 (accepted 2, 0, 1; confidences [0.9, 0.8], [0.3, 0.9], [0.7, 0.2]): survival
    [0.9, 0.72], [0.3, 0.27], [0.7, 0.14]. Half the 6 slots by confidence: 0.9, 0.72 and 0.7, so rounds
    verify 2, 0 and 1 drafts and keep 2 + 0 + 1 = 3: 1.0 per verified slot, 2.0 tokens per verification.
    Without confidences every round verifies its first slot and keeps 1 + 0 + 1 = 2: 2/3 and 1 + 2/3."""
    out = confidence.adaptive_verification([2, 0, 1], [[0.9, 0.8], [0.3, 0.9], [0.7, 0.2]], k=2, budgets=(0.5,))
    half = out["budgets"]["0.5"]
    assert out["rounds"] == 3
    assert half["by_confidence"] == {"accepted_per_verified_slot": 1.0, "tokens_per_verification": 2.0}
    assert abs(half["without"]["accepted_per_verified_slot"] - 2 / 3) < 1e-12
    assert abs(half["without"]["tokens_per_verification"] - (1 + 2 / 3)) < 1e-12
    assert confidence.adaptive_verification([1], [[]], k=1) is None  # (no confidences recorded)


def test_the_platt_fit_recovers_how_the_acceptance_was_drawn():
    """Rounds whose acceptance is drawn as sigmoid(0.5 * logit(confidence) - 0.4) (an overconfident draft): the
    fit on the even rounds recovers a = 0.5 and b = -0.4, and on the odd rounds (out of the fit) the calibrated
    confidences' error is a fraction of the raw ones'."""
    g = torch.Generator().manual_seed(0)
    conf = (torch.rand(4000, generator=g) * 0.98 + 0.01).tolist()
    truth = torch.sigmoid(0.5 * torch.logit(torch.tensor(conf, dtype=torch.float64)) - 0.4)
    accepted = (torch.rand(4000, generator=g, dtype=torch.float64) < truth).long().tolist()
    fit = confidence.fitted_calibration(accepted, [[c] for c in conf])
    assert abs(fit["a"] - 0.5) < 0.08 and abs(fit["b"] + 0.4) < 0.12, fit
    assert fit["fit_positions"] == fit["judged_positions"] == 2000
    assert fit["ece_after"] < 0.4 * fit["ece_before"], fit
    assert confidence.fitted_calibration([1, 0], [[0.9], [0.2]]) is None  # too few rounds to fit and judge


def test_the_speed_up_at_each_k_from_the_measured_costs_by_hand():
    """Measured at k=3: acceptance 0.6, 0.3, 0.1 per position, target decode 10 ms, a verification of k'+1
    tokens 11, 11.5 and 12 ms (each timed), a chain draft's round 6 ms (2 ms a step). At k'=1: 1.6 tokens x 10 /
    (2 + 11) = 1.231; k'=2: 1.9 x 10 / (4 + 11.5) = 1.226; k'=3: 2.0 x 10 / (6 + 12) = 1.111: best k 1. A draft
    proposing in one forward pays its 6 ms at every k': 1.6 x 10 / 17, 1.9 x 10 / 17.5, 2.0 x 10 / 18."""
    from specforge_lite.evaluate.acceptance import speedup_by_k

    costs = {"target_decode_s": 0.010, "target_verify_s": 0.012, "draft_round_s": 0.006, "draft_steps_per_round": 3,
             "target_verify_s_by_k": [0.011, 0.0115, 0.012]}
    chain = speedup_by_k([0.6, 0.3, 0.1], costs)
    assert [round(chain[k], 4) for k in (1, 2, 3)] == [round(1.6 * 10 / 13, 4), round(1.9 * 10 / 15.5, 4),
                                                       round(2.0 * 10 / 18, 4)]
    assert max(chain, key=chain.get) == 1
    one = speedup_by_k([0.6, 0.3, 0.1], {**costs, "draft_steps_per_round": 1})
    assert [round(one[k], 4) for k in (1, 2, 3)] == [round(x * 10 / d, 4) for x, d in ((1.6, 17), (1.9, 17.5),
                                                                                      (2.0, 18))]


def test_a_one_forward_drafts_fastest_k_can_be_below_the_evaluated_one():
    """H6: each k' is charged the verification of its own k'+1 tokens, so a draft that proposes all k in one
    forward (whose round costs the same at every k') is not always fastest at the evaluated k. Acceptance
    0.6, 0.3, 0.02; verification 11, 12, 16 ms: 1.6 x 10 / 17 = 0.94, 1.9 x 10 / 18 = 1.06, 1.92 x 10 / 22 =
    0.87: best k 2 (charged 16 ms at every k', it would be 3)."""
    from specforge_lite.evaluate.acceptance import estimate_by_k

    costs = {"target_decode_s": 0.010, "target_verify_s": 0.016, "draft_round_s": 0.006, "draft_steps_per_round": 1,
             "target_verify_s_by_k": [0.011, 0.012, 0.016]}
    estimate = estimate_by_k([0.6, 0.3, 0.02], costs)
    assert estimate["best_k"] == 2
    assert estimate["estimated_speedup_by_k"][2] == pytest.approx(1.9 * 10 / 18)


def test_the_verification_is_timed_at_each_k_and_a_fixed_k_draft_gets_no_table():
    """H6: a chain draft's step costs time the target's verification of k'+1 tokens for every k' up to the
    evaluated k (the last is the verification at k); a block draft, whose k is fixed at training, is timed at
    its k only and gets no by-k estimate (it cannot be served at another k)."""
    from specforge_lite.config import EvalConfig
    from specforge_lite.evaluate.acceptance import estimate_by_k, measure_step_costs
    from test_dflash import tiny_block_draft

    target = tiny_target(aux_ids=[2, 4, 6])
    prompt = torch.randint(0, target.vocab_size, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    costs = measure_step_costs(target, tiny_draft(target), prompt, EvalConfig(num_draft_tokens=3), repeats=2)
    assert len(costs["target_verify_s_by_k"]) == 3 and all(t > 0 for t in costs["target_verify_s_by_k"])
    assert costs["target_verify_s_by_k"][-1] == costs["target_verify_s"]
    assert estimate_by_k([0.6, 0.3, 0.1], costs)["best_k"] in (1, 2, 3)
    block = tiny_block_draft(target, block_size=4)
    costs = measure_step_costs(target, block, prompt, EvalConfig(num_draft_tokens=3), repeats=2)
    assert costs["target_verify_s_by_k"] is None and costs["target_verify_s"] > 0
    assert estimate_by_k([0.6, 0.3, 0.1], costs) == {"estimated_speedup_by_k": None, "best_k": None}


def test_the_platt_fit_is_judged_on_other_prompts_than_it_was_fit_on():
    """H10: the held-out half of the Platt fit is split by prompt, not by round: rounds of one prompt share its
    context (their acceptance goes together), so a prompt's rounds on both sides would judge the fit on what
    it was fit on. Three prompts of 30, 50 and 40 rounds: fit on the first and third (70 positions), judged on
    the second (50); by alternate rounds it would be 60 and 60."""
    g = torch.Generator().manual_seed(0)
    conf = (0.05 + 0.9 * torch.rand(120, generator=g, dtype=torch.float64)).tolist()
    accepted = (torch.rand(120, generator=g, dtype=torch.float64) < torch.tensor(conf)).long().tolist()
    prompts = ["a"] * 30 + ["b"] * 50 + ["c"] * 40
    fit = confidence.fitted_calibration(accepted, [[c] for c in conf], prompts)
    assert (fit["fit_positions"], fit["judged_positions"]) == (70, 50)
    assert (fit["fit_prompts"], fit["judged_prompts"]) == (2, 1)
    assert confidence.fitted_calibration(accepted, [[c] for c in conf], ["a"] * 120) is None  # one prompt: no judge

