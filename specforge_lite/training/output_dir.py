"""The run's output folder: refused at start when it cannot be written, and held by one run at a time.

Two runs writing one folder would interleave their checkpoints and metrics, and each would prune the other's
checkpoints as older steps. The holder takes an exclusive ``flock`` on ``<output_dir>/.lock`` and writes who
it is there; the kernel drops the lock when the holder's process ends in any way (kill -9 included), so a
lock file left behind never blocks a later run, while a live holder is named. (On a network filesystem
flock is only as good as the filesystem's own locking.)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Iterator

from ..errors import UserError

LOCK = ".lock"


class OutputDirError(UserError):
    """An output folder that cannot be used: not a folder, not writable, or held by another live run."""


def check_output_dir(path: Path) -> None:
    """Refuse, before anything runs, an output folder that is a file or that cannot be created or written."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputDirError(f"output_dir={path} is a file, not a folder: point output_dir at a folder")
    existing = next(p for p in [path, *path.parents] if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == path else f"cannot be created: {existing} is not writable"
        raise OutputDirError(f"output_dir={path} {what}: point output_dir at a folder you can write")


@contextlib.contextmanager
def hold_output_dir(path: Path, holder: bool = True) -> Iterator[None]:
    """Create the folder and hold its lock while the block runs (the whole run). ``holder``: whether this
    process takes it (rank 0; the other ranks of a distributed run share rank 0's hold)."""
    if not holder:
        yield
        return
    path = Path(path)
    check_output_dir(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        handle = open(path / LOCK, "a+")
    except OSError as e:
        raise OutputDirError(f"output_dir={path} cannot be written ({e.strerror}): point output_dir at a folder "
                             "you can write") from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder_is = handle.read().strip() or "a process that has not said who it is"
            raise OutputDirError(f"output_dir={path} is being written by another run ({holder_is}): wait for it to "
                                 "end, stop it, or give this run another output_dir") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        handle.flush()
        yield
