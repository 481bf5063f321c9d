"""Every entry point answers --help with its usage and exit status 0: each ``python -m`` module of the package and
of studies/, each benchmark and study behind its dispatcher, ``specforge-lite`` and each of its tools, train.py.
The modules are found by reading the code (a ``__main__.py``, or ``if __name__ == "__main__":``), so one added
later is held to it too. They run in this process (a fresh interpreter per command would cost seconds each)."""

from __future__ import annotations

import runpy
import subprocess
import sys

import pytest

from conftest import ROOT
from specforge_lite.bench.__main__ import BENCHMARKS
from specforge_lite.cli import TOOLS
from studies.__main__ import STUDIES

MAIN_GUARD = 'if __name__ == "__main__":'


def entry_modules() -> list[str]:
    """The dotted name ``python -m`` takes for each entry point of the package and of studies/ (the peers' drivers
    in studies/peers/ are scripts for the peers' own venv, not modules of ours)."""
    found = []
    for folder in ("specforge_lite", "studies"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "peers" in path.relative_to(ROOT).parts or MAIN_GUARD not in path.read_text():
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            found.append(".".join(parts[:-1] if parts[-1] == "__main__" else parts))
    return found


def help_of(module: str, args: list[str], capsys, monkeypatch) -> tuple[int, str]:
    """(exit status, what it printed) of ``python -m module *args``, run here."""
    monkeypatch.setattr(sys, "argv", [module, *args])
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


COMMANDS = ([(m, ["--help"]) for m in entry_modules()]
            + [("specforge_lite.bench", [name, "--help"]) for name in BENCHMARKS]
            + [("studies", [name, "--help"]) for name in STUDIES]
            + [("specforge_lite.cli", [tool, "--help"]) for tool in TOOLS if tool != "train"])


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # (runpy: a module run again)
@pytest.mark.parametrize("module, args", COMMANDS, ids=[" ".join([m, *a]) for m, a in COMMANDS])
def test_each_entry_point_says_its_usage_and_exits_0(module, args, capsys, monkeypatch):
    code, out = help_of(module, args, capsys, monkeypatch)
    assert code == 0 and "usage" in out.lower(), out[-2000:]


def test_the_entry_points_are_found():
    """The discovery above sees the entry points the docs name (a broken reader would pass every case vacuously)."""
    assert {"specforge_lite.evaluate", "specforge_lite.export", "specforge_lite.offline", "specforge_lite.adapt",
            "specforge_lite.bench", "specforge_lite.job", "specforge_lite.evaluate.served", "specforge_lite.cli",
            "studies"} <= set(entry_modules())


def test_train_and_its_console_spelling_say_their_usage_and_exit_0():
    """train.py --help is Hydra's (the groups and the composed config); specforge-lite train --help is the same."""
    for cmd in ([sys.executable, str(ROOT / "train.py"), "--help"],
                [sys.executable, "-m", "specforge_lite.cli", "train", "--help"]):
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and "python train.py [group=option" in proc.stdout, proc.stderr[-2000:]
