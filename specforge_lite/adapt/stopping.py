"""SIGTERM and SIGINT to adapt, and the candidate's training process: no orphan outlives adapt.

adapt turns either signal into ``Stopped``, so every ``finally`` runs on the way out (a ``subprocess.run``
kills its child) and the command ends with one line. The candidate trains in a process group of its own, so
that one ``killpg`` reaches all of it (and a signal for it never reaches the shell that started adapt): when
adapt is stopped, the same signal goes to that group, and whatever is left of it after ``GRACE_S`` is killed.
A SIGKILL to adapt cannot be forwarded; for it, the candidate's first process asks the kernel to kill it when
adapt dies (Linux's PR_SET_PDEATHSIG), before it becomes the training job.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import IO, Iterator

SIGNALS = (signal.SIGTERM, signal.SIGINT)
GRACE_S = 10.0  # the candidate's time to stop on the forwarded signal (its training ends after the step under way)
# run as ``python -c DIE_WITH_PARENT PARENT_PID COMMAND...``: SIGKILL when the parent dies (prctl 1 =
# PR_SET_PDEATHSIG), unless it died already, then exec the command (the request survives exec)
DIE_WITH_PARENT = ("import ctypes, os, sys; ctypes.CDLL(None, use_errno=True).prctl(1, 9); "
                   "os.getppid() == int(sys.argv[1]) or sys.exit(1); os.execv(sys.argv[2], sys.argv[2:])")


class Stopped(BaseException):
    """adapt received SIGTERM or SIGINT (a BaseException, as KeyboardInterrupt is: ``except Exception`` lets it by)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum, frame) -> None:
    for s in SIGNALS:  # (once: a second signal must not cut short the stopping of the candidate)
        signal.signal(s, lambda *_: None)
    raise Stopped(signum)


@contextlib.contextmanager
def stopped_by_signals() -> Iterator[None]:
    """Run a command's body with SIGTERM and SIGINT raising ``Stopped``; a stop ends the command with one line
    and the exit status a shell gives a signal's death (128 + its number)."""
    previous = {s: signal.signal(s, _stop) for s in SIGNALS}
    try:
        yield
    except Stopped as e:
        print(f"error: stopped by {e}; the candidate's training, if any, was stopped with it. The next command "
              "repairs the home and starts an unfinished adaptation over", file=sys.stderr)
        sys.exit(128 + e.signum)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class TimedOut(Exception):
    """The command ran past its timeout; its group was stopped as a signal to adapt stops it."""


def run_in_own_group(command: list[str], out: IO, grace: float = GRACE_S, timeout: float | None = None) -> int:
    """Run ``command`` in a process group of its own, writing to ``out``; its exit status. Stopped, or past
    ``timeout`` seconds (``TimedOut``), SIGTERM goes to the whole group first (or the signal that stopped
    adapt); whatever outlives ``grace`` (or the command itself) is killed."""
    if sys.platform.startswith("linux"):
        command = [sys.executable, "-c", DIE_WITH_PARENT, str(os.getpid()), *command]
    proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    stop_with = signal.SIGKILL
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        stop_with = signal.SIGTERM
        raise TimedOut(f"{timeout:g} s") from None
    except Stopped as e:
        stop_with = e.signum
        raise
    finally:
        end_group(proc, stop_with, grace)


def end_group(proc: subprocess.Popen, signum: int, grace: float) -> None:
    """``signum`` to the group ``proc`` leads while it runs, then SIGKILL to whatever is left of the group."""
    if proc.poll() is None:
        _signal_group(proc.pid, signum)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    _signal_group(proc.pid, signal.SIGKILL)  # (the leader, or children it left behind)
    proc.wait()


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # (none of it is left)
        os.killpg(pgid, signum)
