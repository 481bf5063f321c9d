"""Regeneration throughput: the answer engines side by side on the same prompts, in one process.

    python -m specforge_lite.bench regenerate [--prompts 128] [--engines hf,lean,openai] [--batch-size 64]
                                              [--dtypes auto] [--max-new-tokens 128] [overrides]

``openai``: vLLM's OpenAI-compatible server started from the serving environment (scripts/setup_serving.sh),
``--batch-size`` requests in flight; its start-up is not timed.

For each dtype and engine: useful answer tokens per second (answer tokens, stop token included, over the
wall time), the share of decode compute spent on rows whose answer had already ended (HF generate runs a
batch until its longest answer ends), the share of prompt positions that were padding, and how many
answers equal the first engine's (greedy answers can differ where two tokens nearly tie: the engines
sum in different orders).
"""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m specforge_lite.bench regenerate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--engines", default="hf,lean")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--dtypes", default="auto", help="generation dtypes, e.g. auto or float32,bfloat16")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)

    from ..config import load_config
    from ..data.formats import MalformedRow, iter_rows, normalize_conversation
    from ..data.prepare import data_file
    from ..data.regenerate import compute_shares
    from ..generation import LazyGenerator
    from ..pipeline import build_target, load_tokenizer, vllm_server

    config = load_config(["tracker=none", *a.overrides])
    target = build_target(config)
    tok = load_tokenizer(target, config.model.chat_template)
    prompts = []
    data = config.data  # a mix: its first file source (the prompts must be the same for every engine)
    source = next(m for m in data.mix if m.source != "self_generated") if data.source == "mix" else data
    for _, _, row in iter_rows(data_file(source)):
        try:
            messages = normalize_conversation(row)
        except (MalformedRow, TypeError, ValueError):
            continue
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if first:
            prompts.append(messages[:first])
        if len(prompts) == a.prompts:
            break
    gen = config.data.generation
    gen.batch_size = gen.concurrency = a.batch_size
    gen.max_new_tokens = a.max_new_tokens
    print(f"{config.model.name}: {len(prompts)} first-turn prompts, up to {a.max_new_tokens} new tokens, greedy, "
          f"{a.batch_size} answers at once")
    rates, reference = {}, None
    for dtype in a.dtypes.split(","):
        for engine in a.engines.split(","):
            gen.dtype, gen.engine = dtype, engine
            server = vllm_server(config, target)
            generator = LazyGenerator(config, target, tok, server)
            try:
                generator(prompts[:1])  # build (load a copy in another dtype, start the server) before timing
                before = generator.counters()
                t0 = time.perf_counter()
                answers = generator(prompts)
                seconds = time.perf_counter() - t0
            finally:
                if server is not None:
                    server.stop()
            after = generator.counters()
            shares = compute_shares({k: after[k] - before.get(k, 0) for k in after})
            rate = shares["generated_tokens"] / seconds
            rates[(dtype, engine)] = rate
            reference = reference or answers
            same = sum(x == y for x, y in zip(answers, reference))
            print(f"{dtype:>9} {engine:>5}: {rate:6.1f} useful tokens/s ({shares['generated_tokens']} tokens in "
                  f"{seconds:.0f} s); decode past the end of an answer {shares.get('decode_past_end_share', 0):.0%}, "
                  f"prompt padding {shares.get('prompt_padding_share', 0):.0%}; answers equal to the first engine's: "
                  f"{same}/{len(prompts)}")
    (d0, e0), base = next(iter(rates.items()))
    print(f"ratios to {d0}/{e0}: " + ", ".join(f"{d}/{e} {r / base:.2f}x" for (d, e), r in rates.items()))
