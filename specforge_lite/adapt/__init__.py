"""Drafts that learn from the traffic they serve: served conversations read as training data
(traffic.py), candidates trained from the current draft (candidate.py), judged against it (judge.py), and
versions with a ``current`` pointer and a decisions log (home.py); ``python -m specforge_lite.adapt``."""

from .home import Home
from .loop import adapt_once, init, watch
from .traffic import Traffic, exchange, read_traffic

__all__ = ["Home", "Traffic", "adapt_once", "exchange", "init", "read_traffic", "watch"]
