"""The one-line ``error:`` that train.py and every ``python -m specforge_lite.<tool>`` print for a user's mistake.

An error about the user's input or settings (a missing or damaged file, a refused setting, a checkpoint that
cannot be resumed) is raised with the reason and the fix, and printed as that message alone, exiting 1.
Anything else is a defect and keeps its traceback; ``SPECFORGE_LITE_TRACEBACK=1`` shows it for these too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys

TRACEBACK_ENV = "SPECFORGE_LITE_TRACEBACK"


class UserError(RuntimeError):
    """The base of every error the project raises about a user's input, with the reason and the fix (a damaged
    checkpoint, a data file with no usable row, a store that does not fit, a model that cannot be reached)."""


# and the built-in ones raised the same way (a refused setting, a missing or unreadable file)
USER_ERRORS = (UserError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
# a write the machine refused, wherever it happens (a full disk or quota, a file-size limit, a read-only mount)
REFUSED_WRITES = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


@contextlib.contextmanager
def said_in_one_line():
    """Run a command's body; a user's mistake ends it with ``error: <message>`` on stderr and exit status 1."""
    try:
        yield
    except USER_ERRORS as e:
        if os.environ.get(TRACEBACK_ENV) == "1":
            raise
        sys.exit(f"error: {e}\n(set {TRACEBACK_ENV}=1 for the traceback)")
    except OSError as e:
        if e.errno not in REFUSED_WRITES or os.environ.get(TRACEBACK_ENV) == "1":
            raise
        sys.exit(f"error: {e.filename or 'a file'} could not be written ({e.strerror}). Free space or make the folder "
                 "writable, then run the same command (a training run resumes from its newest checkpoint)\n"
                 f"(set {TRACEBACK_ENV}=1 for the traceback)")
