"""Train an EAGLE3 draft with speculators 0.9.0's own recipe on our hidden-state store, and export it in the
speculators format vLLM loads (run in the peer venv: scripts/setup_peers.sh; arguments: _store.py).

Its own code throughout, configured by its own TrainConfig (speculators/train/config/schema.py) at its CLI
defaults with _resolve_derived_defaults applied (eagle3: llama draft layer, norm_before_fc, norm_output,
norm_before_residual, no fc_norm, frozen embedding and lm_head, ttt_steps 3, ttt_step_loss_decay 1.0, kl_div;
optimizer muon at lr 1e-3; linear scheduler with its default warm-up):
- the draft: speculators.train.cli.build_draft_model (create_transformer_layer_config from --target, its
  default sliding-window layer of 2048 included; Eagle3DraftModel.from_training_args: the store's vocabulary
  map, then load_verifier_weights: embedding, lm_head rows and verifier head/norm from --target);
- data as its loader makes it: BaseDataset.__getitem__ (lengths, position_ids), CollateFn with shift_batch
  (its eagle3 preprocess: ids and verifier states shifted one left) packing the step's samples into one row
  with document_ids (its forward takes one packed row; the document mask keeps samples apart);
  verifier_last_hidden_states = the store's PRE-norm final states (its forward applies verifier_norm, the
  target's final norm, then the verifier lm_head rows: its teacher);
- the step of Trainer.train_epoch: model(**batch, **get_trainer_kwargs), zero_grad, backward,
  clip_grad_norm_(1.0), the optimizers' step, the schedulers' step; optimizers and schedulers built by
  Trainer.setup_optimizer itself (build_optimizers: Muon on 2-D matrices + AdamW on the rest);
- export: save_pretrained of a bf16 copy of the state dict, then patch_config_dtype, as its checkpointer does.

CPU adaptations: hidden_states_dtype float32 (a documented option; its default bf16 autocast has no fast CPU
kernels here) and no autocast; attention "sdpa" (draft_attn_impl: its flex attention compiles per shape);
loss implementation "eager" (its "fused" loss is Triton only); a batch is packed to exactly its tokens (its
total_seq_len 8192 would pad it; no truncation either); the seed from --seed (its default is 42); Muon's
Newton-Schulz orthogonalisation (torch.optim.Muon, the same quintic iteration and coefficients) runs in fp32
instead of bf16: a bf16 matmul on an AVX2 CPU is ~57x slower than fp32 (measured here: 26 s per step against
~5 s), which would charge speculators for a GPU's fast path in the equal-time comparison.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _store import Store, load_schedule, log, parse_args, run  # noqa: E402


def newton_schulz_fp32(grad, ns_coefficients, ns_steps: int, eps: float):
    """Muon's orthogonalisation of a 2-D update in fp32: scale to spectral norm <= 1, then ``ns_steps`` quintic
    Newton-Schulz steps X <- a X + (b G + c G^2) X with G = X X^T, on the wide orientation."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def main() -> None:
    import torch.optim._muon as muon

    muon._zeropower_via_newtonschulz = newton_schulz_fp32  # (a CPU adaptation: see the module's docstring)
    a = parse_args(__doc__)
    import json

    import torch

    from speculators.model import SpeculatorModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train import cli as sp_cli
    from speculators.train.checkpointer import convert_float_dtype, patch_config_dtype
    from speculators.train.config.schema import TrainConfig
    from speculators.train.data import BaseDataset, CollateFn
    from speculators.train.trainer import Trainer, TrainerConfig

    store = Store(a.store)
    batches = load_schedule(a.schedule, store)
    t2d, d2t = store.vocab_maps()
    use_maps = store.draft_vocab_size != store.vocab_size  # (speculators keeps no map for a full vocabulary)

    def train_config(total_steps: int) -> TrainConfig:
        return TrainConfig.model_validate({
            "seed": a.seed,
            "verifier": {"verifier_name_or_path": a.target},
            "draft": {"draft_attn_impl": "sdpa", "target_layer_ids": list(store.aux_layer_ids),
                      "draft_vocab_size": store.draft_vocab_size},
            "loss": {"loss_implementation": "eager"},
            "data": {"hidden_states_dtype": "float32", "data_path": str(store.folder)},
            "trainer": {"max_steps": total_steps, "save_path": a.out}})

    class Rows(BaseDataset):
        """One step's samples as its datasets give them (``_get_raw_data``'s dict; __getitem__ adds the rest)."""

        def __init__(self, rows):
            self.rows = rows
            super().__init__(max_len=sum(int(r["input_ids"].numel()) for r in rows),
                             hidden_states_dtype=torch.float32)

        def _compute_approx_lengths(self):
            return [int(r["input_ids"].numel()) for r in self.rows]

        def _get_raw_data(self, index):
            r = self.rows[index]
            T = r["input_ids"].numel()
            return {"hidden_states": r["aux"].reshape(T, -1), "input_ids": r["input_ids"],
                    "verifier_last_hidden_states": r["final"], "loss_mask": r["loss_mask"].bool()}

        def __len__(self):
            return len(self.rows)

    class Session:
        def __init__(self, total_steps: int):
            cfg = train_config(total_steps)
            args = self.args = argparse.Namespace(**cfg.flatten())
            sp_cli.set_seed(args.seed)
            model_class = SpeculatorModel.registry[args.speculator_type]
            self.model = sp_cli.build_draft_model(args, model_class, t2d if use_maps else None,
                                                  d2t if use_maps else None, store.draft_vocab_size)
            m = self.model
            store.check_target(m.embed_tokens.weight, m.verifier_lm_head.weight, m.verifier_norm.weight,
                               who="speculators")
            self.train_kwargs, _ = model_class.get_trainer_kwargs(**vars(args))
            self.config = TrainerConfig(
                num_epochs=args.epochs, save_path=args.save_path, lr=args.lr, resume_from_checkpoint=False,
                train_call_kwargs=self.train_kwargs, optimizer=args.optimizer, weight_decay=args.weight_decay,
                muon_lr=args.muon_lr, muon_momentum=args.muon_momentum, muon_weight_decay=args.muon_weight_decay,
                muon_ns_steps=args.muon_ns_steps, muon_adjust_lr_fn=args.muon_adjust_lr_fn,
                scheduler_type=args.scheduler_type, scheduler_warmup_steps=args.scheduler_warmup_steps,
                scheduler_warmup_ratio=args.scheduler_warmup_ratio, scheduler_total_steps=args.scheduler_total_steps,
                scheduler_num_cosine_cycles=args.scheduler_num_cosine_cycles,
                hidden_states_dtype=getattr(torch, args.hidden_states_dtype), log_freq=args.log_freq,
                max_steps=args.max_steps)
            # Trainer.setup_optimizer on this model, config and a loader of total_steps batches (no resume)
            trainer = SimpleNamespace(model=self.model, config=self.config, resume_from_checkpoint=False,
                                      checkpointer=None, train_loader=range(total_steps))
            Trainer.setup_optimizer(trainer)
            self.trainer = trainer
            self.model.train()

        def step(self, rows: list[dict]) -> dict:
            data = Rows(rows)
            num_aux = len(self.model.target_layer_ids)
            collate = CollateFn(max_len=sum(int(r["input_ids"].numel()) - 1 for r in rows),
                                hidden_size=store.hidden_size, num_target_layers=num_aux, dtype=torch.float32,
                                preprocess=shift_batch)
            batch = collate([data[i] for i in range(len(data))])
            tr = self.trainer
            _draft_tokens, loss, metrics = self.model(**batch, **self.train_kwargs)
            Trainer._optimizers_zero_grad(tr)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            Trainer._optimizers_step(tr)
            lrs = {type(opt).__name__: opt.param_groups[0]["lr"] for opt in tr.optimizers}
            Trainer._schedulers_step(tr)
            k = self.train_kwargs["ttt_steps"]
            return {"loss": loss.detach(), "lr": next(iter(lrs.values())), "lrs": lrs, "grad_norm": grad_norm,
                    "ploss": [metrics[f"loss_{i}_sum"] for i in range(k)],
                    "acc": [float(metrics[f"full_acc_{i}_sum"]) / max(float(metrics[f"full_acc_{i}_total"]), 1.0)
                            for i in range(k)]}

        def export(self, out: str) -> dict:
            # as its checkpointer's save_checkpoint (float_dtype bf16) writes a model folder
            state = convert_float_dtype(self.model.state_dict(), torch.bfloat16)
            self.model.save_pretrained(out, state_dict=state)
            patch_config_dtype(Path(out) / "config.json", torch.bfloat16)
            written = json.loads((Path(out) / "config.json").read_text())
            layer = written.get("transformer_layer_config", {})
            keys = ("architectures", "speculators_model_type", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids",
                    "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "target_hidden_size",
                    "embed_requires_grad", "dtype", "torch_dtype")
            relevant = {k: written[k] for k in keys if k in written}
            relevant["transformer_layer_config"] = {k: layer[k] for k in (
                "architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "head_dim",
                "layer_types", "sliding_window", "use_sliding_window", "rope_parameters") if k in layer}
            relevant["speculators_config"] = written.get("speculators_config")
            ids = written.get("eagle_aux_hidden_state_layer_ids")
            if ids != store.aux_layer_ids:
                raise SystemExit(f"[speculators] its export names aux ids {ids}, the store holds {store.aux_layer_ids}")
            log(f"[speculators] exported to {out}: {relevant}")
            return {"config": relevant, "aux_ids_written": ids, "aux_ids_served": ids, "files": sorted(os.listdir(out))}

    log(f"[speculators] store {store.folder}: {len(store)} samples, aux ids {store.aux_layer_ids}, draft vocabulary "
        f"{store.draft_vocab_size}")
    run("speculators", a, store, batches, Session)


if __name__ == "__main__":
    main()
