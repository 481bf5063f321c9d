"""The data stage with the target as its writer: the answers regenerated (data.regenerate) and the requests of
data.self_generated, by the engine data.generation names (a vLLM server started for it where none is given)."""

from __future__ import annotations

from ..config import Config
from ..data import prepare_data
from ..data.images import image_inputs
from ..targets import HFTarget
from .lazy import LazyGenerator


def prepare_with_target(config: Config, target: HFTarget, tokenizer, log=print):
    """The prepared data (data.prepare_data), with the target as the answer generator when data.regenerate is on
    and as the request writer when the mix holds self_generated."""
    server = vllm_server(config, target, log)  # (engine openai with no server_url; started on first use)
    generator = LazyGenerator(config, target, tokenizer, server, log)
    sg = config.data.self_generated
    writer = LazyGenerator(config, target, tokenizer, server, log, temperature=sg.temperature, top_p=sg.top_p,
                           max_new_tokens=sg.max_new_tokens, seed=sg.seed)
    try:
        return prepare_data(config.data, tokenizer, generate=generator, model_fingerprint=generator.fingerprint(),
                            log=log, images=image_inputs(target), request_writer=writer)
    finally:
        if server is not None:
            server.stop()


def vllm_server(config: Config, target: HFTarget, log=print):
    """The vLLM server the openai engine starts from the serving environment, when no server_url is given:
    the target's own folder, its generation dtype, a context of the target's positions (at most 32k)."""
    gen = config.data.generation
    if gen.engine != "openai" or gen.server_url:
        return None
    from ..device import dtype_name, resolve_dtype
    from ..serving import VLLMServer

    positions = getattr(target.config, "max_position_embeddings", None) or 32768
    dtype = target.dtype if gen.dtype == "auto" else resolve_dtype(gen.dtype, target.device)
    return VLLMServer(str(target.location), min(positions, 32768), dtype_name(dtype), gen.server_memory_fraction,
                      log=log)
