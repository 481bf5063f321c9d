"""Evaluation: speculative decoding acceptance and held-out accuracy
(entry point: python -m specforge_lite.evaluate)."""
