"""The draft vocabulary of the published-draft fixtures (run with the project's venv, before the peers'
save_*_draft.py scripts: ``.venv/bin/python studies/peers/published_vocab.py``).

A published draft's vocabulary holds the tokens its target says most; a random 256 of the tiny target's 49152
would hold almost none of them, and a run continuing the draft would find no token to learn. So the fixtures'
draft vocabulary holds every token the tiny target predicts (greedy, in fp32) on the training rows of the small run
the tests continue them with, most often first, up to 256. Writes OUT/draft_vocab.json: that run's overrides and
the token ids.
"""

from __future__ import annotations

import collections
import json

import torch

from _published import DRAFT_VOCAB, parse_args

# the tiny run the tests continue the fixture drafts with (tests/test_published_drafts.py reads them here)
OVERRIDES = ["model=llama3_tiny", "model.dtype=float32", "recipe=none", "data=chitchat", "data.max_samples=48",
             "data.heldout_samples=8", "data.max_length=96", "tracker=none"]


def main() -> None:
    a = parse_args(__doc__)
    from specforge_lite.compose import load_config
    from specforge_lite.run import Run

    run = Run.online(load_config(OVERRIDES), log=lambda message: None)
    answers, anywhere = collections.Counter(), collections.Counter()
    with torch.no_grad():
        for row in run.train_data:
            ids, mask = torch.tensor(row["input_ids"])[None], torch.tensor(row["loss_mask"])
            predicted = run.target.model(ids).logits.argmax(-1)[0][:-1]
            answers.update(predicted[mask[1:].bool()].tolist())  # what the loss is taken on
            anywhere.update(predicted.tolist())
    # what it predicts in the answers first, then elsewhere in the rows; a random target says few tokens, so the
    # lowest other ids fill the rest (tokens a draft's head keeps and rarely proposes, as in any draft vocabulary)
    ranked = [t for t, _ in answers.most_common()] + [t for t, _ in anywhere.most_common() if t not in answers]
    ranked += [t for t in range(run.target.vocab_size) if t not in set(ranked)][:DRAFT_VOCAB]
    ids = sorted(ranked[:DRAFT_VOCAB])
    counts = answers
    a.out.mkdir(parents=True, exist_ok=True)
    covered = sum(counts[t] for t in ids) / max(1, sum(counts.values()))
    (a.out / "draft_vocab.json").write_text(json.dumps({"overrides": OVERRIDES, "covered": round(covered, 3),
                                                        "ids": ids}) + "\n")
    print(f"{a.out / 'draft_vocab.json'}: {len(ids)} tokens, {covered:.0%} of the target's predictions")


if __name__ == "__main__":
    main()
