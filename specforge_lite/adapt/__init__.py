"""Drafts that learn from the traffic they serve (issue 34): served conversations read as training data
(traffic.py); the draft continues training from them with draft.init_from."""

from .traffic import Traffic, exchange, read_traffic

__all__ = ["Traffic", "exchange", "read_traffic"]
