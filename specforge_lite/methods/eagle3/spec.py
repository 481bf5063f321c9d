"""EAGLE3's spec: the shared fields (draft/model.py ``DraftSpec``) and its options, each a flag in the export."""

from __future__ import annotations

from dataclasses import dataclass

from ...draft.model import DraftSpec


def norm_problems(use_aux_norm, norm_before_fc) -> list[str]:
    """The one rule between EAGLE3's two input norms, asked of the settings before a run and of every spec."""
    if norm_before_fc and use_aux_norm:
        return ["draft.norm_before_fc=true with draft.use_aux_norm=true: one norm over the concatenated aux states "
                "or one per aux state (fc_norm), not both (speculators refuses the pair); set one to false"]
    return []


@dataclass
class Eagle3Spec(DraftSpec):
    method: str = "eagle3"
    use_aux_norm: bool = False  # one RMSNorm per aux state before fc (fc_norm)
    norm_before_residual: bool = False  # the first layer's residual after hidden_norm (SGLang: always before)
    norm_before_fc: bool = False  # EAGLE 3.1: one RMSNorm over the concatenated aux states (input_norm)
    norm_output: bool = False  # EAGLE 3.1: the next unroll step is fed the final norm's output
    # P-EAGLE (methods/eagle3/parallel.py): k - 1 mask slots fed mask_token_id and the learned mask_hidden
    parallel_drafting: bool = False

    def __post_init__(self):
        super().__post_init__()
        problems = norm_problems(self.use_aux_norm, self.norm_before_fc)
        if problems:
            raise ValueError(problems[0])
        if self.parallel_drafting:
            self.check_mask_token()
