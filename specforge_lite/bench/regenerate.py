"""Regeneration throughput: the target's batched generation vs one conversation at a time.

    python -m specforge_lite.bench regenerate [--prompts 32] [--batch-sizes 1,16,64] [--dtypes float32,bfloat16]

Same held-out-style prompts for every setting, in one process; prints generated tokens/s and ratios.
"""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m specforge_lite.bench regenerate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)

    from ..config import load_config
    from ..data.formats import iter_rows, normalize_conversation
    from ..data.prepare import data_file
    from ..pipeline import LazyGenerator, build_target, load_tokenizer

    config = load_config(["tracker=none", *a.overrides])
    target = build_target(config)
    tok = load_tokenizer(target, config.model.chat_template)
    convs = []
    for _, _, row in iter_rows(data_file(config.data)):
        try:
            m = normalize_conversation(row)
        except Exception:
            continue
        first = next(i for i, x in enumerate(m) if x["role"] == "assistant")
        convs.append(m[:first])
        if len(convs) == a.prompts:
            break
    results = {}
    for dtype in a.dtypes.split(","):
        for bs in (int(x) for x in a.batch_sizes.split(",")):
            config.data.generation.dtype, config.data.generation.max_new_tokens = dtype, a.max_new_tokens
            gen = LazyGenerator(config, target, tok)
            gen(convs[:1])  # load and warm up
            before = gen.tokens_generated
            t0 = time.perf_counter()
            for i in range(0, len(convs), bs):
                gen(convs[i : i + bs])
            rate = (gen.tokens_generated - before) / (time.perf_counter() - t0)
            results[(dtype, bs)] = rate
            print(f"{dtype:>9} batch {bs:>3}: {rate:6.1f} generated tokens/s")
    base = results[next(iter(results))]
    print("ratios to " + "/".join(map(str, next(iter(results)))) + ": "
          + ", ".join(f"{d}/{b} {r / base:.1f}x" for (d, b), r in results.items()))
