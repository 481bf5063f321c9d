"""``target.backend=vllm``: the target runs in a vLLM server, which writes each batch's states for the trainer.

The trainer keeps only the target's parts it reads itself (embedding, final norm, lm_head: read by name from the
checkpoint, as a store's ingest reads them) and asks the server for the rest. vLLM runs the target with its
``extract_hidden_states`` speculative method: every forward collects the states of the layer ids it was given
(our capture convention, targets/capture.py: id i is the input of layer i, id L the pre-norm final state), and a
hidden-states connector writes them per request to a file (targets/extraction.py) whose path the completion's
answer names. Each sequence of a prepared batch is one completion request (its token ids, one token generated);
its file is read as soon as its writer lets go of it and deleted at once, so the folder the server writes to
holds at most one batch's files: a buffer, never a store. At the first capture one more request checks that the
state written for id L is the pre-norm final state the teacher reads (``ServedTarget._check_final_state``).

The server is either started by the run from the serving environment (scripts/setup_serving.sh; the connector is
eval/vllm_hidden_states.py's) or one the user runs, named by ``target.server_url``. A capture that fails in a way
asking again may mend (the server gone, no answer within ``target.server_timeout``, a file short or unreadable)
is never handed to training: the batch is asked again, up to ``target.server_retries`` times, after the server
the run started is restarted (a named one: after it answers again), with one line naming the batch.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ..config import Config
from ..device import dtype_name
from ..errors import UserError
from ..serving import ROOT, VLLMServer, prompt_logprobs, serving_python
from .extraction import read_extraction
from .hf import HFTarget
from .protocol import Captured
from .teacher import LogitHead, logprob_gap

CONNECTOR_SCRIPT = ROOT / "eval" / "vllm_hidden_states.py"  # its connector writes on a CPU as on a GPU
CONNECTOR_CLASS = "CpuHiddenStatesConnector"
MAX_CONCURRENT_REQUESTS = 16  # a batch's sequences in flight at once (the server batches them)
# The check of the state a server writes for id L (the pre-norm final state, the teacher's input): through the final
# norm and lm_head it must give the server's own log-probabilities of a prompt's tokens. Measured on SmolLM2 with
# vLLM's CPU build (fp32): 0.06 nats apart on average for the final state, 3.7 for the input of the last layer.
PROBE_TOKENS = 64  # the longest sequence's first tokens (log-probabilities of [T, vocabulary] cost the server memory)
FINAL_STATE_GAP = 1.0  # nats, on average over the probe's tokens


class CaptureFault(Exception):
    """A capture that failed in a way asking again may mend: the server gone or stalled, a short file."""


class CaptureFailed(UserError):
    """A batch the server could not capture within the retries: nothing of it was trained."""


def server_layer_ids(aux_layer_ids: list[int], num_layers: int) -> list[int]:
    """The ids the server extracts: the run's aux ids and the pre-norm final state (id ``num_layers``)."""
    return sorted({*aux_layer_ids, num_layers})


def extraction_options(layer_ids: list[int], storage: str, connector: str = CONNECTOR_CLASS,
                       module: str = CONNECTOR_SCRIPT.stem) -> list[str]:
    """vLLM's command-line options that make a server write the states of ``layer_ids`` of every request to
    ``storage``: the extract_hidden_states method and the hidden-states connector (``connector`` in ``module``;
    vLLM's own on a GPU is ExampleHiddenStatesConnector, module vllm.distributed...example_hidden_states_connector)."""
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}}
    transfer = {"kv_connector": connector, "kv_role": "kv_producer", "kv_connector_module_path": module,
                "kv_connector_extra_config": {"shared_storage_path": storage}}
    return ["--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(transfer)]


def server_command(model: str, layer_ids: list[int], storage: str = "/dev/shm/vllm-states") -> str:
    """The command a user runs for ``target.server_url`` (shown in errors and the docs)."""
    options = extraction_options(layer_ids, storage)
    quoted = " ".join(f"'{x}'" if x.startswith("{") else x for x in options)
    return f"PYTHONPATH={CONNECTOR_SCRIPT.parent} vllm serve {model} {quoted}"


class ServerCapture:
    """The client: the states [T, n_ids, H] of token sequences, one completion request each, every file read as
    soon as its writer lets go of it and deleted. ``peak_buffer_bytes``: the most bytes of files read and not
    yet deleted at once (the buffer's size on disk or in shared memory)."""

    def __init__(self, base_url: str, model: str, layer_ids: list[int], hidden_size: int, timeout: float):
        self.base_url, self.model, self.layer_ids = base_url.rstrip("/"), model, layer_ids
        self.hidden_size, self.timeout = hidden_size, timeout
        self.peak_buffer_bytes, self._held = 0, 0
        self._sizes: dict[Path, int] = {}  # the files read and not yet deleted
        self._lock = threading.Lock()

    def states(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Every sequence's states, or CaptureFault (none of them then: a batch is captured whole or not at all)."""
        with ThreadPoolExecutor(min(len(sequences), MAX_CONCURRENT_REQUESTS)) as pool:
            futures = [pool.submit(self._one, ids) for ids in sequences]
            errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return [f.result() for f in futures]

    def _one(self, ids: list[int]) -> torch.Tensor:
        return self._states(self._ask(ids), ids)

    def probe(self, ids: list[int]) -> tuple[torch.Tensor, list[float] | None]:
        """The states of ``ids`` and the server's own log-probability of each of their tokens after the first,
        given the tokens before it (None when its answer has none)."""
        answer = self._ask(ids, prompt_logprobs=0)
        return self._states(answer, ids), prompt_logprobs(answer, ids)

    def _states(self, answer: dict, ids: list[int]) -> torch.Tensor:
        path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise UserError(f"the vLLM server at {self.base_url} answers without writing hidden states: start it with "
                            f"the extraction options, {server_command(self.model, self.layer_ids)}")
        try:
            return self._read(Path(path), ids)
        finally:
            self._delete(Path(path))

    def _ask(self, ids: list[int], **options: Any) -> dict:
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, **options}
        request = urllib.request.Request(f"{self.base_url}/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as e:
            said = e.read().decode(errors="replace")[:300]
            if e.code >= 500:
                raise CaptureFault(f"the server answered HTTP {e.code} ({said})") from None
            raise UserError(f"the vLLM server at {self.base_url} refused a capture request: HTTP {e.code} {said}") \
                from None
        except TimeoutError:
            raise CaptureFault(f"the server gave no answer within {self.timeout:g} s (target.server_timeout)") \
                from None
        except (urllib.error.URLError, ConnectionError, OSError, json.JSONDecodeError) as e:
            raise CaptureFault(f"the server went away ({getattr(e, 'reason', e)})") from None
        return answer

    def _read(self, path: Path, ids: list[int]) -> torch.Tensor:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                got = read_extraction(path)
            except Exception as e:  # (a missing file, safetensors' error for a short one, a wrong shape)
                raise CaptureFault(f"{path.name} is missing, short or unreadable ({str(e)[:200]})") from None
            if got is not None:
                break
            if time.monotonic() > deadline:
                raise CaptureFault(f"{path.name} was still being written after {self.timeout:g} s "
                                   "(target.server_timeout)")
            time.sleep(0.005)
        self._hold(path)
        token_ids, states = got
        if token_ids.tolist() != ids:
            raise CaptureFault(f"{path.name} holds the states of other tokens than were asked for")
        if states.shape[1:] != (len(self.layer_ids), self.hidden_size):
            raise UserError(f"the vLLM server at {self.base_url} writes states of shape {tuple(states.shape)}; this "
                            f"run reads [T, {len(self.layer_ids)}, {self.hidden_size}] (layer ids {self.layer_ids}): "
                            f"start it with {server_command(self.model, self.layer_ids)}")
        return states

    def _hold(self, path: Path) -> None:
        size = path.stat().st_size
        with self._lock:
            self._held += size
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, self._held)
            self._sizes[path] = size

    def _delete(self, path: Path) -> None:
        for p in (path, Path(f"{path}.lock")):
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        with self._lock:
            self._held -= self._sizes.pop(path, 0)


def segments(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
             position_ids: torch.Tensor | None) -> list[tuple[int, int, list[int]]]:
    """(row, start, token ids) of every sequence in a right-padded batch: a row's tokens, or with packed rows
    (``position_ids`` restarting at 0) each conversation of a row on its own, as the server sees them apart."""
    found = []
    for row in range(input_ids.shape[0]):
        n = int(attention_mask[row].sum()) if attention_mask is not None else input_ids.shape[1]
        starts = [0] if position_ids is None else (position_ids[row, :n] == 0).nonzero().flatten().tolist()
        for a, b in zip(starts, [*starts[1:], n]):
            if b > a:
                found.append((row, a, input_ids[row, a:b].tolist()))
    return found


class ServedTarget:
    """A target whose capture runs in a vLLM server; every fact about the target and its parts (embedding, final
    norm, lm_head, a decoder layer read by name) is the parts-only target's, ``parts``."""

    backend = "vllm"

    def __init__(self, parts: HFTarget, base_url: str | None, server: VLLMServer | None, storage: Path | None,
                 timeout: float, retries: int, model: str | None = None, log=print):
        """``server``: the one the run started (restarted after a fault; None: the one at ``base_url``, the
        user's); ``storage``: the folder it writes to, the run's own (emptied after a fault, removed at close)."""
        self.parts, self.server, self.storage, self.log = parts, server, storage, log
        self.timeout, self.retries = timeout, retries
        self.layer_ids = server_layer_ids(parts.aux_layer_ids, parts.num_layers)
        self._base_url, self._model = base_url, model
        self.client: ServerCapture | None = None
        self.batches = 0
        self.checked = False  # the server's final state against its own log-probabilities (at the first capture)
        self._norm = parts.family.final_norm(parts.model)
        self._closed = weakref.finalize(self, _release, server, storage)

    def __getattr__(self, name: str) -> Any:
        if name == "parts":  # (before __init__ set it)
            raise AttributeError(name)
        return getattr(self.parts, name)

    @property
    def peak_buffer_bytes(self) -> int:
        return 0 if self.client is None else self.client.peak_buffer_bytes

    # ---- the server ---------------------------------------------------------------------------
    def _connect(self) -> ServerCapture:
        if self.client is None:
            if self.server is not None:
                self._base_url = self.server.start()
                self._model = self.server.model
            self.client = ServerCapture(self._base_url, self._model or served_model(self._base_url, self.timeout),
                                        self.layer_ids, self.parts.hidden_size, self.timeout)
        return self.client

    def _recover(self) -> str | None:
        """Make the server answer again after a fault: what was done, for the batch's line; None when a named
        server did not answer again within the timeout."""
        if self.server is not None:
            self.server.stop(grace=10)
            _empty(self.storage)
            self._base_url = self.server.start()  # (on another free port)
            self.client.base_url = self._base_url.rstrip("/")
            return "restarted the vLLM server"
        self.checked = False  # (a named server may come back with other options)
        deadline = time.monotonic() + self.timeout
        while not _answers(self._base_url):
            if time.monotonic() > deadline:
                return None
            time.sleep(min(1.0, self.timeout / 4))
        return f"the server at {self._base_url} answers again"

    def close(self) -> None:
        """Stop the server the run started and remove its folder."""
        self._closed()

    # ---- training capture -------------------------------------------------------------------
    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **inputs: Any) -> Captured:
        """The aux states and the post-norm final state of a right-padded batch, from the server (zeros at the
        pads, which no loss reads)."""
        if inputs:
            raise ValueError(f"target.backend=vllm sends the server token ids only, and this batch has "
                             f"{sorted(inputs)}: train a vision target with target.backend=hf")
        parts = self.parts
        found = segments(input_ids.cpu(), None if attention_mask is None else attention_mask.cpu(),
                         None if position_ids is None else position_ids.cpu())
        states = self._captured([ids for _, _, ids in found])
        B, T = input_ids.shape
        every = torch.zeros(B, T, len(self.layer_ids), parts.hidden_size, dtype=parts.dtype)
        for (row, start, ids), s in zip(found, states):
            every[row, start : start + len(ids)] = s.to(parts.dtype)
        every = every.to(parts.device)
        final = self._norm(every[:, :, self.layer_ids.index(parts.num_layers)])
        return Captured(aux=[every[:, :, self.layer_ids.index(i)] for i in parts.aux_layer_ids], final_hidden=final)

    def _captured(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        self.batches += 1
        what = f"batch {self.batches} ({len(sequences)} sequences, {sum(map(len, sequences))} tokens)"
        again = "Run the same command again (training resumes from its last checkpoint)"
        for attempt in range(1, self.retries + 2):
            try:
                client = self._connect()
                if not self.checked:
                    self._check_final_state(client, max(sequences, key=len)[:PROBE_TOKENS])
                return client.states(sequences)
            except CaptureFault as fault:
                if attempt > self.retries:
                    raise CaptureFailed(f"{what}: {fault}, after {attempt} tries (target.server_retries="
                                        f"{self.retries}); nothing of it was trained. {again}") from None
                done = self._recover()
                if done is None:
                    raise CaptureFailed(f"{what}: {fault}, and the vLLM server at {self._base_url} did not answer "
                                        f"again within {self.timeout:g} s (target.server_timeout); nothing of it was "
                                        f"trained. Start the server, then: {again}") from None
                self.log(f"[target] {what}: {fault}; {done}, asking again (try {attempt + 1} of "
                         f"{self.retries + 1}; nothing of the failed try is trained)")
        raise AssertionError("unreachable")

    def _check_final_state(self, client: ServerCapture, ids: list[int]) -> None:
        """Refuse a server whose state for id L is not the target's pre-norm final state (started with other layer
        ids of the same count: the shapes agree, the teacher would read another layer): through the final norm and
        lm_head it must give the server's own log-probabilities of the probe's tokens. The aux ids themselves
        cannot be read back from a server; what it was started with decides them."""
        if len(ids) < 2:  # (no token to score: the next batch's longest sequence is asked)
            return
        parts, final = self.parts, self.layer_ids.index(self.parts.num_layers)
        states, theirs = client.probe(ids)
        self.checked = True
        where = f"the vLLM server at {client.base_url}"
        if theirs is None:
            self.log(f"[target] {where} answers without prompt log-probabilities: its state for id {parts.num_layers} "
                     "(the pre-norm final state) is not checked against its own output")
            return
        head = LogitHead(*parts.full_head(), parts.family, parts.config)
        gap = logprob_gap(head, self._norm(states[:, final].to(parts.device, parts.dtype)), ids, theirs)
        if gap > FINAL_STATE_GAP:
            raise UserError(f"{where} does not write the target's pre-norm final state as its state for id "
                            f"{parts.num_layers}: through the final norm and lm_head it gives log-probabilities "
                            f"{gap:.2f} nats from the server's own (at most {FINAL_STATE_GAP:g}), so it was started "
                            f"with other layer ids than this run reads ({self.layer_ids}): start it with "
                            f"{server_command(client.model, self.layer_ids)}")
        self.log(f"[target] {where}: its state for id {parts.num_layers} gives its own log-probabilities of "
                 f"{len(theirs)} prompt tokens within {gap:.3f} nats on average (the pre-norm final state)")

    def forward_cached(self, *args, **kwargs):
        raise ValueError("target.backend=vllm keeps no decoder in the trainer: decoding (evaluation) runs the target "
                         "in-process, python -m specforge_lite.evaluate --run-dir RUN")


def served_model(base_url: str, timeout: float) -> str:
    """The model a named server serves (the first /v1/models lists)."""
    try:
        with urllib.request.urlopen(f"{base_url.rstrip('/')}/models", timeout=min(timeout, 30)) as response:
            return json.loads(response.read())["data"][0]["id"]
    except (urllib.error.URLError, OSError, KeyError, IndexError, json.JSONDecodeError) as e:
        raise UserError(f"target.server_url={base_url} does not answer as a vLLM server ({getattr(e, 'reason', e)}): "
                        "start it (docs/distributed.md, a target served by vLLM) or fix the URL") from None


def _answers(base_url: str) -> bool:
    root = base_url.rstrip("/").removesuffix("/v1")
    return VLLMServer._healthy(root)


def _empty(folder: Path | None) -> None:
    if folder is not None and folder.is_dir():
        for p in folder.iterdir():
            p.unlink(missing_ok=True)


def _release(server: VLLMServer | None, storage: Path | None) -> None:
    if server is not None:
        server.stop(grace=30)
    if storage is not None:
        shutil.rmtree(storage, ignore_errors=True)


def buffer_folder(given: str | None) -> Path:
    """A fresh folder for the server the run starts to write to: under ``given`` (target.buffer_dir), else in
    shared memory where there is some (/dev/shm), else in the temporary folder."""
    shm = Path("/dev/shm")
    parent = given or (str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None)
    if parent is not None:
        Path(parent).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="specforge-lite-states-", dir=parent))


def build_served_target(config: Config, parts: HFTarget, ctx=None, log=print) -> ServedTarget:
    """The served target of ``config.target`` over the run's parts-only target: the server at target.server_url,
    else one started (at the first capture) from the serving environment."""
    t = config.target
    if t.server_url:
        served_model(t.server_url, t.server_timeout)  # (one that does not answer is said before the data is read)
        log(f"[target] capturing through the vLLM server at {t.server_url}, started with layer ids "
            f"{server_layer_ids(parts.aux_layer_ids, parts.num_layers)} (the aux ids, then the pre-norm final state)")
        return ServedTarget(parts, t.server_url, None, None, t.server_timeout, t.server_retries, log=log)
    if ctx is not None and ctx.enabled:
        raise ValueError("target.backend=vllm in a distributed run: start a vLLM server and name it in "
                         "target.server_url, which every rank asks (docs/distributed.md, a target served by vLLM)")
    if not CONNECTOR_SCRIPT.is_file():
        raise FileNotFoundError(f"target.backend=vllm starts vLLM with the connector of {CONNECTOR_SCRIPT}, which "
                                "this installation lacks: run from a checkout, or start the server yourself and "
                                "name it in target.server_url")
    storage = buffer_folder(t.buffer_dir)
    layer_ids = server_layer_ids(parts.aux_layer_ids, parts.num_layers)
    path = os.pathsep.join(x for x in [str(CONNECTOR_SCRIPT.parent), os.environ.get("PYTHONPATH", "")] if x)
    server = VLLMServer(str(parts.location), max_model_len=config.data.max_length + 8, dtype=dtype_name(parts.dtype),
                        log=log, extra_args=[*extraction_options(layer_ids, str(storage)), *t.server_args],
                        env={"PYTHONPATH": path}, needed_by="target.backend=vllm without target.server_url",
                        instead="start a vLLM server yourself and name it in target.server_url")
    log(f"[target] capturing through a vLLM server the run starts (layer ids {layer_ids}, states written to "
        f"{storage})")
    return ServedTarget(parts, None, server, storage, t.server_timeout, t.server_retries, log=log)


def served_target_problems(config: Config) -> list[str]:
    """What keeps target.backend=vllm and its settings from doing their job, each in one line with the fix
    (settings.py says them with every other problem, before anything is built)."""
    t, problems = config.target, []
    own = {"target.server_url": t.server_url, "target.server_args": list(t.server_args),
           "target.buffer_dir": t.buffer_dir}
    if t.backend != "vllm":
        return [f"{key}={value} is read by target.backend=vllm only: set target.backend=vllm, or drop it"
                for key, value in own.items() if value]
    if t.shard != "none":
        problems.append(f"target.backend=vllm with target.shard={t.shard}: the server holds the target (its own "
                        "tensor parallelism: target.server_args=[--tensor-parallel-size,N]); set target.shard=none")
    if config.data.source == "offline":
        problems.append("target.backend=vllm with data.source=offline: a store's states are read from the store, "
                        "no target runs; drop target.backend=vllm")
    if config.data.regenerate and config.data.generation.engine != "openai":
        problems.append(f"target.backend=vllm with data.regenerate=true and data.generation.engine="
                        f"{config.data.generation.engine}: the trainer holds no decoder to write the target's answers "
                        "with; set data.generation.engine=openai (vLLM writes them too: started from the serving "
                        "environment, or at data.generation.server_url), or data.regenerate=false")
    if t.server_url:
        if not t.server_url.startswith(("http://", "https://")):
            problems.append(f"target.server_url={t.server_url}: give the server's URL, http://HOST:PORT/v1")
        if t.server_args or t.buffer_dir:
            problems.append("target.server_args and target.buffer_dir are for the server the run starts, and "
                            "target.server_url names one already running: drop them, or drop target.server_url")
    elif serving_python() is None:
        problems.append("target.backend=vllm without target.server_url starts vLLM from the serving environment, "
                        "and there is none: build it with bash scripts/setup_serving.sh, or name a running server "
                        "in target.server_url")
    return problems
