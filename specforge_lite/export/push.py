"""``python -m specforge_lite.export --push ORG/NAME``: an export folder uploaded to a hub model repository.

In order, each refusal one line saying that nothing was pushed, why, and how to retry: a repository id that is not
ORG/NAME; a folder ``--check`` finds errors in (a server would refuse it, or misread it); the hub switched off
(``HF_HUB_OFFLINE=1``); no login (no ``HF_TOKEN``, no ``hf auth login``: checked before any request); a hub that
cannot be reached (``HF_ENDPOINT``), or that refuses the token or the repository. Then the repository is created
(``exist_ok``: an existing one is updated; ``--private`` for a new one), the model card rewritten so that its serve
commands name the repository (when the run that wrote the folder is known), and the folder uploaded in one commit
(``HfApi.upload_folder``). The hub's own settings apply (``HF_TOKEN``, ``HF_ENDPOINT``, ``HF_HUB_OFFLINE``).
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import UserError
from .card import CARD, write_model_card

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
RETRY = "run the same command"


class PushError(UserError):
    pass


def push_export(repo_id: str, folder: Path, run_dir: Path | None = None, private: bool = False,
                log=print) -> str:
    """Upload the export ``folder`` (of the run in ``run_dir``, if known) to the hub model repository
    ``repo_id``; returns the repository's address."""
    from huggingface_hub import constants

    folder = Path(folder)
    _check_repo_id(repo_id)
    _check_folder(repo_id, folder)
    not_pushed = f"{folder} was not pushed to {repo_id}"
    if constants.HF_HUB_OFFLINE:
        raise PushError(f"{not_pushed}: HF_HUB_OFFLINE=1 is set, so the hub is not contacted; unset it where the "
                        f"hub is reachable and {RETRY}")
    token = _token()
    if token is None:
        raise PushError(f"{not_pushed}: not logged in to the hub; log in with hf auth login (or set HF_TOKEN to a "
                        f"token that can write to {repo_id.split('/')[0]}), then {RETRY}")
    import huggingface_hub

    api = huggingface_hub.HfApi()
    endpoint = getattr(api, "endpoint", None) or constants.ENDPOINT
    with _said(not_pushed, repo_id, endpoint):
        url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    run = run_dir if run_dir is not None else _run_of(folder)
    if run is not None and _ours(folder):
        write_model_card(folder, run, hub_id=repo_id)  # (its serve commands name the repository)
    elif not (folder / CARD).is_file():
        log(f"[push] {folder} has no model card ({CARD}): give --run-dir RUN to write one")
    elif run is None:
        log(f"[push] the run that wrote {folder} is not known: its card is pushed as written (give --run-dir RUN "
            "for one whose serve commands name the repository)")
    with _said(not_pushed, repo_id, endpoint):
        api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model",
                          commit_message=f"Upload the draft with specforge_lite ({folder.name})")
    return str(url or f"{endpoint}/{repo_id}")


def _check_repo_id(repo_id: str) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        ok = bool(_REPO_ID.fullmatch(repo_id)) and validate_repo_id(repo_id) is None
    except HFValidationError:
        ok = False
    if not ok:
        raise PushError(f"--push {repo_id!r}: give the hub repository as ORG/NAME (your user name or an "
                        "organisation, then the model's name: letters, digits, '-', '_', '.')")


def _check_folder(repo_id: str, folder: Path) -> None:
    from .check import check_export

    if not folder.is_dir():
        raise PushError(f"{folder} is not a folder: give --export the export folder to push (or --run-dir RUN for "
                        "RUN/final)")
    report = check_export(folder)
    if not report.ok:
        raise PushError(f"{folder} was not pushed to {repo_id}: --check finds {len(report.errors)} error(s) in it "
                        f"({report.errors[0]}); python -m specforge_lite.export --check {folder} lists them, fix them "
                        f"(export the run again), then {RETRY}")


def _token() -> str | None:
    from huggingface_hub import get_token

    return get_token()


def _ours(folder: Path) -> bool:
    """Whether this project wrote the folder (its config.json's provenance block): the card is written from it."""
    import json

    from ..formats import PROVENANCE_KEY

    return PROVENANCE_KEY in json.loads((folder / "config.json").read_text())


def _run_of(folder: Path) -> Path | None:
    """The run folder an export in RUN/final (or any folder next to the run's config.yaml) came from."""
    parent = folder.resolve().parent
    return parent if (parent / "config.yaml").is_file() else None


class _said:
    """The hub's answer to a request, as one line: a refused token, a repository that cannot be written, a hub that
    cannot be reached."""

    def __init__(self, not_pushed: str, repo_id: str, endpoint: str):
        self.not_pushed, self.repo_id, self.endpoint = not_pushed, repo_id, endpoint

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if error is None or not isinstance(error, Exception) or isinstance(error, UserError):
            return False
        from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

        org = self.repo_id.split("/")[0]
        if isinstance(error, OfflineModeIsEnabled):
            raise PushError(f"{self.not_pushed}: HF_HUB_OFFLINE=1 is set, so the hub is not contacted; unset it "
                            f"where the hub is reachable and {RETRY}") from None
        if isinstance(error, HfHubHTTPError) and error.response is not None:
            status = error.response.status_code
            if status == 401:
                raise PushError(f"{self.not_pushed}: the hub ({self.endpoint}) refused the token (HTTP 401: expired or "
                                f"not a token of this hub); log in again with hf auth login (or set HF_TOKEN), then "
                                f"{RETRY}") from None
            if status == 403:
                raise PushError(f"{self.not_pushed}: the token cannot write to {org} on {self.endpoint} (HTTP 403: a "
                                f"read-only token, or not a member of {org}); log in with a write token (hf auth "
                                f"login, or HF_TOKEN), or push to your own ORG, then {RETRY}") from None
            raise PushError(f"{self.not_pushed}: the hub ({self.endpoint}) answered HTTP {status} "
                            f"({_first_line(error)}); {RETRY} later") from None
        if _unreachable(error):
            raise PushError(f"{self.not_pushed}: the hub at {self.endpoint} cannot be reached ({_first_line(error)}); "
                            f"check the network (and HF_ENDPOINT), then {RETRY}") from None
        return False


def _unreachable(error: BaseException) -> bool:
    """A request that never got an answer (refused, timed out, no route, a broken connection): the hub client
    raises its HTTP library's transport errors (requests' are OSErrors, httpx's are not)."""
    names = {c.__name__ for c in type(error).__mro__}
    return isinstance(error, (OSError, TimeoutError)) or bool(
        names & {"TransportError", "RequestError", "ConnectionError", "ConnectError", "TimeoutException"})


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
