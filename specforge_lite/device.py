"""Device, dtype and precision choices from the config: the same code runs on CPU and GPU.

``auto`` (``model.dtype``, ``data.generation.dtype`` through the target, ``trainer.precision``) means bf16
where the hardware runs it natively and fp32 elsewhere. Machines differ: a CPU with avx512_bf16 or AMX
runs a bf16 matmul about twice as fast as fp32, an AVX2-only CPU emulates it ~57x slower. So on CPU the
choice is made by a short timed probe of both dtypes (cached per machine, so every run on it decides the
same way and cache keys that include a dtype stay stable); on CUDA by the device's bf16 support. A probe
that did not get the CPU to itself (another job running) is used for that run only, never cached: once
cached, one busy moment would decide every later run on the machine.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}

# Forces the auto choice without a probe: 1 (bf16 is native here) or 0 (it is not).
FORCE_ENV = "SPECFORGE_LITE_NATIVE_BF16"
# bf16 is chosen when its probe matmul takes at most this share of fp32's time: a clear win, not noise.
_BF16_WIN = 0.8
# The probe had the CPU to itself when its process used at least this share of (wall time x torch threads).
_UNCONTENDED = 0.75
_PROBE_VERSION = 2  # 2: interleaved timings and the CPU share (version 1 caches could hold a contended probe)


@dataclass(frozen=True)
class Bf16Support:
    """Whether bf16 runs natively on a device, and the evidence, in words for the run's log."""

    native: bool
    reason: str


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 where ``device`` runs it natively (native_bf16), else fp32."""
    if name == "auto":
        return torch.bfloat16 if native_bf16(device).native else torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r}: use auto, float32, bfloat16 or float16") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def native_bf16(device: torch.device | str) -> Bf16Support:
    """Does ``device`` run bf16 natively? Decided once per process and device type."""
    return _native_bf16(torch.device(device).type)


@functools.lru_cache(maxsize=None)
def _native_bf16(device_type: str) -> Bf16Support:
    forced = os.environ.get(FORCE_ENV)
    if forced in ("0", "1"):
        return Bf16Support(forced == "1", f"{FORCE_ENV}={forced}")
    if device_type == "cuda":
        name = torch.cuda.get_device_name()
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return Bf16Support(True, f"{name} supports bf16")
        return Bf16Support(False, f"{name} has no native bf16")
    if device_type != "cpu":
        return Bf16Support(False, f"no bf16 probe for device type {device_type!r}")
    probe = cpu_probe()
    ratio = probe["bf16_s"] / probe["fp32_s"]
    flags = ", ".join(probe["bf16_flags"]) or "no bf16 instructions"
    where = f"CPU {probe['capability']} ({flags})"
    verdict = "faster" if ratio < 1 else "slower"
    factor = 1 / ratio if ratio < 1 else ratio
    evidence = f"a bf16 matmul ran {factor:.1f}x {verdict} than fp32 in the probe"
    if not uncontended(probe):
        evidence += (f" (the probe had {probe['cpu_share']:.0%} of the CPU: another job was running; this run uses it "
                     "and the next one measures again)")
    return Bf16Support(ratio <= _BF16_WIN, f"{where}: {evidence}")


def describe_cpu() -> str:
    """The CPU a measurement ran on, for every benchmark's output and report: capability, bf16 flags, threads,
    and what ``auto`` precision runs there and why (a bench's timings mean little without it)."""
    bf16 = native_bf16("cpu")
    return (f"CPU capability {torch.backends.cpu.get_cpu_capability()} "
            f"({', '.join(cpu_flags()) or 'no avx512/bf16 flags'}), {torch.get_num_threads()} threads; "
            f"auto precision {'bf16' if bf16.native else 'fp32'} ({bf16.reason.split(': ', 1)[-1]})")


def cpu_flags() -> list[str]:
    """The CPU's bf16-related instruction flags (/proc/cpuinfo on Linux; empty where unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    words = set(text.split())
    return sorted(w for w in words if w in ("avx512_bf16", "amx_bf16", "amx_tile", "bf16", "sve", "avx512f"))


def cpu_probe(cache: Path | None = None) -> dict:
    """Seconds for one [128, 1024] x [1024, 1024] matmul in fp32 and in bf16 (the best of interleaved timings
    after a warm-up), with the CPU's capability and flags and the share of the CPU the probe got; cached per
    machine (CPU model, flags, torch, threads) only when it had the CPU to itself."""
    from .config import cache_dir

    key = _machine_key()
    path = (cache or cache_dir() / "probe") / f"bf16-{key}.json"
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass  # unreadable: measure again
    share = _cpu_share()
    timings = {torch.float32: [], torch.bfloat16: []}
    for _ in range(_ROUNDS):  # interleaved, so a burst of other work slows both dtypes, not one
        for dtype, seen in timings.items():
            seen.append(_time_matmul(dtype))
    result = {"capability": torch.backends.cpu.get_cpu_capability(), "bf16_flags": cpu_flags(),
              "threads": torch.get_num_threads(), "fp32_s": min(timings[torch.float32]),
              "bf16_s": min(timings[torch.bfloat16]), "cpu_share": min(share, _cpu_share())}
    if uncontended(result):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, path)
    return result


_ROUNDS = 3


def uncontended(probe: dict) -> bool:
    return probe.get("cpu_share", 1.0) >= _UNCONTENDED


def _cpu_share(window_s: float = 0.05) -> float:
    """The CPU time this process gets per second of fp32 matmuls on all torch threads: about 1 when it has
    its cores, about 0.5 when another job holds half of them (a window long enough for the CPU-time clock)."""
    a, b = torch.randn(128, 1024), torch.randn(1024, 1024)
    a @ b
    t0, c0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < window_s:
        a @ b
    return (time.process_time() - c0) / ((time.perf_counter() - t0) * torch.get_num_threads())


def _time_matmul(dtype: torch.dtype) -> float:
    a = torch.randn(128, 1024).to(dtype)
    b = torch.randn(1024, 1024).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return best


def _machine_key() -> str:
    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    except OSError:
        pass
    blob = json.dumps([_PROBE_VERSION, platform.machine(), model, cpu_flags(), torch.__version__,
                       torch.get_num_threads(), torch.backends.cpu.get_cpu_capability()])  # (ATEN_CPU_CAPABILITY)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
