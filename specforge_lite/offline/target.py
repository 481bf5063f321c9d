"""``StoreTarget``: the target as offline training sees it, read back from a hidden-state store.

It implements the target protocol (targets/protocol.py: ``capture``, the embedding, the draft rows of
the head, the config) from stored tensors: aux states and the pre-norm final state per sample, the
final norm and the draft-vocabulary rows of the lm_head kept once. The same ``Teacher`` as online runs
on its captures (final norm here, draft rows, the family's logit transform), so training from a store
equals training online; the in-vocabulary flags travel with each capture (the full head is not kept).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..config import Config
from ..data.vocab import DraftVocab
from ..methods import draft_vocab_size
from ..run import Run, initial_draft
from ..targets.capture import CONVENTION, resolve_aux_layer_ids
from ..targets.families import get_family
from ..targets.protocol import Captured
from ..training.distributed import DistributedContext
from ..targets.store import StoreError, StoreReader, teacher_fields


def _meta_model(target_config: dict) -> torch.nn.Module:
    """The target's own architecture built on the meta device from the stored config: its modules and
    parameter names, no weights."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**target_config)
    arch = next((getattr(transformers, a, None) for a in (cfg.architectures or []) if hasattr(transformers, a)), None)
    with torch.device("meta"):
        return arch(cfg) if arch is not None else AutoModelForCausalLM.from_config(cfg)


def _final_norm_module(family, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The target's own final-norm class (Gemma's (1+w) norms included), filled with the stored weights: no
    target checkpoint needed."""
    norm = copy.deepcopy(family.final_norm(model)).to_empty(device="cpu")
    norm.load_state_dict(state)
    return norm.float().eval()


# The data settings that decide which rows a store holds and how they are cut and masked: a store-trained run reads
# the stored rows, so each is the store's or refused (read nowhere else in such a run).
STORED_DATA = ("max_length", "max_samples", "heldout_samples", "loss_turns")


class StoreTarget:
    def __init__(self, reader: StoreReader, device: torch.device | str = "cpu", model_dir=None):
        """``model_dir``: a callable giving the target checkpoint's folder, for what a store does not keep
        (a decoder layer to start a draft from); None: no checkpoint is reachable."""
        from transformers import AutoConfig

        self.reader, self.manifest = reader, reader.manifest
        m = self.manifest
        self.family = get_family(m.family)
        self.config = AutoConfig.for_model(**m.target_config)
        self.aux_layer_ids = list(m.aux_layer_ids)
        self.convention = m.convention
        self.location = str(reader.folder)
        self.num_layers, self.hidden_size, self.vocab_size = m.num_layers, m.hidden_size, m.vocab_size
        self.device = torch.device(device)
        self.dtype = torch.float32
        self.image_intake = None
        parts = reader.parts()
        self._embedding = parts["embedding"].to(self.device)
        self._draft_rows = parts["draft_rows"].float().to(self.device)
        self._draft_bias = parts["draft_bias"].float().to(self.device) if "draft_bias" in parts else None
        norm_state = {k.removeprefix("final_norm."): v for k, v in parts.items() if k.startswith("final_norm.")}
        self._model = _meta_model(m.target_config)
        self.final_norm = _final_norm_module(self.family, self._model, norm_state).to(self.device)
        self.vocab = DraftVocab.from_d2t(parts["d2t"], m.vocab_size)
        self._model_dir = model_dir

    @classmethod
    def open(cls, config: Config, device: str = "cpu", continued: tuple | None = None) -> "StoreTarget":
        """The store named by ``data.store``, checked against the run's config and the draft it continues
        (``continued``: draft.init_from's (spec, weights))."""
        if not config.data.store:
            raise StoreError("data.source=offline needs data.store=DIR (made by python -m specforge_lite.offline dump)")
        from ..targets.acquire import resolve_model_dir

        target = cls(StoreReader(config.data.store), device, model_dir=lambda: resolve_model_dir(config.model))
        target.check_against(config, continued)
        return target

    def check_against(self, config: Config, continued: tuple | None = None) -> None:
        m = self.manifest
        problems = [] if m.convention == CONVENTION else [
            f"convention {m.convention!r} (this build reads {CONVENTION!r})"]
        if m.source.get("model") not in (None, config.model.name):
            problems.append(f"made for model={m.source['model']}, this run has model={config.model.name}")
        problems += self._draft_problems(config) if continued is None else self._continued_problems(config, *continued)
        problems += self._data_problems(config)
        if problems:
            raise StoreError(f"the store {self.location} does not fit this run: " + "; ".join(problems))

    def _draft_problems(self, config: Config) -> list[str]:
        """A new draft's aux ids and vocabulary (its settings) against those the store holds."""
        m, problems = self.manifest, []
        wanted = resolve_aux_layer_ids(config.draft.aux_layer_ids, m.num_layers)
        if wanted != list(m.aux_layer_ids):
            problems.append(f"aux ids {m.aux_layer_ids} stored, draft.aux_layer_ids resolves to {wanted} "
                            f"(set draft.aux_layer_ids={list(m.aux_layer_ids)})")
        want_vocab = draft_vocab_size(config.draft, m.vocab_size)
        if want_vocab != m.draft_vocab_size:
            problems.append(f"draft vocabulary of {m.draft_vocab_size} tokens stored, draft.draft_vocab_size gives "
                            f"{want_vocab} (set draft.draft_vocab_size={m.draft_vocab_size} or dump again)")
        return problems

    def _continued_problems(self, config: Config, spec, weights: dict) -> list[str]:
        """draft.init_from's aux ids and vocabulary (the draft's own, whatever the settings say) against the
        store's: a dump with the same draft.init_from writes those."""
        given = f"draft.init_from={config.draft.init_from}"
        fix = f"make the store with {given}"
        ids = resolve_aux_layer_ids(spec.aux_layer_ids, self.num_layers)
        if ids != list(self.aux_layer_ids):
            return [f"{given} reads aux ids {ids} and the store holds {self.aux_layer_ids} ({fix})"]
        vocab = DraftVocab.from_d2t(weights["d2t"], spec.vocab_size).draft_to_target
        if not torch.equal(vocab, self.vocab.draft_to_target):
            return [f"{given} drafts over another vocabulary ({vocab.numel()} tokens) than the store's draft rows "
                    f"({self.vocab.size}) ({fix})"]
        return []

    def _data_problems(self, config: Config) -> list[str]:
        """The data settings a store's rows were made with (``STORED_DATA``) given otherwise."""
        stored = self.manifest.source.get("data") or {}
        differ = [key for key in STORED_DATA if key in stored and stored[key] != getattr(config.data, key)]
        if not differ:
            return []
        said = lambda values: " and ".join(f"data.{key}={values(key)}" for key in differ)  # noqa: E731
        return [f"{said(lambda key: getattr(config.data, key))} given, the store was made with "
                f"{said(lambda key: stored[key])} (its rows are those it was made with: set those, or dump again)"]

    # ---- what the training loop and the draft builder read ------------------------------------
    def embedding_weight(self) -> torch.Tensor:
        return self._embedding

    def head_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not torch.equal(ids.cpu(), self.vocab.draft_to_target):
            raise StoreError("the store keeps the lm_head rows of its own draft vocabulary only")
        return self._draft_rows, self._draft_bias

    def full_head(self) -> None:
        return None  # (the flags it would give were stored: each capture carries in_vocab)

    def llama_layer(self, index: int) -> dict[str, torch.Tensor]:
        """A store keeps no decoder layer: read from the target's checkpoint (the run's model settings)."""
        if self._model_dir is None:
            raise StoreError("this store target has no checkpoint to read a decoder layer from")
        return self.family.llama_layer(self._model, self._model_dir(), index)

    def final_norm_weight(self) -> torch.Tensor:
        return self.final_norm.weight

    def close(self) -> None:
        pass

    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, store_index: torch.Tensor | None = None,
                **inputs: Any) -> Captured:
        """The stored states of the batch's samples (``store_index``), right-padded with zeros like the batch."""
        if position_ids is not None:
            raise StoreError("a hidden-state store is read one sample per row: use data.packing=false")
        if store_index is None:
            raise StoreError("an offline batch carries store_index (the loader adds it for store rows)")
        B, T = input_ids.shape
        n_aux, H, k = len(self.aux_layer_ids), self.hidden_size, self.manifest.topk
        topk = self.manifest.teacher == "topk"
        aux = torch.zeros(B, T, n_aux, H)
        final = torch.zeros(B, T, 1 if topk else H)
        values, ids = torch.zeros(B, T, k), torch.zeros(B, T, k, dtype=torch.long)
        in_vocab = torch.zeros(B, T, dtype=torch.bool)
        for row, i in enumerate(store_index.tolist()):
            s = self.reader.sample(i, ("input_ids", "aux", "in_vocab", *teacher_fields(self.manifest)))
            n = s["input_ids"].numel()
            if not torch.equal(s["input_ids"].long(), input_ids[row, :n].cpu()):
                raise StoreError(f"stored sample {i} holds other tokens than the batch row: the store and the "
                                 "batch order disagree")
            aux[row, :n], in_vocab[row, :n] = s["aux"].float(), s["in_vocab"].bool()
            if topk:
                values[row, :n], ids[row, :n] = s["topk_values"].float(), s["topk_ids"].long()
            else:
                final[row, :n] = s["final"].float()
        final = final.to(self.device)
        return Captured(aux=[aux[:, :, j].to(self.device) for j in range(n_aux)],
                        final_hidden=final if topk else self.final_norm(final), in_vocab=in_vocab.to(self.device),
                        topk=(values.to(self.device), ids.to(self.device)) if topk else None)


def store_run(config: Config, ctx: DistributedContext | None = None, log=print) -> Run:
    """The run that trains from ``data.store`` (data.source=offline): the store's target, its draft
    vocabulary and its samples, in the same Run object as an online run."""
    initial = initial_draft(config, log) if config.draft.init_from else None
    target = StoreTarget.open(config, continued=initial)
    reader = target.reader
    log(f"[store] {target.location}: {len(reader)} samples, {target.manifest.tokens} tokens, aux ids "
        f"{target.aux_layer_ids} ({target.convention}), draft vocabulary {target.vocab.size}")
    stats = {"store": target.location, "samples": len(reader), "tokens": target.manifest.tokens}
    return Run(config, target, target.vocab, reader, stats, ctx=ctx or DistributedContext(), initial=initial)
