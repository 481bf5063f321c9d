"""Train an EAGLE3 draft with SpecForge 0.2.0's own recipe on our hidden-state store, and export it with
SpecForge's own export (run in the peer venv: scripts/setup_peers.sh; arguments: _store.py).

Its own code throughout, configured by its own pydantic Config (specforge/config/schema.py) at its defaults:
- draft config: resolve_draft_config (its target-derived generation: the target's hidden, intermediate, heads,
  kv heads, head_dim, rms eps, rope, max positions; one layer), draft_vocab_size set to the store's;
- draft: build_eagle3_draft (AutoDraftModel -> LlamaForCausalLMEagle3; the vocabulary map through its
  load_vocab_mapping; the embedding loaded from --target and frozen; lm_head at its own random init);
- OnlineEagle3Model (TTT length 7) and the EAGLE3 step of its algorithm registry (Eagle3TrainStrategy,
  steps weighted 0.8**k), fed as its offline path feeds it: normalize_offline_sample per sample (its last
  position's loss mask cleared) and DataCollatorWithPadding (right padding, pad 0, attention_mask 0),
  target_repr "hidden_state" (its TargetHead.preprocess shifts ids and teacher one left);
- its compact teacher (training.compact_teacher=true: the post-norm final states and the full target lm_head,
  streamed over the vocabulary; exact, no [B, T, V] logits). The post-norm states are the store's pre-norm
  ones through the target's final norm;
- its optimizer: the factory its trainer uses (BF16Optimizer: AdamW over fp32 masters, wd 0, clip 0.5, cosine
  with warm-up ratio 0.015 of the steps trained), its step as its trainer takes it (loss.backward, step);
- export: its export_to_hf on a training_state.pt written as its checkpoints write it (the strategy's
  checkpoint_state_filter), with the target as embedding source (self-contained folder, bf16 as it exports),
  then apply_legacy_rope_scaling (inside export_to_hf). Its config names no aux layer ids, so vLLM serves
  the inputs of layers (2, L//2, L-3): the driver refuses, before training, a store holding other ids. With a
  full draft vocabulary the identity d2t/t2d it writes are dropped (vLLM 0.32 refuses d2t there).

CPU adaptations: fp32 training (training torch_dtype float32 instead of bfloat16: bf16 has no CPU kernels
here worth using; its BF16Optimizer then keeps fp32 masters of fp32 params, same update); attention backend
"sdpa" (its eager TTT path; its default flex_attention needs a compiled GPU kernel); its Triton LogSoftmaxLoss
replaced by its own reference specforge.core.loss._compute_loss (same value, autograd backward); the target
head built in fp32 and read by this script (TargetHead.from_pretrained wants a sharded checkpoint's
index.json and a separate lm_head.weight, and casts to bf16); no sequence truncation (its data.max_length
2048 is not applied: the rows are the store's); seed from --seed (its default is 42).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _store import Store, StoreError, load_schedule, log, parse_args, run  # noqa: E402


def _locate(folder: str, names: list[str]):
    """(name, file) of the first of ``names`` found in a HF folder's safetensors (index.json or files)."""
    import glob

    from safetensors import safe_open

    index = glob.glob(os.path.join(folder, "*.safetensors.index.json"))
    if index:
        weight_map = json.loads(Path(index[0]).read_text())["weight_map"]
        for name in names:
            if name in weight_map:
                return name, os.path.join(folder, weight_map[name])
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            keys = set(f.keys())
        for name in names:
            if name in keys:
                return name, path
    raise StoreError(f"none of {names} found in the safetensors of {folder}")


def read_tensor(folder: str, names: list[str]):
    """The first of ``names`` found in a HF folder's safetensors: (name, tensor)."""
    from safetensors import safe_open

    name, path = _locate(folder, names)
    with safe_open(path, framework="pt") as f:
        return name, f.get_tensor(name)


def drop_identity_vocab_map(folder: Path) -> str:
    """A full draft vocabulary: SpecForge's export still writes its d2t/t2d buffers, and vLLM 0.32 refuses d2t
    then ("no module or parameter named 'draft_id_to_target_id'"). They are the identity map (d2t all zero,
    t2d all true), so they are dropped from the weights file: nothing served changes."""
    import glob

    from safetensors import safe_open
    from safetensors.torch import save_file

    files = glob.glob(str(folder / "*.safetensors"))
    dropped = []
    for path in files:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if "d2t" in tensors and bool(tensors["d2t"].any()):
            raise SystemExit(f"[specforge] {path}: d2t is not the identity map of a full draft vocabulary")
        if "t2d" in tensors and not bool(tensors["t2d"].all()):
            raise SystemExit(f"[specforge] {path}: t2d is not the identity map of a full draft vocabulary")
        names = [k for k in ("d2t", "t2d") if k in tensors]
        if names:
            save_file({k: v for k, v in tensors.items() if k not in names}, path, metadata=metadata)
            dropped += names
    for index in glob.glob(str(folder / "*.safetensors.index.json")):
        data = json.loads(Path(index).read_text())
        data["weight_map"] = {k: v for k, v in data["weight_map"].items() if k not in ("d2t", "t2d")}
        Path(index).write_text(json.dumps(data, indent=2))
    note = (f"dropped the identity vocabulary map {dropped} from the export (full draft vocabulary: vLLM refuses "
            "d2t there; nothing served changes)")
    log(f"[specforge] {note}")
    return note


def main() -> None:
    a = parse_args(__doc__)
    import torch

    import specforge.algorithms.eagle3.model as eagle3_model
    from specforge.algorithms.eagle3.data import build_offline_collator, normalize_offline_sample
    from specforge.algorithms.eagle3.providers import algorithm_providers
    from specforge.algorithms.model_providers import build_eagle3_draft
    from specforge.config.schema import Config, DataConfig, ModelConfig, TrainingConfig
    from specforge.core import loss as sf_loss
    from specforge.export.to_hf import export_to_hf
    from specforge.modeling.target.target_head import TargetHead
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.assembly import _ConfiguredOptimizerFactory
    from specforge.training.model_loading import resolve_draft_config

    class ReferenceLoss:  # the CPU stand-in for its Triton LogSoftmaxLoss: SpecForge's own reference
        apply = staticmethod(sf_loss._compute_loss)

    eagle3_model.LogSoftmaxLoss = ReferenceLoss

    store = Store(a.store)
    batches = load_schedule(a.schedule, store)
    t2d, d2t = store.vocab_maps()
    work = Path(tempfile.mkdtemp(prefix="specforge_train_"))
    vocab_mapping = work / "vocab_mapping.pt"
    torch.save({"t2d": t2d, "d2t": d2t}, vocab_mapping)  # the file its model.vocab_mapping_path names
    # its compact teacher requires a strictly smaller draft vocabulary; otherwise its full-logits path
    compact = store.draft_vocab_size < store.vocab_size
    providers = algorithm_providers()

    # the target's lm_head (tied: the embedding), for its TargetHead, read once; its model.embedding_key set to
    # the key the checkpoint has (default model.embed_tokens.weight; multimodal targets nest it)
    embedding_key, _ = _locate(a.target, ["model.embed_tokens.weight", "model.language_model.embed_tokens.weight"])
    head_name, head_weight = read_tensor(a.target, ["lm_head.weight", embedding_key])
    if head_weight.shape != (store.vocab_size, store.hidden_size):
        raise StoreError(f"{a.target}: {head_name} has shape {tuple(head_weight.shape)}, the store's target "
                         f"[{store.vocab_size}, {store.hidden_size}]")
    norm = store.final_norm()

    def make_config(total_steps: int) -> Config:
        return Config(model=ModelConfig(target_model_path=a.target, torch_dtype="float32",
                                        vocab_mapping_path=str(vocab_mapping), embedding_key=embedding_key),
                      data=DataConfig(hidden_states_path=str(store.folder)),
                      training=TrainingConfig(attention_backend="sdpa", compact_teacher=compact,
                                              max_steps=total_steps, seed=a.seed))

    L = store.num_layers
    default = [2, L // 2, L - 3]  # what vLLM assumes when a draft config names no ids

    def check_aux_ids(config: dict, what: str):
        """The aux ids ``config`` names, or None; fail when vLLM would then serve other states than the store's."""
        ids = (config.get("eagle_aux_hidden_state_layer_ids")
               or (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
        served = list(ids) if ids is not None else default
        if served != store.aux_layer_ids:
            named = f"names aux ids {ids}" if ids is not None else "names no aux ids"
            raise SystemExit(f"[specforge] {what} {named}"
                             f", so vLLM would feed the draft the inputs of layers {served}, but the store holds "
                             f"{store.aux_layer_ids}: the draft would be served on other hidden states than it was "
                             f"trained on. Dump a store with the default ids {default} to compare SpecForge.")
        return ids

    class Session:
        def __init__(self, total_steps: int):
            cfg = self.cfg = make_config(total_steps)
            self.draft_config = resolve_draft_config(cfg, provider=providers.model.draft_config)
            self.draft_config.draft_vocab_size = store.draft_vocab_size
            self.draft = build_eagle3_draft(cfg, self.draft_config)
            t = cfg.training
            self.model = eagle3_model.OnlineEagle3Model(
                draft_model=self.draft, length=t.ttt_length, attention_backend=t.attention_backend,
                lk_loss_type=t.lk_loss_type, kl_scale=t.kl_scale, kl_decay=t.kl_decay).to(dtype=torch.float32)
            head = TargetHead(a.target)
            with torch.no_grad():
                head.fc.weight.copy_(head_weight)
            head.freeze_weights()
            self.head = head.eval().to(dtype=torch.float32)
            store.check_target(self.draft.embed_tokens.weight, self.head.fc.weight[t2d], who="specforge")
            self.strategy = providers.step.build(self.model, target_head=self.head, **providers.step.options(cfg))
            self.optimizer = _ConfiguredOptimizerFactory(cfg)(self.strategy.trainable_module())
            self.collate = build_offline_collator()
            self.strategy.trainable_module().train()

        def step(self, rows: list[dict]) -> dict:
            features = []
            with torch.no_grad():
                for r in rows:
                    T = r["input_ids"].numel()
                    features.append(normalize_offline_sample(
                        {"aux_hidden_state": r["aux"].reshape(T, -1), "hidden_state": norm(r["final"]),
                         "input_ids": r["input_ids"], "loss_mask": r["loss_mask"]}, max_len=T))
            batch = self.collate(features)
            tensors = {k: batch[k] for k in ("input_ids", "attention_mask", "loss_mask", "hidden_state", "target")}
            if "position_ids" in batch:
                tensors["position_ids"] = batch["position_ids"]
            out = self.strategy.forward_loss(TrainBatch(sample_ids=[str(r["index"]) for r in rows],
                                                        strategy="eagle3", tensors=tensors,
                                                        metadata={"target_repr": "hidden_state"}))
            lr = self.optimizer.get_learning_rate()
            out.loss.backward()
            grad_norm = self.optimizer.step()
            return {"loss": out.loss.detach(), "lr": lr, "grad_norm": grad_norm,
                    "ploss": out.metrics["plosses"], "acc": out.metrics["acces"]}

        def export(self, out: str) -> dict:
            state = work / "training_state.pt"
            torch.save({"draft_state_dict": self.strategy.checkpoint_state_filter(self.model.state_dict()),
                        "strategy": self.strategy.name}, state)
            config_path = work / "draft_config.json"
            self.draft_config.to_json_file(str(config_path))
            export_to_hf(str(state), str(config_path), out, vocab_mapping_path=str(vocab_mapping),
                         embedding_source=a.target, embedding_key=self.cfg.model.embedding_key)
            written = json.loads((Path(out) / "config.json").read_text())
            postprocess = None
            if store.draft_vocab_size == store.vocab_size:
                postprocess = drop_identity_vocab_map(Path(out))
            ids = check_aux_ids(written, "its export")
            keys = ("architectures", "draft_vocab_size", "vocab_size", "eagle_config",
                    "eagle_aux_hidden_state_layer_ids",
                    "norm_output", "norm_before_residual", "norm_before_fc", "fc_norm", "target_hidden_size",
                    "num_hidden_layers", "head_dim", "rope_theta", "rope_scaling", "dtype", "torch_dtype")
            relevant = {k: written[k] for k in keys if k in written}
            log(f"[specforge] exported to {out}: {relevant}; aux ids "
                f"{'written: ' + str(ids) if ids is not None else f'not written (vLLM default {default} = the store)'}")
            return {"config": relevant, "aux_ids_written": ids, "aux_ids_served": ids or default,
                    "files": sorted(os.listdir(out)), "postprocess": postprocess}

    check_aux_ids(resolve_draft_config(make_config(1), provider=providers.model.draft_config).to_dict(),
                  "its generated draft config")
    log(f"[specforge] store {store.folder}: {len(store)} samples, aux ids {store.aux_layer_ids}, draft vocabulary "
        f"{store.draft_vocab_size}; teacher {'compact' if compact else 'full logits'}; target head {head_name}")
    try:
        run("specforge", a, store, batches, Session)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
