"""What every family shares: where the text decoder, its layers, final norm, embedding and head live."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# The parameters of a plain Llama decoder layer, by their names inside the layer: what the EAGLE3 draft's
# layer holds, so a target layer with exactly these (and silu) can start a draft (``llama_layer``).
LLAMA_LAYER_WEIGHTS = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                       "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                       "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


class TargetFamily:
    """How to find the parts of an HF causal LM that capture and the teacher need.

    A family with a quirk subclasses this in its own module; the trainer never branches on family.
    """

    name = "llama"
    # Lean forward of our own in targets/lean/ (None: target.backend=lean runs the HF modules).
    lean_forward: str | None = None
    # Turn format for tokenizers that ship no chat template (base checkpoints), as Jinja.
    fallback_chat_template: str | None = None
    # True when left padding or packed rows would leak state between samples (recurrent layers).
    needs_right_padding = False
    # Whether the target can verify a draft tree in one forward (a 4D tree mask with explicit positions), and
    # take packed rows (several conversations per row, told apart by position ids restarting at 0).
    # Recurrent layers can do neither; families with computed positions (mrope) say so in their module.
    supports_tree_mask = True
    supports_packing = True

    # ---- loading -----------------------------------------------------------------------------
    def load(self, location: str, **kwargs: Any) -> nn.Module:
        """The checkpoint's own architecture class (multimodal wrappers included), else AutoModelForCausalLM; a
        checkpoint whose weight names do not fit it is refused (``weight_names_problem``)."""
        cls, _ = _architecture(location, kwargs.get("trust_remote_code", False))
        model, info = cls.from_pretrained(location, output_loading_info=True, **kwargs)
        problem = weight_names_problem(model, info)
        if problem:
            raise ValueError(f"model folder {location}: {problem}")
        return model

    def load_parts(self, location: str, dtype: torch.dtype, device: torch.device | str = "cpu",
                   trust_remote_code: bool = False) -> nn.Module:
        """The model with only the weights a store keeps read from the checkpoint's safetensors: the
        embedding, the final norm and the lm_head. Every other weight stays on the meta device, never read
        nor allocated (a 70B target's parts are a few GB), so the model cannot run a forward."""
        from .parts import load_named_tensors

        cls, config = _architecture(location, trust_remote_code)
        with torch.device("meta"):
            model = cls._from_config(config, dtype=dtype)
        head = model.get_output_embeddings()
        tied = head.weight is self.embedding(model).weight  # (a tied checkpoint has no lm_head tensor)
        modules = [self.embedding(model), self.final_norm(model), *([] if tied else [head])]
        names = {id(p): n for n, p in model.named_parameters()}
        tensors = load_named_tensors(location, [names[id(p)] for m in modules for p in m.parameters()])
        for module in modules:
            for key, param in list(module.named_parameters()):
                owner, _, leaf = key.rpartition(".")
                value = nn.Parameter(tensors[names[id(param)]].to(device, dtype), requires_grad=False)
                setattr(module.get_submodule(owner) if owner else module, leaf, value)
        if tied:
            head.weight = self.embedding(model).weight
        return model

    # ---- parts -------------------------------------------------------------------------------
    def text_config(self, config: Any) -> Any:
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    def decoder(self, model: nn.Module) -> nn.Module:
        """The module that runs embeddings -> layers -> final norm and returns the post-norm state.

        Multimodal wrappers (Gemma 3/4 conditional generation, Qwen3-VL, Qwen3.5) keep it at
        ``model.model.language_model``; text-only models at ``model.model``.
        """
        inner = model.model
        return getattr(inner, "language_model", inner)

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return self.decoder(model).layers

    def final_norm(self, model: nn.Module) -> nn.Module:
        return self.decoder(model).norm

    def embedding(self, model: nn.Module) -> nn.Embedding:
        """The target's token embedding module; its ``.weight`` is the raw table the servers hand the draft."""
        return self.decoder(model).embed_tokens

    def lm_head_weight(self, model: nn.Module) -> torch.Tensor:
        return model.get_output_embeddings().weight

    def lm_head_bias(self, model: nn.Module) -> torch.Tensor | None:
        return getattr(model.get_output_embeddings(), "bias", None)

    def llama_layer(self, model: nn.Module, location: str, index: int) -> dict[str, torch.Tensor]:
        """Decoder layer ``index`` as a plain Llama layer's weights (``LLAMA_LAYER_WEIGHTS``), to start a draft
        from (draft.init_layers_from_target). Read from the checkpoint at ``location`` where the model holds
        no weights (the meta device of a store's or a parts-only target). A layer of another shape (per-head
        q/k norms, biases, fused projections, four norms, another activation) is refused with what differs:
        its weights would mean something else in the draft's Llama layer."""
        config = self.text_config(model.config)
        layers = self.layers(model)
        if not 0 <= index < len(layers):
            raise ValueError(f"the target has {len(layers)} layers: there is no layer {index} to start the draft from")
        params = dict(layers[index].named_parameters())
        extra, missing = sorted(set(params) - set(LLAMA_LAYER_WEIGHTS)), sorted(set(LLAMA_LAYER_WEIGHTS) - set(params))
        act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
        if extra or missing or act != "silu":
            raise ValueError(f"draft.init_layers_from_target: layer {index} of this {self.name}-family target is not a "
                             f"plain Llama layer (extra {extra or 'none'}, missing {missing or 'none'}, activation "
                             f"{act}), so its weights cannot start the draft's Llama layer; set "
                             "draft.init_layers_from_target=false")
        if not any(p.is_meta for p in params.values()):
            return {name: p.detach() for name, p in params.items()}
        from .parts import load_named_tensors

        full = {id(p): n for n, p in model.named_parameters()}
        names = {name: full[id(p)] for name, p in params.items()}
        tensors = load_named_tensors(location, list(names.values()))
        return {name: tensors[full_name] for name, full_name in names.items()}

    # ---- numerics ----------------------------------------------------------------------------
    def logit_softcap(self, config: Any) -> float | None:
        return None

    def postprocess_logits(self, logits: torch.Tensor, config: Any) -> torch.Tensor:
        """Elementwise transform of raw logits, so it is exact on a vocabulary subset (Gemma softcaps)."""
        cap = self.logit_softcap(config)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def image_intake(self, location: str, config: Any) -> Any:
        """How the model takes images (targets.protocol.ImageIntake), or None for text-only families."""
        return None

    # ---- capture -----------------------------------------------------------------------------
    def run_decoder(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    position_ids: torch.Tensor | None = None, **inputs: Any) -> torch.Tensor:
        """One forward without KV cache or lm_head; returns the post-final-norm state [B, T, H].

        ``position_ids`` marks packed rows (positions restart at 0 where a conversation starts; transformers
        then keeps attention inside each conversation). ``inputs`` carries modality inputs (pixel values)
        for the families that take them.
        """
        if inputs:
            raise ValueError(f"the {self.name} family takes text only; got inputs {sorted(inputs)}")
        return self.decoder(model)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   use_cache=False).last_hidden_state

    def run_cached(self, model: nn.Module, input_ids: torch.Tensor, cache: Any,
                   attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, **inputs: Any) -> torch.Tensor:
        """One incremental forward with a KV cache (decoding); returns the logits of the new positions.
        A 4D ``attention_mask`` with ``position_ids`` verifies a draft tree."""
        if inputs:
            raise ValueError(f"the {self.name} family takes text only; got inputs {sorted(inputs)}")
        return model(input_ids=input_ids, past_key_values=cache, attention_mask=attention_mask,
                     position_ids=position_ids, use_cache=True).logits

    def check_padding(self, attention_mask: torch.Tensor | None) -> None:
        if not self.needs_right_padding or attention_mask is None:
            return
        m = attention_mask.bool()
        # right-padded: once a row has a pad, every later position is a pad too
        if bool((m[:, 1:] & ~m[:, :-1]).any()):
            raise ValueError(f"the {self.name} family has recurrent (linear-attention) layers: a left-padded or "
                             "packed row would carry state from pads or other samples into a sample. "
                             "Batch rows must be right-padded (the data loader does this).")


def _architecture(location: str, trust_remote_code: bool) -> tuple[type, Any]:
    """(the checkpoint's own architecture class, else AutoModelForCausalLM; its config)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(location, trust_remote_code=trust_remote_code)
    return architecture_class(config), config


def architecture_class(config: Any) -> type:
    """The model class a config names (multimodal wrappers included), else AutoModelForCausalLM."""
    import transformers
    from transformers import AutoModelForCausalLM

    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    return AutoModelForCausalLM


def weight_names_problem(model: nn.Module, info: dict) -> str | None:
    """What transformers' loading report says of a checkpoint that would leave the model with random weights, or
    None. transformers loads such a checkpoint with a printed report: parameters it found no weight for keep their
    random start. Refused where most parameters are missing, or where a missing one is there under another prefix
    (a wrapper's: DDP's module., torch.compile's _orig_mod.). A few names a quantizer or an older layout leaves
    unmatched are transformers' to report, as it does."""
    missing, unexpected = sorted(info.get("missing_keys") or []), sorted(info.get("unexpected_keys") or [])
    prefixed = any(u.endswith("." + m) for m in missing[:50] for u in unexpected)
    if not missing or not (prefixed or 2 * len(missing) >= sum(1 for _ in model.parameters())):
        return None
    first = lambda names: ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")  # noqa: E731
    return (f"its weights do not fit the model: {len(missing)} of its parameters are missing ({first(missing)})"
            + (f" and {len(unexpected)} weights there are not the model's ({first(unexpected)})" if unexpected else "")
            + "; save the model with save_pretrained (a training wrapper's prefix such as module. or _orig_mod. "
              "removed), or point model.path at the intact checkpoint: it would run with random weights")
