"""Peak memory of a callable: CUDA allocator statistics on GPU, the profiler's allocation timeline on CPU."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Callable

import torch


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Bytes allocated above the starting level at the peak while ``fn`` runs (its result is dropped)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = [e for e in json.load(fh)["traceEvents"] if e.get("name") == "[memory]"]
    finally:
        os.remove(path)
    if not events:
        return 0
    events.sort(key=lambda e: e["ts"])
    base = events[0]["args"]["Total Allocated"] - events[0]["args"]["Bytes"]
    return max(e["args"]["Total Allocated"] for e in events) - base
