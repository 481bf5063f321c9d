"""Whether a server named in data.generation.server_url serves the target: the answers it writes become the draft's
training text, and the teacher is the target in this process, so a server of another model (another fine-tune, the
base model, a copy quantized past recognition) trains a draft on text its target would not write, unsaid.

Before the first answer the server is asked for its log-probabilities of a chat prompt's tokens (vLLM's
``prompt_logprobs``), which are held against the target's own through its final norm and lm_head (the teacher's
head). Measured on SmolLM2-135M: vLLM's CPU build against our fp32 forward 0.06 nats apart on average; the target in
bf16 0.07; its weights rounded to int8 0.09, to int4 (groups of 32) 1.3; 5% noise on every weight 0.6, 20% 3.1-3.8.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import torch

from ..errors import UserError
from ..serving import prompt_logprobs
from ..targets.teacher import LogitHead, logprob_gap
from .engines import encode_prompt

PROBE = [{"role": "user", "content": "Write two sentences about the sea, then say which images you chose and why."}]
PROBE_TOKENS = 64
SERVED_MODEL_GAP = 1.0  # nats on average: past it, another model (or one quantized so far that its text is another's)
_checked: set[tuple[str, str, str]] = set()  # (url, model, target) held against each other in this process


def check_served_model(url: str, model: str, target, tokenizer, timeout: float, whole: bool, log=print) -> None:
    """Refuse the server at ``url`` when its log-probabilities of the probe's tokens are more than
    ``SERVED_MODEL_GAP`` from the target's; say the figure either way, or why it was not measured. ``whole``: this
    process holds the whole target (not its parts alone, not a rank's shard: a forward here would wait for the
    other ranks)."""
    key = (url, model, str(target.location))
    if key in _checked:
        return
    _checked.add(key)
    where = f"the server at {url}"
    if not whole:
        log(f"[regenerate] {where} is not held against the target (this process does not hold the whole target to "
            "compare with)")
        return
    ids = encode_prompt(tokenizer, PROBE)[:PROBE_TOKENS]
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
    request = urllib.request.Request(f"{url.rstrip('/')}/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            theirs = prompt_logprobs(json.loads(response.read()), ids)
    except (urllib.error.URLError, OSError, ValueError) as e:  # (the regeneration's own requests say what is wrong)
        log(f"[regenerate] {where} did not answer the check of the model it serves ({getattr(e, 'reason', e)}): "
            "not checked")
        return
    if theirs is None:
        log(f"[regenerate] {where} answers without prompt log-probabilities (vLLM's prompt_logprobs): the model it "
            "serves is not checked against the target")
        return
    with torch.no_grad():
        final = target.capture(torch.tensor([ids], device=target.device)).final_hidden[0]
    gap = logprob_gap(LogitHead(*target.full_head(), target.family, target.config), final, ids, theirs)
    if gap > SERVED_MODEL_GAP:
        raise UserError(f"{where} serves another model than the target ({target.location}): its log-probabilities of "
                        f"a chat prompt's tokens are {gap:.2f} nats from the target's own on average (the same model: "
                        f"about 0.1; at most {SERVED_MODEL_GAP:g}), and the draft would train on text its target does "
                        "not write. Serve the target there, or train with model= set to the model it serves "
                        "(data.generation.check_server=false: not checked)")
    log(f"[regenerate] {where} serves the target: its log-probabilities of {len(theirs)} prompt tokens are {gap:.3f} "
        "nats from the target's own on average")
