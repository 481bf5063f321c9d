"""The rows of a data source, each with the place it came from (for the one-line error that names it).

A source is a JSONL/JSON/Parquet/Arrow file, a folder of them, a folder written by ``datasets``' ``save_to_disk``,
or a hub dataset by id (``hf:org/name`` or ``hf:org/name:split``, loaded and cached by ``datasets``). Rows from
Arrow-backed sources come back as the same plain objects as JSON rows.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any, Iterator

from .errors import DataError, MalformedRow

TABLE_SUFFIXES = (".parquet", ".arrow")
SUFFIXES = (".jsonl", ".json", *TABLE_SUFFIXES)
HUB_PREFIX = "hf:"
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
        try:
            yield from (_table_rows(f) if f.suffix in TABLE_SUFFIXES else _json_rows(f))
        except OSError as e:  # a symlink loop or a dangling link, a file that cannot be read: one counted skip
            yield f, f"{f}", MalformedRow(f"the file cannot be read ({e.strerror or e})")


def data_files(path: Path) -> list[Path]:
    """The data files of a file or folder, in a fixed order."""
    return sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES) if path.is_dir() else [path]


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

    loaded = datasets.load_from_disk(str(path))
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
    try:
        return datasets.load_dataset(name, split=split)
    except (OSError, ValueError) as e:  # (no network, offline mode, an unknown id or split, a gated dataset)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"data.path={source}: the hub dataset {name!r} (split {split}) could not be loaded ({reason}). "
                        "Where the hub is reachable, load it once (it is cached), or save it there with "
                        "datasets' save_to_disk or to_parquet and pass that folder or file as data.path") from None


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
        kind = "Parquet" if f.suffix == ".parquet" else "Arrow IPC"
        yield f, f"{f}", MalformedRow(f"the file cannot be read as {kind} ({e}): write it again with pyarrow or "
                                      "datasets")


def _record_batches(f: Path) -> Iterator[Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if f.suffix == ".parquet":
        yield from pq.ParquetFile(f).iter_batches(batch_size=1024)
        return
    # .arrow: the IPC file format (pyarrow's default), or the stream format datasets writes
    try:
        reader = pa.ipc.open_file(f)
        yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        yield from pa.ipc.open_stream(f)


def _without_nulls(value: Any) -> Any:
    """Arrow gives a row every field its column's struct type has, null where the row had none (rows' tool schemas
    and arguments differ): those fields are dropped, so the row reads as it was written."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _json_rows(f: Path) -> Iterator[tuple[Path, str, Any]]:
    if f.suffix == ".json":
        try:
            rows = _parse(_utf8(f.read_bytes()))
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
    with open(f, "rb") as fh:
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
