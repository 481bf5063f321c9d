"""Evaluation: speculative decoding acceptance and held-out accuracy (entry point: eval/acceptance.py)."""
