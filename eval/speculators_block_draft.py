"""Load a DSpark or DFlash 2 export (vLLM's layouts, export/dspark.py, export/dflash2.py) into speculators' own
model of the method and write what its training forward computes at every anchor block.

Runs in the serving environment (scripts/setup_serving.sh), where speculators 0.9.0 is installed:

    .serving/bin/python eval/speculators_block_draft.py --export DIR --target DIR --inputs IN.safetensors \
        --out OUT.safetensors

IN holds ``aux`` [1, T, n_aux * H] (the target's aux states, concatenated in id order), ``input_ids`` [1, T]
and ``loss_mask`` [1, T]. speculators picks its anchors itself (at random among the rows with loss); OUT holds
them (``anchors``) and the tensors its forward hands to its loss (``compute_metrics``), read there so that every
line of its forward runs as in speculators' own training. DSpark: ``logits`` [anchors * block, draft_vocab]
(Markov-biased) and ``confidence``. DFlash 2: ``unary_logits``, ``candidate_ids`` [anchors * block, top_k]
(the teacher's token put in where the top-k lacks it) and ``candidate_logits`` (the selector's scores).
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

    ours = json.loads(open(f"{a.export}/config.json").read())
    if "DSparkDraftModel" in ours["architectures"]:
        import speculators.models.dspark.core as core

        extra = {"markov_rank": ours["markov_rank"]}
    else:
        import speculators.models.dflash2.core as core

        extra = {key: ours["dflash_config"][key] for key in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                             "selector_top_k")}
    weights = load_file(f"{a.export}/model.safetensors")
    layer_config = AutoConfig.from_pretrained(a.target)  # the draft's layers have the target's shape
    layer_config.num_hidden_layers = ours["num_hidden_layers"]
    layer_config.head_dim = ours["head_dim"]
    d2t = weights.get("d2t")
    t2d = weights.get("t2d")
    torch.manual_seed(0)
    model_class = core.DSparkDraftModel if "markov_rank" in extra else core.DFlash2DraftModel
    model = model_class.from_training_args(
        layer_config, t2d=t2d, d2t=d2t, draft_vocab_size=ours["draft_vocab_size"], block_size=ours["block_size"],
        target_layer_ids=ours["dflash_config"]["target_layer_ids"], verifier_name_or_path=a.target,
        mask_token_id=ours["dflash_config"]["mask_token_id"], draft_attn_impl="eager",  # (no flex attention on CPU)
        **extra).float().eval()
    missing, unexpected = model.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                 for k, v in weights.items()}, strict=False)
    ignorable = ("embed_tokens", "verifier_", "d2t", "t2d")
    missing = [k for k in missing if not k.startswith(ignorable)]
    if missing or unexpected:
        raise SystemExit(f"speculators' {model_class.__name__} does not take the export: missing {missing}, "
                         f"unexpected {unexpected}")

    captured = {}

    def capture(*args, **kwargs):
        if args:  # DSpark's: (logits, targets, confidence_logits, ...)
            captured.update(logits=args[0][0], confidence=args[2][0])
        else:
            captured.update(unary_logits=kwargs["unary_logits"][0], candidate_ids=kwargs["training_candidate_ids"][0],
                            candidate_logits=kwargs["candidate_logits"][0])
        return next(iter(captured.values())).sum() * 0, {}

    core.compute_metrics = capture
    inputs = load_file(a.inputs)
    ids, mask = inputs["input_ids"], inputs["loss_mask"]
    T = ids.shape[1]
    anchors = int(mask[0, 1 : T - ours["block_size"]].sum())  # every row speculators may anchor at
    blocks = []
    original = model_class._backbone_forward

    def backbone(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        blocks.append(out[-1].detach().clone())  # anchored_block_indices
        return out

    model_class._backbone_forward = backbone
    with torch.no_grad():
        model(hidden_states=inputs["aux"], input_ids=ids, loss_mask=mask,
              verifier_last_hidden_states=torch.zeros(1, T, layer_config.hidden_size),
              document_ids=torch.zeros_like(ids), max_anchors=anchors)
    save_file({"anchors": blocks[0][:: ours["block_size"]].contiguous(),
               **{k: v.detach().contiguous() for k, v in captured.items()}}, a.out)


if __name__ == "__main__":
    main()
