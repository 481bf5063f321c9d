"""Served traffic read into training conversations: the prompts users sent and the answers the target served,
which are the target's own output, so nothing is regenerated.

Three kinds of file:

* **OpenAI chat-completion logs** (JSONL, one exchange per line, as API gateways write them):
  ``{"request": {"messages": [...]}, "response": {"choices": [{"message": {"role": "assistant", ...}}]}}``.
  The conversation is the request's messages followed by the first choice's message.
* **Conversations** (ShareGPT ``conversations`` or OpenAI ``messages`` JSONL/JSON), read as data.formats reads
  any training file.
* **A vLLM server's request log** (``vllm serve --enable-log-requests --enable-log-outputs`` with
  ``VLLM_LOGGING_LEVEL=DEBUG``): the ``Request <id> JSON body: {...}`` line of each request paired with its
  ``Generated response chatcmpl-<id>: output: '...'`` line (the complete one, for a streamed answer). A body
  cut short by ``--max-log-len`` and a request without a logged response are counted, never guessed.

A row that cannot be read is counted and named (file and line, and why), never fatal: ``Traffic.skipped``.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..data.errors import MalformedRow
from ..data.formats import iter_rows, normalize_conversation

_VLLM_BODY = re.compile(r"Request (?P<id>\S+) JSON body: (?P<body>\{.*\})\s*$")
_VLLM_OUTPUT = re.compile(r"Generated response (?P<id>\S+?)(?P<stream> \(streaming (?:delta|complete)\))?: "
                          r"output: (?P<output>'.*'|\".*\"), finish_reason: (?P<finish>\S+)\s*$")


@dataclass
class Traffic:
    conversations: list[list[dict[str, Any]]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "location: why", one per row that could not be read

    def summary(self) -> str:
        reasons: dict[str, int] = {}
        for line in self.skipped:
            why = line.split(": ", 1)[-1]
            reasons[why] = reasons.get(why, 0) + 1
        said = "; ".join(f"{n} x {why}" for why, n in sorted(reasons.items(), key=lambda x: -x[1])[:3])
        return f"{len(self.conversations)} conversations read, {len(self.skipped)} rows skipped" + \
            (f" ({said})" if said else "")


def read_traffic(paths: list[str | Path]) -> Traffic:
    """Every conversation in the traffic files (or folders of them), each kind of file recognised by its
    content: a vLLM log by its lines, else JSON rows, each row an exchange or a conversation."""
    traffic = Traffic()
    for path in paths:
        path = Path(path).expanduser()
        if not path.exists():
            traffic.skipped.append(f"{path}: no such file or folder")
            continue
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            if f.suffix in (".log", ".txt"):
                _read_vllm_log(f, traffic)
            elif f.suffix in (".jsonl", ".json"):
                _read_rows(f, traffic)
    return traffic


def _read_rows(path: Path, traffic: Traffic) -> None:
    for _, where, row in iter_rows(path):
        try:
            if isinstance(row, Exception):
                raise row
            traffic.conversations.append(exchange(row) if isinstance(row, dict) and "request" in row
                                         else normalize_conversation(row, path.parent))
        except MalformedRow as e:
            traffic.skipped.append(f"{where}: {e}")


def exchange(row: dict) -> list[dict[str, Any]]:
    """One logged chat completion: the request's messages and the answer served for them."""
    request, response = row.get("request"), row.get("response")
    if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
        raise MalformedRow("the request holds no 'messages' list")
    choices = response.get("choices") if isinstance(response, dict) else None
    if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
        raise MalformedRow("the response holds no 'choices' (a failed or streamed request: nothing was served)")
    answer = choices[0].get("message")
    if not isinstance(answer, dict) or not isinstance(answer.get("content"), str) or not answer["content"].strip():
        raise MalformedRow("the served answer is empty")
    return normalize_conversation({"messages": [*request["messages"], {"role": "assistant",
                                                                      "content": answer["content"]}]})


def _read_vllm_log(path: Path, traffic: Traffic) -> None:
    bodies: dict[str, tuple[str, Any]] = {}
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as e:
        traffic.skipped.append(f"{path}: the file cannot be read ({e.strerror or e})")
        return
    for n, line in enumerate(lines, 1):
        where = f"{path}:{n}"
        if (m := _VLLM_BODY.search(line)):
            try:
                bodies[m["id"]] = (where, json.loads(m["body"]))
            except json.JSONDecodeError:
                traffic.skipped.append(f"{where}: the request body is cut short (raise --max-log-len or leave it "
                                       "unset)")
        elif (m := _VLLM_OUTPUT.search(line)):
            if m["stream"] == " (streaming delta)":
                continue  # the complete line follows
            # (vLLM logs the body under the bare request id and the response under "chatcmpl-<id>")
            found = bodies.pop(m["id"], None) or bodies.pop(m["id"].split("-", 1)[-1], None)
            if found is None:
                traffic.skipped.append(f"{where}: a response to request {m['id']}, whose body was not logged (log "
                                       "with VLLM_LOGGING_LEVEL=DEBUG)")
                continue
            try:
                output = ast.literal_eval(m["output"])
                traffic.conversations.append(exchange({"request": found[1], "response": {
                    "choices": [{"message": {"role": "assistant", "content": output}}]}}))
            except (ValueError, SyntaxError):
                traffic.skipped.append(f"{where}: the output is not a quoted string")
            except MalformedRow as e:
                traffic.skipped.append(f"{found[0]}: {e}")
    traffic.skipped += [f"{where}: request {rid} has no logged response (cut off, or still running when the log "
                        "was taken)" for rid, (where, _) in bodies.items()]
