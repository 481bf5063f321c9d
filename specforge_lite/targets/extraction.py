"""The files a serving engine writes a request's hidden states to, read back.

vLLM's ``extract_hidden_states`` method with its hidden-states connector writes one ``{req_id}.safetensors``
per request: ``hidden_states`` [T, n_ids, H] (older builds: [n_ids, T, H], told apart by ``token_ids``'
length) for the prompt's tokens, in the order of the layer ids vLLM was given, and ``token_ids``. While it
writes, it holds an exclusive lock on ``{file}.lock``. speculators' ``hs_{i}.safetensors`` have the same
two tensors (``input_ids`` in older releases). Both an ingest (offline/ingest.py) and a served target
(targets/served.py) read them here.
"""

from __future__ import annotations

import fcntl
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from .store import StoreError


@contextmanager
def _readable(path: Path):
    """Yields False while the file's writer holds its ``.lock``, else True (holding a shared lock)."""
    lock = Path(str(path) + ".lock")
    if not lock.exists():
        yield True
        return
    with open(lock, "rb") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _ids_key(path: Path, keys: set[str]) -> str:
    ids_key = "token_ids" if "token_ids" in keys else "input_ids"
    if "hidden_states" not in keys or ids_key not in keys:
        raise StoreError(f"{path} lacks hidden_states/token_ids (keys: {sorted(keys)})")
    return ids_key


def read_token_ids(path: Path) -> torch.Tensor | None:
    """The file's token ids [T] (its states left unread), or None while its writer holds the lock."""
    with _readable(path) as ok:
        if not ok:
            return None
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(_ids_key(path, set(f.keys()))).long().flatten()


def read_extraction(path: Path) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(token_ids [T], hidden_states [T, n_ids, H]), or None while its writer holds the lock."""
    with _readable(path) as ok:
        if not ok:
            return None
        with safe_open(str(path), framework="pt") as f:
            ids_key = _ids_key(path, set(f.keys()))
            ids, hs = f.get_tensor(ids_key).long().flatten(), f.get_tensor("hidden_states")
    if hs.dim() != 3:
        raise StoreError(f"{path}: hidden_states has shape {tuple(hs.shape)}, expected [T, n_ids, H]")
    if hs.shape[0] != ids.numel() and hs.shape[1] == ids.numel():
        hs = hs.transpose(0, 1)  # the older layers-first layout
    if hs.shape[0] != ids.numel():
        raise StoreError(f"{path}: hidden_states {tuple(hs.shape)} does not match {ids.numel()} token ids")
    return ids, hs
