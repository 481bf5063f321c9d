"""Offline training: a compact, resumable hidden-state store (dump, ingest; its layout: targets/store.py) and the
target read from it."""

from ..targets.store import Manifest, StoreError, StoreReader
from .target import StoreTarget, store_run

__all__ = ["Manifest", "StoreError", "StoreReader", "StoreTarget", "store_run"]
