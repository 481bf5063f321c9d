"""A server the run starts never outlives the run: when the process that started it dies without stopping it
(SIGKILL, the kernel's OOM killer), the server and the engine processes it started are ended within seconds,
never left holding a GPU. vLLM's stand-in here is a small HTTP server that answers /health and starts an engine
process of its own, as vLLM's API server does; tests/test_serving.py runs vLLM itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import ROOT

STAND_IN = '''
import http.server, subprocess, sys
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # (vLLM's engine core)
port = int(sys.argv[sys.argv.index("--port") + 1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

print("engine", engine.pid, flush=True)
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
'''

RUN = '''
import sys, time
from pathlib import Path
from specforge_lite.serving import VLLMServer
server = VLLMServer("stand-in", 64, python=Path(sys.executable), env={"PYTHONPATH": sys.argv[1]}, log=lambda m: None)
server.start()
print(server.proc.pid, server.watchdog.pid, flush=True)
time.sleep(600)
'''


def _alive(pid: int) -> bool:
    """Running, not a zombie left for a parent that is gone (this sandbox's pid 1 may not reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _group(pgid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry.name))
    return found


@pytest.fixture
def stand_in(tmp_path) -> Path:
    """A folder holding the stand-in as ``vllm.entrypoints.openai.api_server`` (VLLMServer's PYTHONPATH)."""
    package = tmp_path / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for folder in (tmp_path / "vllm", tmp_path / "vllm" / "entrypoints", package):
        (folder / "__init__.py").write_text("")
    (package / "api_server.py").write_text(textwrap.dedent(STAND_IN))
    return tmp_path


def test_a_server_and_its_engine_end_when_the_run_that_started_them_is_killed(stand_in):
    run = subprocess.Popen([sys.executable, "-c", RUN, str(stand_in)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    server, watchdog = map(int, run.stdout.readline().split())
    deadline = time.monotonic() + 10
    while len(_group(server)) < 2 and time.monotonic() < deadline:  # (the server and its engine)
        time.sleep(0.1)
    members = _group(server) + [watchdog]
    assert server in members and len(members) == 3 and _alive(watchdog), members
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    deadline = time.monotonic() + 15
    while (_group(server) or _alive(watchdog)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = sorted({pid for pid in members + _group(server) if _alive(pid)})
    for pid in left:  # (the failure's clean-up)
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after the run was killed: {left}"


def test_a_stopped_server_leaves_no_watchdog_behind(stand_in):
    from specforge_lite.serving import VLLMServer

    server = VLLMServer("stand-in", 64, python=Path(sys.executable), env={"PYTHONPATH": str(stand_in)},
                        log=lambda m: None)
    server.start()
    members = _group(server.proc.pid) + [server.watchdog.pid]
    server.stop()
    assert not [p for p in members if _alive(p)]
