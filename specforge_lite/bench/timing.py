"""Seconds and peak memory of a callable, and where one call's time went by kind of kernel (torch's profiler)."""

from __future__ import annotations

import statistics
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_above(fn, device: torch.device) -> tuple[float, int, int]:
    """(seconds, peak bytes allocated above the level before, peak bytes allocated in all) of one call of
    ``fn`` (CPU: no peaks, 0)."""
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    seconds = time.perf_counter() - t0
    if device.type != "cuda":
        return seconds, 0, 0
    peak = torch.cuda.max_memory_allocated(device)
    return seconds, peak - base, peak


def measure(fn, device: torch.device, repeats: int, warm_up: bool = True) -> dict:
    """A warm-up call (compiles, allocator), then ``repeats`` timed calls: median seconds, largest peaks
    (above the inputs and weights already held, and in all)."""
    if warm_up:
        fn()
    runs = [_peak_above(fn, device) for _ in range(repeats)]
    return {"seconds": statistics.median(r[0] for r in runs), "peak_gib": max(r[1] for r in runs) / 2**30,
            "peak_total_gib": max(r[2] for r in runs) / 2**30}


# Kinds of kernels (on CPU: of aten ops), by name: where a step's device time goes, ours beside the peers'.
# (First match wins: a fused attention kernel's name can also hold "gemm" or "triton".)
KERNEL_KINDS = (("attention", ("flash", "fmha", "attention", "sdpa", "flex", "triton_tem")),
                ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::bmm", "aten::addmm")),
                ("compiled", ("triton_",)),
                ("copy", ("memcpy", "memset", "copy", "aten::cat", "aten::to")))


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, words in KERNEL_KINDS if any(w in low for w in words)), "elementwise")


def profile_kernels(fn, device: torch.device) -> dict:
    """One call of ``fn`` (after its warm-up elsewhere) under torch's profiler: its wall milliseconds and each
    kernel's (on CPU: each aten op's own) name, calls and milliseconds, longest first (``kernel_profile``)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        wall = time.perf_counter() - t0
    kernels = [(e.key, e.count, (e.device_time_total if cuda else e.self_cpu_time_total) / 1e3)
               for e in prof.key_averages() if not getattr(e, "is_user_annotation", False)
               and (e.device_type != DeviceType.CPU) == cuda]
    return kernel_profile(wall * 1e3, kernels)


def kernel_profile(wall_ms: float, kernels: list) -> dict:
    """Where one step's time went: wall ms, the device's busy ms (the sum of its kernels: below the wall, the
    device waited for the host's launches or a sync), ms by kind of kernel and the 12 longest kernels."""
    kernels = sorted(kernels, key=lambda k: -k[2])
    by_kind: dict[str, float] = {}
    for name, _, ms in kernels:
        by_kind[kernel_kind(name)] = by_kind.get(kernel_kind(name), 0.0) + ms
    return {"wall_ms": round(wall_ms, 2), "busy_ms": round(sum(k[2] for k in kernels), 2),
            "by_kind_ms": {k: round(v, 2) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top": [[name[:120], calls, round(ms, 3)] for name, calls, ms in kernels[:12]]}
