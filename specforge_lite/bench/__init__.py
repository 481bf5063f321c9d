"""Benchmarks of what the package runs: speed, memory, stores, packing, resumes (python -m specforge_lite.bench)."""

from __future__ import annotations

import importlib
import sys


def say_machine() -> None:
    """The machine a benchmark's figures were measured on, as its first line."""
    import torch

    from ..device import describe_cpu

    gpu = f"; GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    print(f"[machine] {describe_cpu()}{gpu}")


def run_named(prog: str, modules: dict[str, str], doc: str, argv: list[str] | None = None) -> None:
    """``prog NAME [options]``: the machine line, then module ``modules[NAME]``'s ``main(options)`` (a dispatcher's
    --help prints ``doc``; a missing or unknown name exits with the usage)."""
    args = list(sys.argv[1:] if argv is None else argv)
    usage = f"usage: {prog} {{{','.join(modules)}}} [options]  (--help on each)"
    if args and args[0] in ("-h", "--help"):
        print(f"{usage}\n\n{doc}")
        return
    if not args or args[0] not in modules:
        sys.exit(usage)
    say_machine()
    importlib.import_module(modules[args[0]]).main(args[1:])
