"""The target's answer generator for regenerated data and self-generated requests, built on first use
(``LazyGenerator``), on the engine ``data.generation.engine`` names (engines.py), and the target's stop tokens."""

from __future__ import annotations

import torch

from ..config import Config
from ..targets import HFTarget


def stop_ids(tokenizer, target: HFTarget) -> set[int]:
    ids = {tokenizer.eos_token_id}
    gen = getattr(target.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos])
    return {i for i in ids if i is not None}


def lean_decoder(target: HFTarget, model, slots: int, max_new_tokens: int, stops: set[int], temperature: float = 0.0,
                 top_p: float = 1.0):
    """Our continuous-batching decoder (targets/lean/decode.py) over ``model``: the target's, or its copy in
    another dtype."""
    from ..targets.lean import build_lean_forward
    from ..targets.lean.decode import LeanDecoder
    from ..targets.teacher import LogitHead

    family = target.family
    head = LogitHead(family.lm_head_weight(model), family.lm_head_bias(model), family, model.config)
    return LeanDecoder(build_lean_forward(family, model), head, slots, max_new_tokens, stops, temperature, top_p)


class LazyGenerator:
    """The target's answer generator (an AnswerStream, data/regenerate.py), built on first use: a run whose
    regenerated data is cached loads no extra model. With ``generation.dtype`` other than the target's, a
    second copy is loaded in it. ``generation.engine``: lean (continuous batching over our lean forward),
    hf (transformers' generate), auto (lean where the family has a lean forward)."""

    def __init__(self, config: Config, target: HFTarget, tokenizer, server=None, log=print, **overrides):
        """``overrides``: generation settings that differ from data.generation's (sampling of self-generated
        requests: temperature, top_p, max_new_tokens, seed). ``server``: engine openai without a server_url,
        the VLLMServer (serving.py) to start on first use."""
        from dataclasses import replace

        self.config, self.target, self.tokenizer, self.server, self.log = config, target, tokenizer, server, log
        self.settings = replace(config.data.generation, **overrides)
        self._impl = None

    @property
    def engine(self) -> str:
        name = self.settings.engine
        lean = self.target.family.lean_forward is not None and self.config.target.shard == "none"
        if name == "lean" and not lean:
            raise ValueError(f"data.generation.engine=lean: the {self.target.family.name} family has no lean forward "
                             "(or the target is sharded); use data.generation.engine=hf")
        return name if name != "auto" else ("lean" if lean else "hf")

    def counters(self) -> dict:
        """What the generation computed so far (data.regenerate.COUNTERS)."""
        from ..data.regenerate import counters

        return counters(self._impl) if self._impl is not None else {}

    def fingerprint(self) -> str:
        import hashlib

        served = f"|{self.settings.server_model or self.target.location}" if self.engine == "openai" else ""
        blob = f"{self.target.location}|{self.target.config.to_json_string()}|{self._dtype()}|{self.engine}{served}"
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def _dtype(self) -> torch.dtype:
        from ..device import resolve_dtype

        name = self.settings.dtype
        return self.target.dtype if name == "auto" else resolve_dtype(name, self.target.device)

    def _build(self):
        gen, stops = self.settings, stop_ids(self.tokenizer, self.target)
        if self.target.parts_only and self.engine != "openai":
            raise ValueError("the data needs regenerating, and this target holds only its parts (an ingest reads "
                             "no more): prepare the data first with the same overrides (python train.py ... or "
                             "offline dump), or regenerate through a server (data.generation.engine=openai)")
        if self.engine == "openai":
            from .engines import ServedAnswers
            from .served_model import check_served_model

            url, model = gen.server_url or self.server.start, gen.server_model or str(self.target.location)
            if gen.server_url and gen.check_server:  # (a server the run starts serves the target's own folder)
                whole = not self.target.parts_only and self.config.target.shard == "none"
                check_served_model(url, model, self.target, self.tokenizer, gen.request_timeout, whole, self.log)
            return ServedAnswers(url, model, self.tokenizer,
                                 gen.max_new_tokens, gen.temperature, gen.top_p, stops, gen.concurrency,
                                 gen.request_timeout, gen.max_retries)
        model = self.target.model
        if self._dtype() != self.target.dtype:
            model = self.target.family.load(self.target.location, dtype=self._dtype(),
                                            trust_remote_code=self.target.trust_remote_code)
            model = model.to(self.target.device).eval()
        if self.engine == "hf":
            from .engines import HFGenerator

            return HFGenerator(model, self.tokenizer, gen.max_new_tokens, gen.temperature, gen.top_p, stops)
        from .engines import LeanAnswers

        decoder = lean_decoder(self.target, model, gen.batch_size, gen.max_new_tokens, stops, gen.temperature,
                               gen.top_p)
        return LeanAnswers(decoder, self.tokenizer)

    def stream(self, queue):
        from ..data.regenerate import answer_stream

        if self._impl is None:
            self._impl = self._build()
        return answer_stream(self._impl, self.settings.batch_size).stream(queue)

    def __call__(self, conversations):
        """Answers to a list of conversations, in order (benchmarks; regeneration uses stream)."""
        from ..data.regenerate import FailedAnswer, PromptQueue
        from ..errors import UserError

        queue = PromptQueue()
        for i, messages in enumerate(conversations):
            queue.push(i, messages, self.settings.seed)
        answers = dict(self.stream(queue))
        failed = [a.reason for a in answers.values() if isinstance(a, FailedAnswer)]
        if failed:
            raise UserError(f"{len(failed)} of {len(conversations)} requests failed after the retries (the first: "
                            f"{failed[0]}); check the server (data.generation.server_url) and run the same command")
        return [answers[i] for i in range(len(conversations))]
