"""The rows of a data source, each with the place it came from (for the one-line error that names it).

A source is a JSONL/JSON/Parquet/Arrow file, a folder of them, a folder written by ``datasets``' ``save_to_disk``,
or a hub dataset by id (``hf:org/name`` or ``hf:org/name:split``, loaded and cached by ``datasets``). Rows from
Arrow-backed sources come back as the same plain objects as JSON rows. A data file may be compressed
(``chats.jsonl.gz``, ``.bz2``, ``.xz``; ``.zst`` where zstandard is installed), read as it decompresses; an archive
in a data folder (``.zip``, ``.tar``...) is one counted skip naming it, with the way out.
"""

from __future__ import annotations

import bz2
import functools
import gzip
import importlib.util
import io
import json
import lzma
import re
import zlib
from pathlib import Path
from typing import Any, Iterator

from .errors import DataError, MalformedRow

TABLE_SUFFIXES = (".parquet", ".arrow")
SUFFIXES = (".jsonl", ".json", *TABLE_SUFFIXES)
HUB_PREFIX = "hf:"
# compressed data files (chats.jsonl.gz): read through Python's own decompressors, zstandard's where installed
COMPRESSED = (".gz", ".bz2", ".xz", ".zst")
# files of several files: not read, a counted skip naming them (chats.tar.gz is one too)
ARCHIVES = (".zip", ".tar", ".tgz", ".tbz2", ".txz", ".7z", ".rar")
# what a damaged compressed file raises while it is read (gzip's and bz2's OSErrors aside)
_DECOMPRESSION_ERRORS = (EOFError, zlib.error, lzma.LZMAError)
# (a saved Dataset holds state.json, a saved DatasetDict dataset_dict.json; both also hold .json metadata that is
# not data)
_SAVED_MARKERS = ("state.json", "dataset_dict.json")
_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


def is_hub_id(source: Path | str) -> bool:
    return isinstance(source, str) and source.startswith(HUB_PREFIX)


def parse_hub_id(source: str) -> tuple[str, str]:
    """``hf:org/name[:split]`` -> (``org/name``, split; ``train`` when none is named)."""
    name, _, split = source.removeprefix(HUB_PREFIX).partition(":")
    if not _HUB_ID.fullmatch(name) or (split and not re.fullmatch(r"[\w.-]+", split)):
        raise DataError(f"data.path={source}: not a hub dataset id; write hf:org/name or hf:org/name:split "
                        "(e.g. hf:HuggingFaceH4/ultrachat_200k:train_sft)")
    return name, split or "train"


def source_name(source: Path | str) -> str:
    return source if is_hub_id(source) else Path(source).name


def iter_rows(source: Path | str) -> Iterator[tuple[Path, str, Any]]:
    """Yield ``(file, location, parsed_row_or_exception)`` for every row of ``source``; ``file``'s folder is the
    one a row's relative image paths are read from."""
    if is_hub_id(source):
        yield from _dataset_rows(hub_dataset(source), source)
        return
    path = Path(source).expanduser()
    if is_saved_dataset(path):
        yield from _dataset_rows(saved_dataset(path), str(path))
        return
    files = data_files(path)
    if not files:
        raise FileNotFoundError(f"no {', '.join(SUFFIXES)} files under {path}")
    for f in files:
        unread = _unread(f)
        if unread:
            yield f, f"{f}", MalformedRow(unread)
            continue
        try:
            yield from (_table_rows(f) if _data_suffix(f) in TABLE_SUFFIXES else _json_rows(f))
        # a symlink loop or a dangling link, a file that cannot be read or decompressed (cut short, damaged): the
        # rows read so far stand, and one counted skip
        except (OSError, *_DECOMPRESSION_ERRORS, *_zstd_errors()) as e:
            reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
            yield f, f"{f}", MalformedRow(f"the file cannot be read ({reason})")


def data_files(path: Path) -> list[Path]:
    """The data files of a file or folder, in a fixed order: compressed ones, and archives (read as one counted
    skip naming them), with them."""
    if not path.is_dir():
        return [path]
    return sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES or _is_archive(p)
                  or (p.suffix in COMPRESSED and Path(p.stem).suffix in SUFFIXES))


def _data_suffix(f: Path) -> str:
    """The suffix of the data inside ``f``: chats.jsonl.gz holds .jsonl."""
    return Path(f.stem).suffix if f.suffix in COMPRESSED else f.suffix


def _is_archive(f: Path) -> bool:
    return f.suffix in ARCHIVES or (f.suffix in COMPRESSED and Path(f.stem).suffix == ".tar")


def _unread(f: Path) -> str | None:
    """Why ``f`` is not read, with the way out (a counted skip), or None."""
    if _is_archive(f):
        kind = f"a {'tar' if Path(f.stem).suffix == '.tar' else f.suffix.lstrip('.')} archive"
        return (f"{kind} is not read (it may hold several files): unpack it into the data folder (or pass the "
                "folder it unpacks to as data.path)")
    if f.suffix == ".zst" and _zstd_open() is None:
        return ("a zstandard-compressed file and zstandard is not installed: pip install zstandard, or decompress "
                "it (zstd -d)")
    return None


def _zstd_open():
    """zstandard's (or Python 3.14's) open for .zst files, or None when neither is installed."""
    for module in ("compression.zstd", "zstandard"):
        try:
            if importlib.util.find_spec(module.split(".")[0]) is not None:
                return importlib.import_module(module).open
        except (ImportError, AttributeError):
            continue
    return None


def _zstd_errors() -> tuple[type[BaseException], ...]:
    """What a damaged .zst raises, of the zstandard module that opened it (none imported: none opened)."""
    import sys

    return tuple(module.ZstdError for name in ("compression.zstd", "zstandard")
                 if (module := sys.modules.get(name)) is not None and hasattr(module, "ZstdError"))


def _open(f: Path):
    """``f``'s data bytes as a binary file, decompressed as they are read."""
    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(f.suffix)
    if f.suffix == ".zst":  # (zstandard's reader reads, but not by lines)
        return io.BufferedReader(_zstd_open()(f, "rb"))
    return opener(f, "rb") if opener else open(f, "rb")


def source_files(source: Path | str) -> list[Path]:
    """The files whose bytes make the source's rows (what a fingerprint of its content reads)."""
    if is_hub_id(source):
        return _cache_files(hub_dataset(source))
    path = Path(source).expanduser()
    return _cache_files(saved_dataset(path)) if is_saved_dataset(path) else data_files(path)


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in _SAVED_MARKERS)


@functools.lru_cache(maxsize=None)
def saved_dataset(path: Path) -> Any:
    """A folder written by ``save_to_disk``: a Dataset, or a DatasetDict's ``train`` split (or its only one)."""
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except IndexError:  # (datasets' own reader of a saved dataset with no rows)
        raise DataError(f"data.path={path} is a saved dataset that holds no rows: save the conversations again, or "
                        "point data.path at the data") from None
    except (OSError, ValueError) as e:  # (its state.json or an arrow file cut short: json's, pyarrow's errors)
        raise DataError(f"data.path={path} is a saved dataset that does not read ({' '.join(str(e).split())[:200]}): "
                        "save it again (save_to_disk), or copy the folder again") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if "train" not in loaded and len(splits) != 1:
            raise DataError(f"data.path={path} holds the splits {', '.join(splits)} and none is named train: point "
                            f"data.path at one split's folder, e.g. data.path={path / splits[0]}")
        return loaded["train" if "train" in loaded else splits[0]]
    return loaded


@functools.lru_cache(maxsize=None)
def hub_dataset(source: str) -> Any:
    """A hub dataset, downloaded once into ``datasets``' cache (read from there offline, HF_HUB_OFFLINE=1)."""
    import datasets

    name, split = parse_hub_id(source)
    _check_hub_answers(source, name)
    try:
        return datasets.load_dataset(name, split=split)
    except (OSError, ValueError) as e:  # (no network, offline mode, an unknown id or split, a gated dataset)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"data.path={source}: the hub dataset {name!r} (split {split}) could not be loaded ({reason}). "
                        "Where the hub is reachable, load it once (it is cached), or save it there with "
                        "datasets' save_to_disk or to_parquet and pass that folder or file as data.path") from None


def _check_hub_answers(source: str, name: str) -> None:
    """Online, the hub endpoint datasets loads from answers within HF_HUB_ETAG_TIMEOUT seconds (huggingface_hub's
    bound on a metadata request; 10 by default), or the id is refused in one line: one that accepts the connection
    and never answers would hold datasets' retries for minutes. (Any answer, an error status too, lets the load go
    on; so does a connection refused at once, which datasets meets quickly, reading its cache.)"""
    import socket
    import urllib.error
    import urllib.request

    import datasets
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or datasets.config.HF_HUB_OFFLINE:
        return
    endpoint, seconds = datasets.config.HF_ENDPOINT.rstrip("/"), float(constants.HF_HUB_ETAG_TIMEOUT)
    try:
        urllib.request.urlopen(f"{endpoint}/api/datasets/{name}", timeout=seconds).close()
        return
    except urllib.error.HTTPError:  # (an answer)
        return
    except (urllib.error.URLError, OSError) as e:
        if not isinstance(getattr(e, "reason", e), (socket.timeout, TimeoutError)):
            return
    raise DataError(f"data.path={source}: the hub ({endpoint}) did not answer within {seconds:g} s "
                    f"(HF_HUB_ETAG_TIMEOUT) for the dataset {name!r}: where it was loaded before, set HF_HUB_OFFLINE=1 "
                    "to read it from the cache; else load it where the hub answers, or save it there with datasets' "
                    "save_to_disk or to_parquet and pass that folder or file as data.path")


def _cache_files(dataset: Any) -> list[Path]:
    return [Path(f["filename"]) for f in dataset.cache_files]


def _dataset_rows(dataset: Any, name: str) -> Iterator[tuple[Path, str, Any]]:
    # (relative image paths are read from the folder of its Arrow files: a saved folder, or datasets' cache)
    first = _cache_files(dataset)[0]
    for i, row in enumerate(dataset):
        yield first, f"{name}[{i}]", _without_nulls(row)


def _table_rows(f: Path) -> Iterator[tuple[Path, str, Any]]:
    import pyarrow as pa

    try:
        batches = _record_batches(f)
        i = 0
        for batch in batches:
            for row in batch.to_pylist():
                yield f, f"{f}[{i}]", _without_nulls(row)
                i += 1
    except pa.ArrowException as e:  # (a truncated or foreign file: the rows read so far stand)
        kind = "Parquet" if _data_suffix(f) == ".parquet" else "Arrow IPC"
        yield f, f"{f}", MalformedRow(f"the file cannot be read as {kind} ({e}): write it again with pyarrow or "
                                      "datasets")


def _record_batches(f: Path) -> Iterator[Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # (a compressed table is read whole first: Parquet and Arrow read their files by seeking)
    source = (lambda: f) if f.suffix not in COMPRESSED else functools.partial(pa.BufferReader, _read_bytes(f))
    if _data_suffix(f) == ".parquet":
        yield from pq.ParquetFile(source()).iter_batches(batch_size=1024)
        return
    # .arrow: the IPC file format (pyarrow's default), or the stream format datasets writes
    try:
        reader = pa.ipc.open_file(source())
        yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        yield from pa.ipc.open_stream(source())


def _read_bytes(f: Path) -> bytes:
    with _open(f) as fh:
        return fh.read()


def _without_nulls(value: Any) -> Any:
    """Arrow gives a row every field its column's struct type has, null where the row had none (rows' tool schemas
    and arguments differ): those fields are dropped, so the row reads as it was written."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _json_rows(f: Path) -> Iterator[tuple[Path, str, Any]]:
    if _data_suffix(f) == ".json":
        try:
            rows = _parse(_utf8(_read_bytes(f)))
        except UnicodeDecodeError as e:
            before = e.object[: e.start]
            line = before.count(b"\n") + 1
            yield f, f"{f}:{line}", _not_utf8(e, e.start - before.rfind(b"\n"))
            return
        except MalformedRow as e:
            yield f, f"{f}", e
            return
        if not isinstance(rows, list):
            rows = [rows]
        for i, row in enumerate(rows):
            yield f, f"{f}[{i}]", row
        return
    with _open(f) as fh:
        for n, raw in enumerate(fh, 1):
            try:
                line = _utf8(raw) if n == 1 else raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield f, f"{f}:{n}", _not_utf8(e, e.start + 1)
                continue
            if not line.strip():
                continue
            try:
                yield f, f"{f}:{n}", _parse(line)
            except MalformedRow as e:
                yield f, f"{f}:{n}", e


def _parse(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise MalformedRow(f"invalid JSON: {e.msg}") from None
    except RecursionError:
        raise MalformedRow("JSON nested deeper than any conversation (the parser's recursion limit)") from None


def _utf8(data: bytes) -> str:
    """UTF-8 text, a leading byte-order mark (Windows tools write one) dropped."""
    return data.decode("utf-8-sig")


def _not_utf8(e: UnicodeDecodeError, column: int) -> MalformedRow:
    return MalformedRow(f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at column {column}): save the file as "
                        f"UTF-8")
