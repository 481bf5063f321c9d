"""Where a model the user names is: a local folder, a hub id fetched into the hub's own cache, or a one-line refusal.

A name is a hub id when it reads as ``org/name`` and no local folder of that name exists; anything else that is
not a folder (``/models/typo``, ``./ckpt``, ``~/m``, ``a/b/c``) is a folder that does not exist, named as such. The
hub's own cache and settings apply as they do for ``from_pretrained`` (``HF_HOME``, ``HF_HUB_CACHE``,
``HF_HUB_OFFLINE``, ``HF_TOKEN``): offline, a cached snapshot is used and a missing one is refused naming how to
get it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import UserError

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# Weights in other formats than safetensors (and a checkpoint's original/ copy, Llama's 16 GB consolidated.pth)
# are never read: a snapshot leaves them on the hub.
UNREAD = ["*.bin", "*.pt", "*.pth", "*.gguf", "*.msgpack", "*.h5", "*.onnx", "*.ot", "original/*"]


# What a draft folder holds (its settings and weights): a public draft's snapshot fetches these alone.
DRAFT_FILES = ["*.json", "*.safetensors"]


class HubUnavailableError(UserError):
    pass


def is_hub_id(name: str) -> bool:
    """``org/name`` that is not a local path (an existing folder, or one written as a path)."""
    return bool(_HUB_ID.fullmatch(name)) and not os.path.exists(name.split("/")[0])


def local_or_hub(name: str, setting: str, only: list[str] | None = None) -> Path:
    """The folder ``name`` is, or the snapshot of hub id ``name`` (fetched once into the hub's cache: the files
    matching ``only``, else every file but weights a run never reads); refused in one line naming ``setting``
    when it is neither."""
    folder = Path(name).expanduser()
    if folder.is_dir():
        return folder
    if not is_hub_id(name):
        raise HubUnavailableError(f"{setting}={name}: no such folder; give an existing folder, or a hub id as org/name")
    return snapshot(name, setting, only)


def snapshot(repo_id: str, setting: str, only: list[str] | None = None) -> Path:
    """The local snapshot folder of hub repository ``repo_id``, downloaded unless the cache holds it."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = constants.HF_HUB_OFFLINE
    try:
        return Path(snapshot_download(repo_id, allow_patterns=only, ignore_patterns=None if only else UNREAD))
    except GatedRepoError:
        raise HubUnavailableError(f"{setting}={repo_id} is gated on the hub: accept its licence on its hub page and "
                                  "log in (hf auth login, or HF_TOKEN), then run the same command") from None
    except RepositoryNotFoundError:
        raise HubUnavailableError(f"{setting}={repo_id}: no such hub repository (or it is private: log in with hf auth "
                                  "login or HF_TOKEN); check the id, or give a local folder") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE=1 is set" if offline else "the hub cannot be reached from here"
        raise HubUnavailableError(
            f"{setting}={repo_id} is not in the local hub cache ({constants.HF_HUB_CACHE}) and {why}: fetch it where "
            f"the hub is reachable (hf download {repo_id}), then copy that cache here or give the folder as "
            f"{setting}=/path/to/folder") from None
