"""`auto` precision: bf16 only where the hardware runs it natively (the CPU probe and CUDA support
monkeypatched to each kind of machine), explicit settings winning, the probe cached per machine, and the
run's one-line account of its choice."""

from __future__ import annotations

import pytest
import torch

from specforge_lite.compose import load_config
from specforge_lite.targets import build_target


@pytest.fixture
def fresh_choice(monkeypatch):
    from specforge_lite import device

    device._native_bf16.cache_clear()
    monkeypatch.delenv(device.FORCE_ENV, raising=False)
    yield device
    device._native_bf16.cache_clear()


def probe_result(fp32_s: float, bf16_s: float, flags: list[str]):
    return lambda cache=None: {"capability": "AVX2" if not flags else "AVX512", "bf16_flags": flags, "threads": 2,
                               "fp32_s": fp32_s, "bf16_s": bf16_s}


def test_auto_is_fp32_on_a_cpu_without_native_bf16_and_bf16_where_it_is_native(fresh_choice, monkeypatch):
    from specforge_lite.training.distributed import use_bf16

    d, cpu = fresh_choice, torch.device("cpu")
    monkeypatch.setattr(d, "cpu_probe", probe_result(0.004, 0.23, []))  # AVX2: bf16 emulated, 57x slower
    assert d.resolve_dtype("auto", cpu) == torch.float32 and not use_bf16("auto", cpu)
    assert "57.5x slower" in d.native_bf16(cpu).reason and "AVX2" in d.native_bf16(cpu).reason
    # explicit settings win over the probe
    assert d.resolve_dtype("bfloat16", cpu) == torch.bfloat16 and use_bf16("bf16", cpu)

    d._native_bf16.cache_clear()
    monkeypatch.setattr(d, "cpu_probe", probe_result(0.004, 0.002, ["amx_bf16", "avx512_bf16"]))
    assert d.resolve_dtype("auto", cpu) == torch.bfloat16 and use_bf16("auto", cpu)
    assert d.resolve_dtype("float32", cpu) == torch.float32 and not use_bf16("fp32", cpu)

    d._native_bf16.cache_clear()
    monkeypatch.setattr(d, "cpu_probe", probe_result(0.004, 0.0038, ["avx512f"]))  # no clear win: keep fp32
    assert d.resolve_dtype("auto", cpu) == torch.float32


def test_auto_on_cuda_follows_the_devices_bf16_support(fresh_choice, monkeypatch):
    d = fresh_choice
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert d.resolve_dtype("auto", torch.device("cuda")) == torch.float32
    d._native_bf16.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert d.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_the_probe_is_cached_per_machine(fresh_choice, tmp_path, monkeypatch):
    d = fresh_choice
    calls = []
    monkeypatch.setattr(d, "_time_matmul",
                        lambda dtype: calls.append(dtype) or (0.01 if dtype == torch.float32 else 0.5))
    monkeypatch.setattr(d, "_cpu_share", lambda: 1.0)  # (the CPU to itself: see the test below for the other case)
    first = d.cpu_probe(tmp_path)
    again = d.cpu_probe(tmp_path)
    assert first == again and len(calls) == 2 * d._ROUNDS  # measured once, read back the second time
    monkeypatch.setenv(d.FORCE_ENV, "1")
    assert d.native_bf16("cpu").native and d.FORCE_ENV in d.native_bf16("cpu").reason


def test_a_probe_that_shared_the_cpu_with_another_job_is_used_once_and_never_kept(fresh_choice, tmp_path,
                                                                                     monkeypatch):
    """A real competing job holds every core while the probe runs: the probe says it had about half the CPU,
    and nothing is cached, so that one busy moment does not decide every later run on the machine (a cached
    probe taken under load once made a native-bf16 CPU train every later run in fp32)."""
    import subprocess
    import sys

    d = fresh_choice
    spin = ("import time, torch; torch.set_num_threads(os.cpu_count()); a = torch.randn(512, 1024); "
            "b = torch.randn(1024, 1024); print('busy', flush=True); t = time.time()\n"
            "while time.time() - t < 60: a @ b")
    job = subprocess.Popen([sys.executable, "-c", "import os; " + spin], stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout.readline().strip() == "busy"
        probe = d.cpu_probe(tmp_path)
    finally:
        job.kill()
        job.wait()
    assert probe["cpu_share"] < d._UNCONTENDED, probe
    assert not list(tmp_path.rglob("*.json")), "a probe taken under load was cached"
    monkeypatch.setattr(d, "cpu_probe", lambda cache=None: probe)
    assert "another job was running" in d.native_bf16("cpu").reason


def test_the_run_says_what_auto_chose_and_why(fresh_choice, monkeypatch):
    from specforge_lite.run import describe_precision

    d = fresh_choice
    monkeypatch.setattr(d, "cpu_probe", probe_result(0.004, 0.23, []))
    config = load_config(["model=llama3_tiny", "tracker=none"])
    line = describe_precision(config, build_target(config))
    assert line.startswith("target float32 (auto), generation float32 (auto), draft training fp32 (auto)")
    assert "bf16 is not native on cpu" in line and "slower than fp32" in line


def test_every_benchmark_says_what_auto_precision_runs_on_its_cpu(fresh_choice, monkeypatch):
    """A timing means little without the precision it ran in: the machine line of every bench (and of their
    written reports) says what auto chose there and the probe's evidence."""
    import subprocess
    import sys

    from conftest import ROOT

    d = fresh_choice
    monkeypatch.setattr(d, "cpu_probe", probe_result(0.004, 0.23, []))
    line = d.describe_cpu()
    assert "auto precision fp32 (a bf16 matmul ran 57.5x slower than fp32 in the probe)" in line
    d._native_bf16.cache_clear()
    monkeypatch.setattr(d, "cpu_probe", lambda cache=None: {**probe_result(0.004, 0.002, ["avx512_bf16"])(),
                                                            "cpu_share": 0.5})
    assert "auto precision bf16" in d.describe_cpu() and "another job was running" in d.describe_cpu()
    out = subprocess.run([sys.executable, "-m", "specforge_lite.bench", "train_step", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120).stdout
    assert out.startswith("[machine] CPU capability") and "auto precision " in out.splitlines()[0]
