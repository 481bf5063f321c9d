"""Load an Eagle3 export with speculators' own model class and write its per-step draft logits.

Runs in the serving environment (scripts/setup_serving.sh), where speculators is installed:

    .serving/bin/python eval/speculators_logits.py --export DIR --inputs IN.safetensors --out OUT.safetensors

IN holds ``aux`` [1, T, n_aux * H] (the target's aux states, concatenated in id order), ``input_ids``
[1, T] (token t+1 at row t, as the draft's first step reads them) and ``embedding`` (the target's table,
which exports leave out). OUT holds ``logits`` [steps, T, draft_vocab]: speculators' lm_head output
at each TTT step, captured with a forward hook.
"""

from __future__ import annotations

import argparse

import torch
from safetensors.torch import load_file, save_file


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export", required=True)
    p.add_argument("--inputs", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args(argv)

    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(a.export)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention does not run on CPU
    model = Eagle3DraftModel.from_pretrained(a.export, config=config).float().eval()
    inputs = load_file(a.inputs)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(inputs["embedding"])
    logits = []
    handle = model.lm_head.register_forward_hook(lambda m, args, out: logits.append(out[0].detach()))
    ids = inputs["input_ids"]
    with torch.no_grad():
        model(hidden_states=inputs["aux"], input_ids=ids, document_ids=torch.zeros_like(ids), ttt_steps=a.steps)
    handle.remove()
    save_file({"logits": torch.stack(logits).contiguous()}, a.out)


if __name__ == "__main__":
    main()
