"""Capture throughput of the HF vs the lean backend, and the memory of our capture vs output_hidden_states.

    python -m specforge_lite.bench capture --model smollm2_135m [--seq-lens 512,2048] [--batch 2]

One capture = the target forward that yields the aux states and the final state, plus the teacher
(draft-vocabulary logits and the full-vocabulary argmax check) where a loss is taken, i.e. everything
the target does per training step. Two batch shapes per sequence length T: "full" (every row T tokens)
and "mixed" (row lengths spread from T/4 to T, right-padded to T, as real conversations are). The
second half of each row carries the loss, as assistant turns do. The two backends alternate in one
process; the figures are medians and the ratio is what to read (the machine is noisy).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def make_batch(batch: int, seq_len: int, vocab: int, mixed: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=g)
    lengths = [seq_len] * batch if not mixed else [
        int(seq_len // 4 + (seq_len - seq_len // 4) * i / max(batch - 1, 1)) for i in range(batch)]
    att = torch.zeros(batch, seq_len, dtype=torch.long)
    loss = torch.zeros(batch, seq_len, dtype=torch.long)
    for r, n in enumerate(lengths):
        att[r, :n] = 1
        loss[r, n // 2 : n] = 1
    return ids, att, loss


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m specforge_lite.bench capture", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2_135m", help="model preset")
    p.add_argument("--seq-lens", default="512,2048")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per backend and shape (after a warm-up)")
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("overrides", nargs="*", help="further Hydra overrides")
    a = p.parse_args(argv)

    from ..compose import load_config
    from ..draft.objective import DraftObjective
    from ..targets import build_target
    from ..targets import HFTarget, Teacher
    from .memory import peak_bytes

    config = load_config([f"model={a.model}", "tracker=none", *a.overrides])
    hf = build_target(config)
    lean = HFTarget(hf.model, hf.family, hf.aux_layer_ids, hf.location, backend="lean")
    vd = min(a.draft_vocab, hf.vocab_size)
    # The most frequent ids are unknown here; a spread of ids keeps the full-vocab argmax check on.
    draft_ids = torch.linspace(0, hf.vocab_size - 1, vd).long().unique()
    t2d = torch.zeros(hf.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    teachers = {t.backend: Teacher(t, draft_ids, t2d) for t in (hf, lean)}
    print(f"target {config.model.name}: {hf.num_layers} layers, hidden {hf.hidden_size}, vocab {hf.vocab_size}, "
          f"{hf.dtype} on {hf.device}; aux ids {hf.aux_layer_ids}; draft vocab {len(draft_ids)}; "
          f"lean backend: {'lean forward' if lean.lean else 'delegates to HF modules'}; "
          f"{torch.get_num_threads()} threads")

    def step(target, ids, att, loss):
        teachers[target.backend](target.capture(ids, att), DraftObjective.teacher_positions(loss))

    rows = []
    for T in [int(x) for x in a.seq_lens.split(",")]:
        for mixed in (False, True):
            ids, att, loss = make_batch(a.batch, T, hf.vocab_size, mixed)
            ntok = int(att.sum())
            times = {"hf": [], "lean": []}
            for r in range(a.repeats + 1):
                for name, target in (("hf", hf), ("lean", lean)):
                    t0 = time.perf_counter()
                    step(target, ids, att, loss)
                    if r > 0:
                        times[name].append(time.perf_counter() - t0)
            tps = {k: ntok / statistics.median(v) for k, v in times.items()}
            rows.append((T, "mixed" if mixed else "full", ntok, tps["hf"], tps["lean"], tps["lean"] / tps["hf"]))
            print(f"  T={T} {rows[-1][1]:5s} {ntok:6d} tokens: HF {tps['hf']:8.1f} tok/s, lean {tps['lean']:8.1f} "
                  f"tok/s, lean/HF {rows[-1][-1]:.2f}x", flush=True)

    print("\npeak memory above the weights, one row of T tokens (fp32 activations):")
    decoder = hf.family.decoder(hf.model)
    for T in [int(x) for x in a.seq_lens.split(",")]:
        ids, att, _ = make_batch(1, T, hf.vocab_size, False)
        aux_bytes = len(hf.aux_layer_ids) * T * hf.hidden_size * torch.finfo(hf.dtype).bits // 8
        with torch.no_grad():
            plain = peak_bytes(lambda: decoder(input_ids=ids, attention_mask=att, use_cache=False), hf.device)
            ours = peak_bytes(lambda: hf.capture(ids, att), hf.device)
            lean_peak = peak_bytes(lambda: lean.capture(ids, att), hf.device)
            every = peak_bytes(lambda: decoder(input_ids=ids, attention_mask=att, use_cache=False,
                                               output_hidden_states=True), hf.device)
        mib = lambda b: f"{b / 2**20:7.1f} MiB"  # noqa: E731
        print(f"  T={T}: plain forward {mib(plain)} | our capture (HF) {mib(ours)} (overhead {mib(ours - plain)}, "
              f"aux tensors {mib(aux_bytes)}) | lean {mib(lean_peak)} | output_hidden_states=True {mib(every)} "
              f"-> ours/all-layers {ours / every:.2f}x")


if __name__ == "__main__":
    main()
