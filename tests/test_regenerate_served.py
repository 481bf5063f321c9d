"""Regeneration through an OpenAI-compatible server that fails: retries, resume after a kill, failures named.

The server is real: an OpenAI-compatible completions endpoint on 127.0.0.1 serving our lean decoder over the
tiny Llama target, one request at a time (an answer depends on its prompt and seed alone); tests/test_serving.py
runs the same scenarios against vLLM's own server. In front of it, a proxy fails one request in five (HTTP 500, a
connection dropped without an answer, no answer until the client's timeout), or every request for a chosen
conversation, before the request reaches the server, and records every answer it passes on: that record is the
work the server did, and an answer asked for twice shows in it.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch

from specforge_lite.config import GenerationConfig
from specforge_lite.data.regenerate import PromptQueue, RegenerationFailed, regenerate
from specforge_lite.errors import UserError
from specforge_lite.generation import LazyGenerator, ServedAnswers, lean_decoder

TESTS = Path(__file__).resolve().parent
MODEL = "tiny-served"
CONVS = [[{"role": "user", "content": f"Tell me about topic {i}."}, {"role": "assistant", "content": "-"},
          {"role": "user", "content": f"And what else about topic {i}?"}, {"role": "assistant", "content": "-"}]
         for i in range(12)]
# sampled, so that every answer differs (the tiny random target's greedy answers are all alike): the server draws
# from each request's seed, which regeneration sets per conversation and turn
CFG = GenerationConfig(context="all", batch_size=4, concurrency=4, max_new_tokens=8, temperature=1.0, engine="openai",
                       request_timeout=30.0)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, handler):
        super().__init__(("127.0.0.1", 0), handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that went away (a kill, a cancel)
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # kept-alive connections, as a serving engine keeps them

    def log_message(self, *args) -> None:
        pass

    def body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))

    def reply(self, status: int, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class _CompletionHandler(_Handler):
    def do_POST(self) -> None:
        body = json.loads(self.body())
        if self.path != "/v1/completions":
            return self.reply(404, b'{"error": {"message": "no such route"}}')
        status, reply = self.server.complete(body)
        self.reply(status, json.dumps(reply).encode())


class LeanCompletions(_Server):
    """POST /v1/completions with token-id prompts, answered by our lean decoder over ``target`` in one engine
    thread, a request at a time (torch computes in that one thread, as a serving engine's loop does)."""

    def __init__(self, target, tokenizer):
        super().__init__(_CompletionHandler)
        self.target, self.tokenizer = target, tokenizer
        self.engine = ThreadPoolExecutor(1)

    def complete(self, body: dict) -> tuple[int, dict]:
        if body.get("model") != MODEL:
            return 404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}}
        status, reply = self.engine.submit(self._answer, body).result()
        if body.get("prompt_logprobs") is not None:  # (vLLM's option: each prompt token's, keyed by its id)
            reply["choices"][0]["prompt_logprobs"] = self.engine.submit(self._prompt_logprobs, body["prompt"]).result()
        return status, reply

    def _prompt_logprobs(self, ids: list[int]) -> list:
        with torch.no_grad():
            logits = self.target.model(torch.tensor([ids])).logits[0].float()
        given = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        return [None, *({str(t): {"logprob": float(x), "rank": 1}} for t, x in zip(ids[1:], given))]

    def _answer(self, body: dict) -> tuple[int, dict]:
        decoder = lean_decoder(self.target, self.target.model, 1, body["max_tokens"],
                               set(body.get("stop_token_ids") or [self.tokenizer.eos_token_id]),
                               body.get("temperature", 1.0), body.get("top_p", 1.0))
        queue = PromptQueue()
        queue.push(0, list(body["prompt"]), body.get("seed", 0))
        [(_, tokens)] = list(decoder.stream(queue))
        text = self.tokenizer.decode(tokens, skip_special_tokens=body.get("skip_special_tokens", True))  # (vLLM's)
        done = "length" if len(tokens) >= body["max_tokens"] else "stop"
        return 200, {"id": f"cmpl-{time.monotonic_ns()}", "object": "text_completion", "created": int(time.time()),
                     "model": MODEL, "choices": [{"index": 0, "text": text, "finish_reason": done, "logprobs": None}],
                     "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(tokens),
                               "total_tokens": len(body["prompt"]) + len(tokens)}}


class _ProxyHandler(_Handler):
    def do_POST(self) -> None:
        raw = self.body()
        body = json.loads(raw)
        failure = self.server.admit(body)
        if failure == "500":
            return self.reply(500, b'{"error": {"message": "internal server error"}}')
        if failure == "503":
            return self.reply(503, b'{"error": {"message": "the server is at capacity"}}')
        if failure in ("drop", "hang"):
            if failure == "hang":  # past the client's timeout
                self.server.stopping.wait(self.server.hang_s)
            self.close_connection = True  # closed without an answer
            return
        upstream = urlsplit(self.server.upstream)
        connection = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=300)
        try:
            connection.request("POST", self.path, raw, {"Content-Type": "application/json"})
            response = connection.getresponse()
            payload = response.read()
        finally:
            connection.close()
        if response.status == 200 and "prompt_logprobs" not in body:  # (the check of the model served: no answer)
            self.server.answered.append((tuple(body["prompt"]), json.loads(payload)["choices"][0]["text"]))
        self.reply(response.status, payload)


class FlakyProxy(_Server):
    """127.0.0.1 in front of ``upstream``: every ``every``-th request fails before reaching it, in turn with each
    of ``kinds``: HTTP 500, a dropped connection, a hang of ``hang_s`` seconds (set it past the client's
    timeout); so does every request ``poisoned(body)`` picks (with 500), and, once ``limit`` requests were
    passed on, every one (503, a server at capacity). ``failures`` counts the failures by kind; ``answered``
    holds what the server answered, (prompt ids, text) in order."""

    def __init__(self, upstream: str, every: int = 5, kinds: tuple[str, ...] = ("500", "drop"), hang_s: float = 0):
        super().__init__(_ProxyHandler)
        self.upstream, self.every, self.kinds, self.hang_s = upstream, every, kinds, hang_s
        self.lock, self.stopping = threading.Lock(), threading.Event()
        self.requests, self.passed, self.failures = 0, 0, Counter()
        self.answered: list[tuple[tuple[int, ...], str]] = []
        self.poisoned = lambda body: False
        self.limit: int | None = None

    def admit(self, body: dict) -> str | None:
        """None: pass the request on; else how it fails."""
        with self.lock:
            self.requests += 1
            if self.poisoned(body):
                kind = "500"
            elif self.every and self.requests % self.every == 0:
                kind = self.kinds[(self.requests // self.every - 1) % len(self.kinds)]
            elif self.limit is not None and self.passed >= self.limit:
                kind = "503"
            else:
                self.passed += 1
                return None
            self.failures[kind] += 1
            return kind


def serve(server: _Server) -> None:
    threading.Thread(target=server.serve_forever, daemon=True).start()


def close(*servers: _Server) -> None:
    for server in servers:
        if isinstance(server, FlakyProxy):
            server.stopping.set()
        server.shutdown()
        server.server_close()


def served_answers(url: str, model_dir: str, model: str = MODEL, cfg: GenerationConfig = CFG) -> ServedAnswers:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return ServedAnswers(url, model, tok, cfg.max_new_tokens, cfg.temperature, cfg.top_p, {tok.eos_token_id},
                         cfg.concurrency, cfg.request_timeout, cfg.max_retries)


def regenerate_through(url: str, model_dir: str, model: str) -> None:
    """What the killed process runs."""
    regenerate(CONVS, served_answers(url, model_dir, model), CFG, "served", log=print)


def answers(conversations) -> list[str]:
    return [m["content"] for c in conversations for m in c if m["role"] == "assistant"]


# ---- the scenarios, for any server behind the proxy (here our lean one; tests/test_serving.py: vLLM) -------------
def check_every_answer_arrives(config, target, tok, proxy: FlakyProxy, model: str, timeout: float = 10.0) -> None:
    """Through the run's own engine (LazyGenerator, data.generation.engine=openai), one request in five failing:
    the client retries the 500s, the dropped connections and a hung request (after ``timeout``: long enough for
    a loaded 2-core machine, so only the hang times out), and the data holds every answer the server gave. (A
    prompt asked twice, after a timeout, is answered the same: from the same seed.)"""
    gen = replace(CFG, server_url=proxy.url, server_model=model, request_timeout=timeout)
    # about 30 requests: one in five fails, the third of them by hanging
    proxy.kinds, proxy.hang_s = ("500", "drop", "hang", "500", "drop", "500", "drop", "500"), timeout + 1
    said = []
    generator = LazyGenerator(replace(config, data=replace(config.data, generation=gen)), target, tok, log=said.append)
    out, stats = regenerate(CONVS, generator, gen, "flaky", log=lambda m: None)
    # first, the server's log-probabilities of a chat prompt held against the target's: the same model
    (checked,) = [m for m in said if "serves the target" in m]
    assert float(checked.split(" are ")[1].split(" nats")[0]) < 0.2, checked
    assert all(proxy.failures[kind] >= 1 for kind in proxy.kinds), proxy.failures
    assert stats["failed"] == 0
    given = [text.strip() for text in dict(proxy.answered).values()]  # by prompt
    assert sorted(answers(out)) == sorted(t for t in given if t)
    assert stats["empty_answers"] == given.count("")
    # every turn of every conversation (an empty answer, which a sampled real model may give, ends its own)
    assert len(answers(out)) + 2 * stats["empty_answers"] >= len(CONVS) * 2


def check_kill_and_resume(proxy: FlakyProxy, model_dir: str, model: str, cache: Path) -> list:
    """A process regenerating through the proxy (one request in five failing) is SIGKILLed once the server gave 9
    answers (the proxy refuses more with 503 meanwhile, so the kill comes mid-run); a rerun asks only for the
    answers the killed run did not get, and the data holds all of them. Returns the rerun's data."""
    proxy.limit = 9
    code = (f"import sys; sys.path.insert(0, {str(TESTS)!r}); from test_regenerate_served import "
            f"regenerate_through; regenerate_through({proxy.url!r}, {model_dir!r}, {model!r})")
    child = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    journal = cache / "served" / "answers.jsonl"
    deadline = time.monotonic() + 300
    while not (journal.is_file() and len(journal.read_text().splitlines()) >= 9):
        assert child.poll() is None, child.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "the regeneration never got 9 answers"
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    first = list(proxy.answered)
    assert len(first) == 9 and len(journal.read_text().splitlines()) == 9
    in_shards = 0  # answers of the shards the killed run had completed (and written)
    for shard in journal.parent.glob("part-*.jsonl"):
        rows = [json.loads(line) for line in shard.read_text().splitlines()]
        in_shards += len(answers(r["messages"] for r in rows if "messages" in r)) + rows[-1]["_empty_answers"]

    proxy.limit, proxy.answered = None, []
    log = []
    out, stats = regenerate(CONVS, served_answers(proxy.url, model_dir, model), CFG, "served", log=log.append)
    assert f"{9 - in_shards} answers of unfinished batches read back" in log[0]
    asked = [prompt for prompt, _ in proxy.answered]
    assert not set(asked) & {prompt for prompt, _ in first}  # nothing the killed run was given is asked again
    assert len(set(asked)) == len(asked)
    assert len(first) + len(asked) == len(answers(out)) + stats["empty_answers"]  # and nothing missing
    assert stats["failed"] == 0
    assert not journal.exists()
    return out


@pytest.fixture(scope="module")
def tiny():
    from specforge_lite.compose import load_config
    from specforge_lite.targets import build_target, load_tokenizer

    config = load_config(["model=llama3_tiny", "tracker=none"])
    target = build_target(config)
    return config, target, load_tokenizer(target)


@pytest.fixture
def servers(tiny):
    """(server, proxy) for one test."""
    _, target, tok = tiny
    server = LeanCompletions(target, tok)
    server.complete({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})  # torch's first call is slow
    proxy = FlakyProxy(server.url)
    serve(server), serve(proxy)
    yield server, proxy
    close(proxy, server)
    server.engine.shutdown()


@pytest.fixture
def cache(tiny, tmp_path, monkeypatch):
    """A private cache for the regenerated answers (after the tiny target was built in the shared one)."""
    monkeypatch.setenv("SPECFORGE_LITE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "regenerated"


def test_a_server_failing_one_request_in_five_still_answers_every_conversation(tiny, servers, cache):
    config, target, tok = tiny
    check_every_answer_arrives(config, target, tok, servers[1], MODEL)


def test_a_killed_regeneration_resumes_without_asking_for_any_answer_twice(tiny, servers, cache):
    server, proxy = servers
    model_dir = str(tiny[1].location)
    out = check_kill_and_resume(proxy, model_dir, MODEL, cache)
    # the data is what a run that was never killed makes (the answers are seeded per conversation and turn)
    straight, _ = regenerate(CONVS, served_answers(server.url, model_dir), CFG, "straight", log=lambda m: None)
    assert out == straight


def test_failed_conversations_are_named_left_out_and_asked_for_again(tiny, servers, cache):
    """A conversation whose requests always fail: above data.generation.max_failed_fraction the run stops with
    one line naming it (the answers made are kept); within it, the run goes on without that conversation and
    names it; once the server answers, a rerun asks for that conversation alone."""
    _, target, tok = tiny
    _, proxy = servers
    proxy.every = 0
    proxy.poisoned = lambda body: "poison" in tok.decode(body["prompt"])
    convs = [list(c) for c in CONVS[:6]]
    convs[3][0] = {"role": "user", "content": "Tell me about poison."}
    cfg = replace(CFG, concurrency=1, max_retries=1, max_failed_fraction=0.0)

    def run(cfg, log=lambda m: None):
        return regenerate(convs, served_answers(proxy.url, str(target.location), cfg=cfg), cfg, "poison", log=log)

    with pytest.raises(RegenerationFailed) as stop:
        run(cfg)
    message = str(stop.value)
    assert isinstance(stop.value, UserError) and "\n" not in message
    assert message.startswith("1 of 6 conversations could not be regenerated")
    assert "#3 'Tell me about poison.' (HTTP 500 after 1 retries: internal server error)" in message
    assert "max_failed_fraction=0.0" in message and "only the missing ones are asked for" in message
    assert len(proxy.answered) == 6  # one at a time: conversations 0-2, two answers each, made before the stop
    assert proxy.failures["500"] == 2  # the request and its one retry

    log = []
    out, stats = run(replace(cfg, max_failed_fraction=0.2), log.append)
    assert len(proxy.answered) == 6 + 4  # conversations 4-5; none of 0-2 again
    assert stats["failed"] == 1 and len(out) == 5
    assert [f["conversation"] for f in stats["failed_conversations"]] == [3]
    assert not any("poison" in c[0]["content"] for c in out)
    assert "1 of 6 conversations failed after the retries and are left out of this run's data" in log[-1]
    assert "#3 'Tell me about poison.'" in log[-1]
    failed = (cache / "poison" / "failed.jsonl").read_text().splitlines()
    assert [json.loads(line)["reason"] for line in failed] == ["HTTP 500 after 1 retries: internal server error"]

    proxy.poisoned = lambda body: False
    out, stats = run(cfg)
    assert len(proxy.answered) == 6 + 4 + 2  # conversation 3 alone
    assert stats["failed"] == 0 and len(out) == 6 and "poison" in out[3][0]["content"]
    assert not (cache / "poison" / "failed.jsonl").exists()
    # the journal keeps the answers of the last batch alone, a short one (4, 5), which a larger cap extends
    journal = (cache / "poison" / "answers.jsonl").read_text().splitlines()
    assert {json.loads(line)["unit"] for line in journal} == {4, 5}


def test_a_server_that_does_not_serve_the_model_stops_at_once(tiny, servers, cache):
    """A 404 for the model is the settings' fault, not the server's mood: one line with the fix, no retries."""
    _, proxy = servers
    proxy.every = 0
    answers = served_answers(proxy.url, str(tiny[1].location), "not-served")
    with pytest.raises(UserError, match=r"refused a completion \(404: The model `not-served` does not exist.\); "
                                        r"check data.generation.server_url and server_model"):
        regenerate(CONVS, answers, CFG, "wrong-model", log=lambda m: None)
    assert proxy.requests <= CFG.concurrency and proxy.answered == []  # the first requests, none retried


def test_a_server_of_another_model_is_refused_before_any_answer(smollm2, cache):
    """data.generation.server_url naming a server of another model than the target (here the real SmolLM2's weights
    each moved by 20% of their spread: another fine-tune of the same architecture and tokenizer) would write the
    draft's training text in another model's voice, unsaid. Before the first answer, its log-probabilities of a
    chat prompt are held against the target's: the run stops in one line with the figure and the fix, and no
    answer was asked for. data.generation.check_server=false asks nothing. (A random model's distributions are
    too flat for two of them to stand apart: the real weights.)"""
    import copy

    from specforge_lite.targets import HFTarget

    config, target, tok = smollm2
    other = copy.deepcopy(target.model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.2 * p.std() * torch.randn(p.shape, generator=generator))
    server = LeanCompletions(HFTarget(other, target.family, target.aux_layer_ids, target.location), tok)
    serve(server)
    try:
        gen = replace(CFG, server_url=server.url, server_model=MODEL)
        generator = LazyGenerator(replace(config, data=replace(config.data, generation=gen)), target, tok,
                                  log=lambda m: None)
        refused = (r"^the server at .* serves another model than the target \(.*\): its log-probabilities of a "
                   r"chat prompt's tokens are [0-9.]+ nats from the target's own .* Serve the target there, or train "
                   r"with model= set to the model it serves")
        with pytest.raises(UserError, match=refused):
            regenerate(CONVS[:2], generator, gen, "other-model", log=lambda m: None)
        journal = cache / "other-model" / "answers.jsonl"
        assert not journal.exists() or journal.read_text() == ""  # (no answer was asked for)
        unchecked = replace(gen, check_server=False, max_new_tokens=2)
        generator = LazyGenerator(replace(config, data=replace(config.data, generation=unchecked)), target, tok,
                                  log=lambda m: pytest.fail(m))
        out, _ = regenerate(CONVS[:1], generator, unchecked, "unchecked", log=lambda m: None)
        assert len(out) == 1
    finally:
        close(server)
        server.engine.shutdown()


def test_self_generated_requests_whose_sampling_failed_are_counted_as_dropped(tiny, servers, cache):
    """The target writing user requests through a server (data.mix self_generated, engine openai): a request
    whose sampling fails for good is one candidate fewer, counted among the drop reasons, never written as text."""
    from specforge_lite.config import SelfGeneratedConfig
    from specforge_lite.data.self_generated import write_requests

    _, target, tok = tiny
    _, proxy = servers
    proxy.every = 0
    proxy.poisoned = lambda body: body["seed"] % 3 == 0
    cfg = replace(CFG, max_retries=0)
    kept, stats = write_requests(served_answers(proxy.url, str(target.location), cfg=cfg), tok, 4,
                                 SelfGeneratedConfig(min_words=0), "tiny-served", 4, log=lambda m: None)
    poisoned = proxy.failures["500"]
    assert poisoned > 0 and stats["dropped"]["request failed after the retries"] == poisoned
    assert stats["candidates"] == poisoned + len(proxy.answered)


class _BrokenHandler(_Handler):
    def do_POST(self) -> None:
        self.body()
        self.server.requests += 1
        if self.server.kind == "empty":  # a completion without any choice
            return self.reply(200, json.dumps({"id": "cmpl-0", "object": "text_completion", "created": 0,
                                               "model": MODEL, "choices": []}).encode())
        self.reply(200, b'{"id": "cmpl-0", "object": "text_completion", "choices": [{"index": 0, "text": "An ans')


class BrokenReplies(_Server):
    """A server answering every completion with HTTP 200 and a body that holds no answer: ``kind`` empty, a
    completion whose choices list is empty; cut, a JSON body cut off mid-string."""

    def __init__(self, kind: str):
        super().__init__(_BrokenHandler)
        self.kind, self.requests = kind, 0


@pytest.mark.parametrize("kind, said", [("empty", "HTTP 200 without a completion (an empty choices list)"),
                                        ("cut", "HTTP 200 with a body that is not JSON (Unterminated string")])
def test_a_reply_without_an_answer_is_a_failed_request_naming_the_server(tiny, cache, kind, said):
    """A 200 whose body holds no answer (no choices, a body cut short) is retried, then counted and named as a
    failed request with the server's address, never a traceback."""
    server = BrokenReplies(kind)
    serve(server)
    try:
        cfg = replace(CFG, max_retries=1, max_failed_fraction=1.0, concurrency=2)
        out, stats = regenerate(CONVS[:2], served_answers(server.url, str(tiny[1].location), cfg=cfg), cfg, kind,
                                log=lambda m: None)
    finally:
        close(server)
    assert out == [] and stats["failed"] == 2 and server.requests == 2 * 2  # each first request and its retry
    for failure in stats["failed_conversations"]:
        assert failure["reason"].startswith(said) and f"from {server.url}, after 1 retries" in failure["reason"]
