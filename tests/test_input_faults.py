"""Data inputs as users have them, read or named: compressed files (.jsonl.gz, .json.bz2, ...) in a data folder or
given alone, archives named as skipped, and a hub dataset id whose endpoint accepts the connection and never answers
(a bounded wait, then one line naming the id and HF_HUB_OFFLINE)."""

from __future__ import annotations

import bz2
import gzip
import importlib.util
import json
import lzma
import socket
import threading
import time
import zipfile

import pytest

from specforge_lite.config import DataConfig
from specforge_lite.data import DataError, prepare_data
from specforge_lite.data.formats import iter_rows

ZSTANDARD = importlib.util.find_spec("zstandard") is not None


def conversations(start: int, n: int) -> list[dict]:
    """n conversations with distinct openings (numbered from ``start``)."""
    return [{"messages": [{"role": "user", "content": f"Question {i}: what is two plus two?"},
                          {"role": "assistant", "content": "Four."}]} for i in range(start, start + n)]


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny target's tokenizer, read without its weights."""
    from specforge_lite.compose import load_config
    from specforge_lite.targets.build import tokenizer_before_target

    return tokenizer_before_target(load_config(["model=llama3_tiny", "tracker=none"]))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFORGE_LITE_CACHE", str(tmp_path / "cache"))


def questions(source) -> set[str]:
    return {row["messages"][0]["content"].split(":")[0] for _, _, row in iter_rows(source) if isinstance(row, dict)}


def test_compressed_files_in_a_data_folder_are_read_and_archives_named_as_skipped(tmp_path, tokenizer, cache):
    """A folder holding chats.jsonl, more.jsonl.gz, more.json.bz2, more.jsonl.xz (and .jsonl.zst, read where
    zstandard is installed) trains on the rows of every one, as the libraries users have read them; a .zip (and a
    .zst without zstandard) is a counted skip named in the data stats with the way out. Failed: the compressed files
    were passed over without a word (the run trained on chats.jsonl alone)."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "chats.jsonl").write_bytes(jsonl(conversations(0, 10)))
    (folder / "more.jsonl.gz").write_bytes(gzip.compress(jsonl(conversations(10, 10))))
    (folder / "more.json.bz2").write_bytes(bz2.compress(json.dumps(conversations(20, 10)).encode()))
    (folder / "more.jsonl.xz").write_bytes(lzma.compress(jsonl(conversations(30, 10))))
    with zipfile.ZipFile(folder / "archive.zip", "w") as z:
        z.writestr("inside.jsonl", jsonl(conversations(40, 10)))
    if ZSTANDARD:
        import zstandard

        (folder / "more.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl(conversations(50, 10))))
    else:
        (folder / "more.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 16)
    assert questions(folder) == {f"Question {i}" for i in range(60 if ZSTANDARD else 40) if not 40 <= i < 50}
    data = prepare_data(DataConfig(source="path", path=str(folder), heldout_samples=2, max_malformed_fraction=0.5),
                        tokenizer, log=lambda m: None)
    assert len(data.train) + len(data.heldout) == (50 if ZSTANDARD else 40)
    skipped, where = data.stats["skipped"], data.stats["skipped_first_at"]
    zip_reason = next(r for r in skipped if "zip archive" in r)
    assert skipped[zip_reason] == 1 and where[zip_reason] == str(folder / "archive.zip") and "unpack" in zip_reason
    if not ZSTANDARD:
        zst_reason = next(r for r in skipped if "zstandard" in r)
        assert where[zst_reason] == str(folder / "more.jsonl.zst") and "pip install zstandard" in zst_reason


@pytest.mark.parametrize("name, pack", [
    ("chats.jsonl.gz", lambda rows: gzip.compress(jsonl(rows))),
    ("chats.json.xz", lambda rows: lzma.compress(json.dumps(rows).encode())),
])
def test_a_compressed_file_given_alone_prepares_like_the_plain_file(name, pack, tmp_path, tokenizer, cache):
    """data.path=chats.jsonl.gz: the same training set as chats.jsonl. Failed: its compressed bytes were read as
    JSON lines, every row refused as not UTF-8."""
    rows = conversations(0, 12)
    (tmp_path / "chats.jsonl").write_bytes(jsonl(rows))
    (tmp_path / name).write_bytes(pack(rows))

    def prepared(path):
        data = prepare_data(DataConfig(source="path", path=str(path), heldout_samples=2), tokenizer,
                            log=lambda m: None)
        return list(data.train["input_ids"]), data.heldout_prompts, data.stats["skipped"]

    assert prepared(tmp_path / name) == prepared(tmp_path / "chats.jsonl")


def test_a_damaged_compressed_file_is_a_counted_skip_naming_it(tmp_path, tokenizer, cache):
    """A .jsonl.gz cut short keeps the rows read before the cut and counts the file's end as one skip naming it; a
    .zip given alone is refused in one line naming it and the way out."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "chats.jsonl").write_bytes(jsonl(conversations(0, 20)))
    whole = gzip.compress(jsonl(conversations(20, 200)))
    (folder / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    data = prepare_data(DataConfig(source="path", path=str(folder), heldout_samples=2), tokenizer,
                        log=lambda m: None)
    reason = next(r for r in data.stats["skipped"] if "cannot be read" in r)
    assert data.stats["skipped_first_at"][reason] == str(folder / "cut.jsonl.gz")
    assert 20 < len(data.train) + len(data.heldout) < 220
    with zipfile.ZipFile(tmp_path / "chats.zip", "w") as z:
        z.writestr("chats.jsonl", jsonl(conversations(0, 5)))
    with pytest.raises(DataError, match=rf"1 of 1 rows in {tmp_path / 'chats.zip'} are malformed \(1x a zip archive"
                                        r".*unpack it"):
        prepare_data(DataConfig(source="path", path=str(tmp_path / "chats.zip")), tokenizer, log=lambda m: None)


@pytest.fixture
def silent_hub(monkeypatch):
    """An endpoint on 127.0.0.1 that accepts connections (the kernel's backlog) and never answers, as the hub for
    huggingface_hub and datasets, online, with a 1 s HF_HUB_ETAG_TIMEOUT."""
    import datasets
    from huggingface_hub import constants

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 1)
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", endpoint)
    monkeypatch.setattr(datasets.config, "HUB_DATASETS_URL", endpoint + "/datasets/{repo_id}/resolve/{revision}/{path}")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    yield endpoint
    server.close()


def test_a_hub_dataset_whose_endpoint_never_answers_is_refused_within_the_bound(silent_hub):
    """data.path=hf:org/name and a hub that accepts the connection and never answers: refused within
    HF_HUB_ETAG_TIMEOUT seconds (1 here) in one line naming the id, the endpoint and HF_HUB_OFFLINE. Failed: the
    run retried for minutes (about 400 s) without a bound the user set, then gave a line without HF_HUB_OFFLINE."""
    from specforge_lite.data.readers import hub_dataset

    source = f"hf:someorg/never-answers-{time.monotonic_ns()}"  # (hub_dataset keeps what it loaded, by id)
    outcome: list = []

    def load():
        try:
            hub_dataset(source)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001  (the test reads what it was)
            outcome.append(e)

    started = time.monotonic()
    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert outcome, f"still waiting on {silent_hub} after {time.monotonic() - started:.0f} s"
    assert time.monotonic() - started < 10
    [error] = outcome
    said = str(error)
    assert isinstance(error, DataError) and "\n" not in said, repr(error)
    assert said.startswith(f"data.path={source}: the hub ({silent_hub}) did not answer within 1 s "
                           "(HF_HUB_ETAG_TIMEOUT)") and "HF_HUB_OFFLINE=1" in said, said


@pytest.mark.parametrize("damage", ["stats.json", "train arrow"])
def test_a_damaged_prepared_data_cache_is_prepared_again(tmp_path, tokenizer, cache, damage):
    """A cache folder cut short (a full disk, a copy interrupted) ended every later run with "Unterminated string"
    or pyarrow's "Expected to read N metadata bytes", naming neither the folder nor the fix, and was never rebuilt."""
    (tmp_path / "chats.jsonl").write_bytes(jsonl(conversations(0, 12)))
    cfg = DataConfig(source="path", path=str(tmp_path / "chats.jsonl"), heldout_samples=2)
    first = prepare_data(cfg, tokenizer, log=lambda m: None)
    folder = next((tmp_path / "cache" / "prepared").iterdir())
    cut = folder / "stats.json" if damage == "stats.json" else next((folder / "train").glob("*.arrow"))
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    said = []
    again = prepare_data(cfg, tokenizer, log=said.append)
    assert list(again.train["input_ids"]) == list(first.train["input_ids"])
    assert damage != "train arrow" or any(f"the prepared data in {folder} does not read" in m for m in said), said
