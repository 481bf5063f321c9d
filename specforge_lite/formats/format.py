"""``ExportFormat``: the interface a server format implements, one class per server: how it writes an export (ids in
its convention, which vocabulary maps, weight names, config layout), what of a draft of its method it cannot write,
and how that server reads a folder (its checks for ``python -m specforge_lite.export --check``). It knows no
method: each format class lives in its method's folder (methods/<name>/export), on this one or on a layout's base
there, and comes with the method's registration (``DraftMethod.export_formats``); export/ gathers them by name.
"""

from __future__ import annotations

import torch

from ..draft.model import DraftSpec


class ExportRefused(ValueError):
    """A draft this format cannot express, with the fix."""


class ExportFormat:
    name = ""  # export.format=<name>
    server = ""  # who reads it, as the check's report names it
    layout = ""  # the config layout: several servers may read one
    serve_method = ""  # vLLM's speculative_config method for a folder of this layout
    # why vLLM's CPU build (scripts/setup_serving.sh) cannot serve this layout, when it cannot: the served check
    # and the ranking then say so and use our own evaluation
    cpu_serving_refusal: str | None = None

    # ---- writing ----------------------------------------------------------------------------------
    def refusals(self, draft) -> list[str]:
        """What this format cannot express of a draft of its method, each with the fix: asked of the trained
        draft's spec at export, and of the method's settings (the same field names) before training (settings.py).
        Whether the format writes the draft's method at all is asked first, by export/ (``export_refusals``)."""
        return []

    def with_vocab_maps(self, spec: DraftSpec) -> bool:
        """Whether d2t/t2d are written (by default only for a reduced draft vocabulary)."""
        return spec.draft_vocab_size != spec.vocab_size

    def write_config(self, spec: DraftSpec, dtype: torch.dtype, verifier: dict, num_speculative_tokens: int,
                     warn) -> dict:
        """The config.json of a draft this format writes (its refusals already asked by export/), with our
        provenance block (formats/layout.py ``PROVENANCE_KEY``) naming the format."""
        raise NotImplementedError(f"the {self.name} format writes no config")

    def weight_name(self, ours: str) -> str:
        return ours

    def our_weight_name(self, theirs: str) -> str:
        return theirs

    # ---- reading (the check) ----------------------------------------------------------------------
    def reads(self, config: dict) -> bool:
        """Whether this server's loader takes a folder with this config.json."""
        raise NotImplementedError(f"the {self.name} format does not say which folders its server reads")

    def layer_config(self, config: dict, report) -> dict | None:
        """The decoder layer's fields (the flat config, or a nested block); None after reporting why not."""
        return config

    def check_shared(self, layer: dict, config: dict, shapes: dict, report) -> None:
        """The rules every server reading this layout shares, asked once per folder of the first format that reads
        it; none here (a layout one server reads is checked whole by its ``check``)."""

    def check(self, config: dict, shapes: dict, report) -> None:
        """This server's own reading rules (beyond the layout's shared ones, ``check_shared``)."""
        raise NotImplementedError(f"the {self.name} format does not check a folder")

    def serve_options(self, config: dict) -> dict:
        """What else vLLM's speculative_config should say for a folder of this config.json, beyond its method."""
        return {}

    def fixed_draft_tokens(self, config: dict) -> int | None:
        """The one k a folder of this layout can be served at (a block draft's), or None: any k."""
        return None

    def read_aux_ids(self, config: dict) -> list[int] | None:
        """The aux ids this server captures when it loads the folder, in OUR convention (targets/capture.py:
        id i = the input of layer i); None when the config names none."""
        raise NotImplementedError(f"the {self.name} format does not say which aux ids its server captures")

    # ---- reading a folder another trainer wrote (a method's ``published_formats``) -----------------------
    published_as = ""  # such a folder's layout, as a one-line refusal names it

    def published_aux_ids(self, config: dict) -> list[int] | None:
        """The aux ids a folder another trainer wrote in this layout was trained on, in OUR convention: the ones the
        server the folder was written for captures (by default this format's reading); None when it names none (the
        servers' defaults). A ValueError (one line, with the fix) when the folder cannot tell."""
        return self.read_aux_ids(config)

    def read_published(self, folder, config: dict, tensors: dict) -> tuple[DraftSpec, dict]:
        """(spec, weights under our names) of a folder another trainer wrote in this layout (``tensors``: its
        safetensors), without our provenance block."""
        raise NotImplementedError(f"the {self.name} format reads no folder another trainer wrote")
