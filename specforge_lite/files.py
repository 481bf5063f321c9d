"""Files written whole or not at all, and files checked before anything reads them."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

from safetensors import SafetensorError

# A write that failed (a full disk, a file-size limit, a folder that cannot be written): the OS's own error, or
# safetensors', whose Rust writer reports the same I/O errors as its own type.
WRITE_ERRORS = (OSError, SafetensorError)


def write_failure(e: BaseException) -> str:
    """The reason a write failed, as the OS says it ("No space left on device")."""
    return (e.strerror if isinstance(e, OSError) else None) or str(e)


def fsync(path: Path) -> None:
    """``path`` (a file or a folder) on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_then_rename(path: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` under a temporary name beside ``path``, flushed to disk, then renamed into place: a reader
    sees the old file or the whole new one, never part of it (a kill or a full disk leaves no ``path``)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        fsync(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_folder_then_rename(path: Path, write: Callable[[Path], object]) -> None:
    """``write(folder)`` into a new folder of this writer's own beside ``path``, then renamed to ``path``: another
    process writing the same folder at the same moment never reads or moves these files, and a reader sees the
    whole folder or none. Where ``path`` exists by then (a concurrent writer published first), it is kept."""
    import shutil
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        write(tmp)
        try:
            tmp.rename(path)
        except OSError:
            pass  # a concurrent writer published the same content first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """JSON rows, one per line, written whole or not at all (``write_then_rename``)."""
    write_then_rename(path, lambda tmp: tmp.write_text("".join(json.dumps(row) + "\n" for row in rows)))


def read_json(path: Path, fix: str, keys: tuple[str, ...] = ()) -> dict:
    """The JSON object in ``path`` holding ``keys``. A file missing, cut short, not JSON, not an object, or lacking
    one of ``keys`` is a user's error (errors.USER_ERRORS) naming the file, what is wrong and ``fix`` (how to write
    it again)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing: {fix}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON (damaged or cut short: {e}): {fix}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is damaged (a JSON {type(data).__name__}, not an object): {fix}")
    lacking = [key for key in keys if key not in data]
    if lacking:
        raise ValueError(f"{path} is damaged (it lacks {', '.join(lacking)}): {fix}")
    return data


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file cannot be read, or None: its header must parse and cover the file, which a file
    cut short or overwritten fails (cheaply: the tensors are not read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt"):
            return None
    except (SafetensorError, OSError) as e:
        return f"{path.name} is damaged (cut short or overwritten: {e})"
