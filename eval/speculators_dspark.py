"""Load a DSpark export (vLLM's layout, export/dspark.py) into speculators' own DSpark model and write what its
training forward computes: every anchor block's Markov-biased draft logits and confidence logits.

Runs in the serving environment (scripts/setup_serving.sh), where speculators 0.9.0 is installed:

    .serving/bin/python eval/speculators_dspark.py --export DIR --target DIR --inputs IN.safetensors \
        --out OUT.safetensors

IN holds ``aux`` [1, T, n_aux * H] (the target's aux states, concatenated in id order), ``input_ids`` [1, T]
and ``loss_mask`` [1, T]. speculators picks its anchors itself (at random among the rows with loss); OUT
holds them (``anchors``) with ``logits`` [anchors * block, draft_vocab] and ``confidence`` [anchors * block],
read from the arguments its forward hands to its loss (``compute_metrics``), so every line of its forward
runs as it does in speculators' own training.
"""

from __future__ import annotations

import argparse
import json

import torch
from safetensors.torch import load_file, save_file


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export", required=True)
    p.add_argument("--target", required=True, help="the target's folder (speculators' verifier)")
    p.add_argument("--inputs", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)

    from transformers import AutoConfig

    import speculators.models.dspark.core as dspark_core
    from speculators.models.dspark import DSparkDraftModel

    ours = json.loads(open(f"{a.export}/config.json").read())
    weights = load_file(f"{a.export}/model.safetensors")
    layer_config = AutoConfig.from_pretrained(a.target)  # the draft's layers have the target's shape
    layer_config.num_hidden_layers = ours["num_hidden_layers"]
    layer_config.head_dim = ours["head_dim"]
    d2t = weights.get("d2t")
    t2d = weights.get("t2d")
    torch.manual_seed(0)
    model = DSparkDraftModel.from_training_args(
        layer_config, t2d=t2d, d2t=d2t, draft_vocab_size=ours["draft_vocab_size"], block_size=ours["block_size"],
        target_layer_ids=ours["dflash_config"]["target_layer_ids"], verifier_name_or_path=a.target,
        mask_token_id=ours["dflash_config"]["mask_token_id"], markov_rank=ours["markov_rank"],
        draft_attn_impl="eager",  # flex attention does not run on CPU
    ).float().eval()
    missing, unexpected = model.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                 for k, v in weights.items()}, strict=False)
    ignorable = ("embed_tokens", "verifier_", "d2t", "t2d")
    missing = [k for k in missing if not k.startswith(ignorable)]
    if missing or unexpected:
        raise SystemExit(f"speculators' DSpark model does not take the export: missing {missing}, "
                         f"unexpected {unexpected}")

    captured = {}

    def capture(logits, targets, confidence_logits, *args, **kwargs):
        captured.update(logits=logits[0].detach().clone(), confidence=confidence_logits[0].detach().clone())
        return logits.sum() * 0, {}

    dspark_core.compute_metrics = capture
    inputs = load_file(a.inputs)
    ids, mask = inputs["input_ids"], inputs["loss_mask"]
    T = ids.shape[1]
    anchors = int(mask[0, 1 : T - ours["block_size"]].sum())  # every row speculators may anchor at
    blocks = []
    original = dspark_core.DSparkDraftModel._backbone_forward

    def backbone(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        blocks.append(out[-1].detach().clone())  # anchored_block_indices
        return out

    dspark_core.DSparkDraftModel._backbone_forward = backbone
    with torch.no_grad():
        model(hidden_states=inputs["aux"], input_ids=ids, loss_mask=mask,
              verifier_last_hidden_states=torch.zeros(1, T, layer_config.hidden_size),
              document_ids=torch.zeros_like(ids), max_anchors=anchors)
    save_file({"anchors": blocks[0][:: ours["block_size"]].contiguous(), "logits": captured["logits"].contiguous(),
               "confidence": captured["confidence"].contiguous()}, a.out)


if __name__ == "__main__":
    main()
