"""Benchmarks of what the package runs: speed, memory, stores, packing, resumes (python -m specforge_lite.bench)."""


def say_machine() -> None:
    """The machine a benchmark's figures were measured on, as its first line."""
    import torch

    from ..device import describe_cpu

    gpu = f"; GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    print(f"[machine] {describe_cpu()}{gpu}")
