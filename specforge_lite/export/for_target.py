"""A draft and the target it drafts for: a draft rebuilt onto its target from saved weights (a checkpoint's, an
export's, a published folder's), and a run's final export written with what the target says of itself."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import Config
from ..draft import Draft, DraftSpec
from ..methods import draft_method
from ..targets import Target
from . import export_draft
from .card import write_model_card
from .published import fit_to_target, weight_mismatch


def target_mismatch(spec: DraftSpec, target: Target, draft: str = "the draft", model: str | None = None) -> None:
    """Refuse a draft made for a target of another width or vocabulary, naming the target setting to change
    (``draft``: what the draft is, as the user named it; ``model``: the configured target's name)."""
    if spec.target_hidden_size != target.hidden_size or spec.vocab_size != target.vocab_size:
        raise ValueError(f"{draft} was trained for a target with hidden size {spec.target_hidden_size} and vocab "
                         f"{spec.vocab_size}; {f'model={model}' if model else 'this target'} has {target.hidden_size} "
                         f"and {target.vocab_size}: set model= to the target it drafts for")


def draft_from_weights(spec: DraftSpec, weights: dict[str, torch.Tensor], target: Target) -> Draft:
    """A draft rebuilt from a checkpoint or export, wired to its target's embedding (a published draft's spec
    completed for the target first: export/published.py)."""
    target_mismatch(spec, target)
    draft = draft_method(spec.method).model(fit_to_target(spec, target.num_layers))
    # an export may carry the target's embedding (export.include_embeddings); the draft reads the target's own
    weights = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()
               if not k.startswith("embed_tokens.")}
    problem = weight_mismatch(draft.state_dict(), weights)
    if problem:
        raise ValueError(f"draft weights do not fit: {problem}")
    draft.load_state_dict(weights)
    draft.to(target.device)
    draft.set_embedding(target.embedding_weight())
    return draft.eval()


def export_final(config: Config, target: Target, weights: dict[str, torch.Tensor], spec: DraftSpec, run_dir: Path,
                 log=print) -> Path:
    """RUN/final in export.format, for the target the run trained against, with its model card."""
    embedding = target.embedding_weight() if config.export.include_embeddings else None
    verifier = {"name_or_path": config.model.path or str(target.location),
                "architectures": list(getattr(target.config, "architectures", None) or [])}
    final = export_draft(weights, spec, config.export.format, Path(run_dir) / "final", config.export.dtype,
                         embedding, warn=lambda m: log(f"[export] warning: {m}"), verifier=verifier,
                         num_speculative_tokens=config.eval.num_draft_tokens)
    write_model_card(final, Path(run_dir))
    return final
