"""Regeneration throughput: the answer engines side by side on the same prompts, in one process.

    python -m specforge_lite.bench regenerate [--prompts 128] [--engines hf,lean,hf_cb,openai] [--batch-size 64]
                                              [--dtypes auto] [--max-new-tokens 128] [overrides]

``openai``: vLLM's OpenAI-compatible server started from the serving environment (scripts/setup_serving.sh),
``--batch-size`` requests in flight; its start-up is not timed. ``hf_cb``: transformers' own continuous
batching (``model.generate_batch``, paged KV cache, up to ``--batch-size`` requests per step) on the target's
weights (the ``auto`` dtype only); not a data.generation.engine, measured here to decide whether to become one.

For each dtype and engine: useful answer tokens per second (answer tokens, stop token included, over the
wall time), the share of decode compute spent on rows whose answer had already ended (HF generate runs a
batch until its longest answer ends), the share of prompt positions that were padding, and how many
answers equal the first engine's (greedy answers can differ where two tokens nearly tie: the engines
sum in different orders).
"""

from __future__ import annotations

import argparse
import time


class TransformersContinuousBatching:
    """transformers' continuous batching (``model.generate_batch``) as a generator of greedy answers: finished
    requests leave the batch and waiting ones take their place, so no row decodes past its answer's end and no
    prompt is padded (its counters say so)."""

    def __init__(self, target, tokenizer, max_new_tokens: int, slots: int):
        from transformers import ContinuousBatchingConfig, GenerationConfig

        from ..generation import stop_ids

        self.target, self.tokenizer = target, tokenizer
        stops = sorted(stop_ids(tokenizer, target))
        self.generation = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops,
                                           pad_token_id=tokenizer.pad_token_id or stops[0])
        self.max_new_tokens, self.slots, self.config_class = max_new_tokens, slots, ContinuousBatchingConfig
        self.stops = stops
        self.tokens_generated = self.prompt_tokens = 0

    def batching(self, prompts: list[list[int]]):
        """A paged cache sized for ``slots`` of the longest prompt and answer: left to infer it from free memory,
        it took 3x the time on a CPU (16 prompts, 32 new tokens: 55 tokens/s against 157)."""
        page = 256
        blocks = -(-(max(map(len, prompts)) + self.max_new_tokens) // page)
        return self.config_class(max_requests_per_batch=self.slots, page_size=page, max_batch_tokens=1024,
                                 num_blocks=blocks * min(self.slots, len(prompts)))

    def counters(self) -> dict:
        return {"tokens_generated": self.tokens_generated, "decode_rows": self.tokens_generated,
                "prompt_tokens": self.prompt_tokens, "prompt_pad_tokens": 0}

    def __call__(self, conversations) -> list[str]:
        from ..generation import encode_prompt
        from ..generation.engines import answer_text

        prompts = [encode_prompt(self.tokenizer, c) for c in conversations]
        self.prompt_tokens += sum(map(len, prompts))
        out = self.target.model.generate_batch(prompts, generation_config=self.generation,
                                               continuous_batching_config=self.batching(prompts), progress_bar=False)
        results = sorted(out.values(), key=lambda r: int(r.request_id.rsplit("_", 1)[-1]))  # req_<input index>
        failed = [r.error for r in results if r.error]
        if failed:
            raise RuntimeError(f"transformers' continuous batching failed {len(failed)} requests: {failed[0]}")
        answers = []
        for r in results:
            self.tokens_generated += len(r.generated_tokens)  # the stop token included, as the other engines count
            answers.append(answer_text(self.tokenizer, r.generated_tokens, self.stops))
        return answers


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

    from ..compose import load_config
    from ..data.formats import MalformedRow, iter_rows, normalize_conversation
    from ..data.sources import data_file
    from ..data.regenerate import compute_shares
    from ..generation import LazyGenerator
    from ..generation import vllm_server
    from ..targets import build_target, load_tokenizer

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
            if engine == "hf_cb" and dtype != "auto":
                print(f"{dtype:>9} {engine:>5}: skipped (it runs on the target's own weights: dtype auto only)")
                continue
            gen.dtype, gen.engine = dtype, ("hf" if engine == "hf_cb" else engine)
            server = vllm_server(config, target)
            generator = (TransformersContinuousBatching(target, tok, a.max_new_tokens, a.batch_size)
                         if engine == "hf_cb" else LazyGenerator(config, target, tok, server))
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
