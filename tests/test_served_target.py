"""target.backend=vllm: the trainer's capture asked of a server, read from the files it writes, and its faults.

The server here is real and small: vLLM's completions endpoint as its ``extract_hidden_states`` method with the
hidden-states connector answers it (the file's path in ``kv_transfer_params``; the file written after the
answer, under an exclusive ``.lock`` its writer lets go of when done), over our own capture of the tiny Llama
target, one sequence per request. It fails on cue: it goes away for a moment, stalls past the client's timeout,
writes a short file, or lets go of the lock without writing. tests/test_serving.py runs vLLM's own server (on
SmolLM2, its CPU build) through the same target, and kills it mid-run.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from conftest import load_config

TINY = ["model=llama3_tiny", "recipe=none", "tracker=none", "model.dtype=float32", "data.max_length=96",
        "data.max_samples=24", "data.heldout_samples=4", "draft.draft_vocab_size=49152", "draft.ttt_length=3"]
TRAIN = ["trainer.max_steps=6", "trainer.log_every=1", "trainer.progress_bar=false", "trainer.precision=fp32",
         "trainer.micro_batch_size=2", "trainer.lr=1e-3", "trainer.warmup_ratio=0", "eval.enabled=false"]


class ExtractingServer(ThreadingHTTPServer):
    """vLLM's extraction protocol over ``target`` (an HFTarget capturing the served layer ids); ``faults``:
    request number -> what goes wrong with it (die, stall, short, unwritten, plain)."""

    daemon_threads = True

    def __init__(self, target, storage: Path, stall_s: float = 3.0):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.target, self.storage, self.stall_s = target, storage, stall_s
        self.faults: dict[int, str] = {}
        self.requests = 0
        self.down_until = 0.0
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def states(self, ids: list[int]) -> torch.Tensor:
        with self.lock:  # (one capture at a time: the hooks record into one place)
            aux = self.target.capture(torch.tensor([ids])).aux
        return torch.stack([a[0] for a in aux], dim=1).contiguous()  # [T, n_ids, H], as vLLM writes them

    def prompt_logprobs(self, ids: list[int]) -> list:
        """vLLM's ``prompt_logprobs`` answer: per prompt token (None for the first) its log-probability given the
        tokens before it, keyed by its id, from the target's own forward."""
        with self.lock, torch.no_grad():
            logits = self.target.model(torch.tensor([ids])).logits[0].float()
        given = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        return [None, *({str(t): {"logprob": float(x), "rank": 1}} for t, x in zip(ids[1:], given))]

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def reply(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def down(self) -> bool:
        return time.monotonic() < self.server.down_until

    def do_GET(self) -> None:
        if self.down():
            self.close_connection = True
        elif self.path.endswith("/models"):
            self.reply(200, {"data": [{"id": "tiny"}]})
        else:
            self.reply(200, {})

    def do_POST(self) -> None:
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        with srv.lock:
            srv.requests += 1
            n, fault = srv.requests, srv.faults.pop(srv.requests, None)
        if fault == "die":
            srv.down_until = time.monotonic() + 1.0
        if self.down() or fault == "stall":
            if fault == "stall":
                time.sleep(srv.stall_s)
            self.close_connection = True  # (no answer: the connection is dropped)
            return
        ids = body["prompt"]
        answer = {"choices": [{"text": "x", "finish_reason": "length"}]}
        if body.get("prompt_logprobs") is not None:
            answer["choices"][0]["prompt_logprobs"] = srv.prompt_logprobs(ids)
        if fault == "plain":  # a server started without the extraction options
            self.reply(200, answer)
            return
        path = srv.storage / f"req-{n}.safetensors"
        lock = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY, 0o644)
        fcntl.flock(lock, fcntl.LOCK_EX)  # held before the path is handed out, as vLLM's connector holds it
        self.reply(200, {**answer, "kv_transfer_params": {"hidden_states_path": str(path)}})
        time.sleep(0.02)  # (written after the answer: the reader waits for the lock)
        data = save({"hidden_states": srv.states(ids), "token_ids": torch.tensor(ids)})
        if fault == "short":
            data = data[: len(data) // 2]
        if fault != "unwritten":
            path.write_bytes(data)
        os.close(lock)


@pytest.fixture
def server(tmp_path):
    from specforge_lite.targets import build_target
    from specforge_lite.targets.served import server_layer_ids

    config = load_config(TINY)
    parts = build_target(config, parts_only=True)
    target = build_target(config, aux_layer_ids=server_layer_ids(parts.aux_layer_ids, parts.num_layers))
    (tmp_path / "states").mkdir()
    srv = ExtractingServer(target, tmp_path / "states")
    yield srv
    srv.close()


def served(server, *more):
    return [*TINY, "target.backend=vllm", f"target.server_url={server.url}", *more]


def test_the_served_capture_equals_the_in_process_one(server):
    """A right-padded batch and a packed one (two conversations in a row, positions restarting at 0): the
    server's states, one request per sequence, put where the in-process capture has them (aux states and the
    final state after the target's final norm) within float rounding; every file deleted once read, and the
    buffer never held more than the batch's files."""
    from specforge_lite.targets import build_target

    hf, sv = build_target(load_config(TINY)), build_target(load_config(served(server)), log=lambda m: None)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf.vocab_size, (3, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 23:], mask[2, 9:] = 0, 0
    positions = torch.cat([torch.arange(15), torch.arange(25)]).repeat(3, 1)  # (packed rows)
    for packed in ({}, {"position_ids": positions}):
        m = mask if not packed else torch.ones_like(ids)
        ours, theirs = hf.capture(ids, None if packed else m, **packed), sv.capture(ids, m, **packed)
        for a, b in zip([*ours.aux, ours.final_hidden], [*theirs.aux, theirs.final_hidden]):
            real = m.bool()
            assert a.shape == b.shape
            torch.testing.assert_close(b[real], a[real], rtol=1e-5, atol=1e-5)
            assert not b[~real].any()  # (pads: zeros, which no loss reads)
    assert not list(server.storage.iterdir())
    one_row = 40 * (len(hf.aux_layer_ids) + 1) * hf.hidden_size * 4
    assert one_row <= sv.peak_buffer_bytes <= 6 * one_row + 6 * 4096  # (at most the six sequences' files)
    assert server.requests == 1 + 3 + 6  # (the first: the probe of the final state, tested below)


def test_a_run_through_a_failing_server_trains_as_in_process(server, tmp_path):
    """The server goes away, stalls past target.server_timeout, writes a short file and lets go of a lock without
    writing, each once in the run: each failed batch is said in one line naming it and asked again, and the losses
    equal the in-process run's step by step, so no batch was trained on a partial state, twice, or not at all."""
    from specforge_lite.job import run

    server.faults = {3: "die", 8: "stall", 12: "short", 15: "unwritten"}
    said, losses = [], {}
    for name, overrides in {"in-process": TINY, "served": served(server, "target.server_timeout=1.5")}.items():
        out = tmp_path / name
        run(load_config([*overrides, *TRAIN, f"output_dir={out}"]), out, log=said.append)
        losses[name] = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses["in-process"]) == 6 and any(x > 0 for x in losses["in-process"])
    assert losses["served"] == pytest.approx(losses["in-process"], rel=1e-5)
    retried = [m for m in said if m.startswith("[target] batch")]
    assert len(retried) == 4, retried
    for line, why in zip(retried, ["went away", "no answer within 1.5 s", "short", "missing"]):
        assert why in line and "asking again" in line and "sequences" in line, line
    assert not server.faults and not list(server.storage.iterdir())


class StartedServer:
    """What targets/served.py needs of the server a run starts (serving.VLLMServer): start() on a free port,
    returning its URL, and stop(); here the extracting server over the same target and folder."""

    def __init__(self, like: ExtractingServer):
        self.target, self.storage, self.model, self.current, self.starts = like.target, like.storage, "tiny", None, 0

    def start(self) -> str:
        self.current, self.starts = ExtractingServer(self.target, self.storage), self.starts + 1
        return self.current.url

    def stop(self, grace: float = 60) -> None:
        self.current.close()


def test_a_server_the_run_started_is_restarted_after_it_went_away(server):
    """The server the run started goes away mid-batch: it is stopped, its folder emptied (a file of the failed
    try left there is never read), started again (on another port) and the whole batch asked again."""
    from specforge_lite.targets import build_target
    from specforge_lite.targets.served import ServedTarget

    config = load_config(TINY)
    hf, said = build_target(config), []
    started = StartedServer(server)
    sv = ServedTarget(build_target(config, parts_only=True), None, started, server.storage, timeout=5, retries=1,
                      log=said.append)
    ids = torch.randint(0, hf.vocab_size, (3, 20), generator=torch.Generator().manual_seed(2))
    sv.capture(ids)
    first = started.current
    first.faults = {6: "die"}  # (the second request of the second batch: the first request was the probe)
    theirs, ours = sv.capture(ids), hf.capture(ids)
    assert started.starts == 2 and started.current is not first
    said = [m for m in said if m.startswith("[target] batch")]
    assert len(said) == 1 and said[0].startswith("[target] batch 2 (3 sequences, 60 tokens): the server went away")
    assert "restarted the vLLM server" in said[0]
    torch.testing.assert_close(theirs.final_hidden, ours.final_hidden, rtol=1e-5, atol=1e-5)
    assert not list(server.storage.iterdir())
    sv.close()


def test_a_server_that_stays_away_stops_the_run_naming_the_batch(server):
    from specforge_lite.targets import build_target
    from specforge_lite.targets.served import CaptureFailed

    sv = build_target(load_config(served(server, "target.server_timeout=1", "target.server_retries=1")),
                      log=lambda m: None)
    ids = torch.randint(0, sv.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    sv.capture(ids)
    server.close()
    with pytest.raises(CaptureFailed, match=r"^batch 2 \(2 sequences, 24 tokens\): the server went away.*did not "
                                            r"answer again within 1 s.*nothing of it was trained"):
        sv.capture(ids)


def test_a_server_without_the_extraction_options_is_told_how_to_start(server):
    from specforge_lite.errors import UserError
    from specforge_lite.targets import build_target

    sv = build_target(load_config(served(server)), log=lambda m: None)
    server.faults = {1: "plain"}
    with pytest.raises(UserError, match="answers without writing hidden states: start it with the extraction "
                                        "options, PYTHONPATH=.*vllm serve tiny --speculative-config"):
        sv.capture(torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize("overrides, said", [
    (["target.server_url=http://h:1/v1"], "target.server_url=http://h:1/v1 is read by target.backend=vllm only"),
    (["target.backend=vllm", "target.server_url=h:1"], "target.server_url=h:1: give the server's URL"),
    (["target.backend=vllm", "target.shard=zero3"], "target.backend=vllm with target.shard=zero3"),
    (["target.backend=vllm", "target.server_url=http://h:1/v1", "target.server_args=[--tensor-parallel-size,2]"],
     "target.server_args and target.buffer_dir are for the server the run starts"),
    (["target.backend=vllm", "data.source=offline", "data.store=/x"], "target.backend=vllm with data.source=offline"),
    (["target.backend=vllm", "target.server_retries=-1"], "target.server_retries=-1"),
    (["target.backend=vllm", "data.regenerate=true"], "the trainer holds no decoder to write the target's answers"),
])
def test_served_target_settings_are_refused_before_anything_runs(overrides, said):
    from specforge_lite.settings import setting_problems

    problems = setting_problems(load_config(["tracker=none", *overrides]))
    assert any(said in p for p in problems), problems


def test_a_run_without_a_serving_environment_is_told_to_build_one(monkeypatch, tmp_path):
    from specforge_lite.settings import setting_problems

    monkeypatch.setenv("SPECFORGE_LITE_SERVING_PYTHON", str(tmp_path / "no-python"))
    problems = setting_problems(load_config(["tracker=none", "target.backend=vllm"]))
    assert any("bash scripts/setup_serving.sh, or name a running server in target.server_url" in p for p in problems)


def test_the_capture_benchmark_compares_the_server_with_in_process(server, capsys):
    """python -m specforge_lite.bench served_capture against a running server: the CPU, each backend's capture
    tokens/s, their ratio and the buffer's peak bytes."""
    from specforge_lite.bench.served_capture import main

    main(["--model", "llama3_tiny", "--seq-len", "32", "--batch", "2", "--batches", "2", "--server-url", server.url,
          "model.dtype=float32"])
    said = capsys.readouterr().out
    for line in ("CPU: ", "hf ", "lean ", "vllm server ", "server / best in-process: ", "buffer peak"):
        assert line in said, said
    peak = int(said.split("MiB (")[1].split(" bytes")[0])
    assert 0 < peak <= 2 * (32 * 4 * 64 * 4 + 4096), said  # (one batch's files at most: 2 rows of [32, 4, 64] fp32)


def test_the_plan_counts_only_the_parts_a_served_target_leaves_in_the_trainer():
    """python -m specforge_lite.plan target.backend=vllm: the trainer's GPUs hold the target's embedding, final norm
    and lm_head (the server holds the rest), counted from the model's own tensors."""
    from specforge_lite import plan
    from specforge_lite.targets import build_target

    hf = plan.trace(load_config(["model=llama3_tiny", "tracker=none"]), 1, 64)
    served = plan.trace(load_config(["model=llama3_tiny", "tracker=none", "target.backend=vllm"]), 1, 64)
    parts = build_target(load_config(["model=llama3_tiny", "tracker=none"]), parts_only=True)
    table, head = parts.embedding_weight(), parts.full_head()[0]
    want = table.numel() * 2 + (0 if head is table else head.numel() * 2) + parts.hidden_size * 2  # (bf16)
    assert served.target_weights == want < hf.target_weights


def test_a_server_started_with_other_layer_ids_of_the_same_count_is_refused(tmp_path):
    """A server that writes the input of the last layer where the pre-norm final state belongs (started with
    other layer ids of the same count: its states have the shape the run reads) would have the teacher read
    another layer. The first capture refuses it in one line with the command to start it: through the final norm
    and lm_head, the state it writes for id L does not give the server's own log-probabilities of the prompt.
    On the real SmolLM2: a random model's distributions are too flat for any layer's to stand apart."""
    from specforge_lite.errors import UserError
    from specforge_lite.targets import build_target
    from specforge_lite.targets.served import server_layer_ids

    config = load_config(["tracker=none", "recipe=none"])
    parts = build_target(config, parts_only=True)
    ids = server_layer_ids(parts.aux_layer_ids, parts.num_layers)
    wrong = [*ids[:-1], parts.num_layers - 1]  # (the aux ids, then the last layer's input in the final state's place)
    (tmp_path / "states").mkdir()
    srv = ExtractingServer(build_target(config, aux_layer_ids=wrong), tmp_path / "states")
    try:
        sv = build_target(load_config(["tracker=none", "recipe=none", "target.backend=vllm",
                                       f"target.server_url={srv.url}"]), log=lambda m: None)
        batch = torch.randint(0, sv.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
        with pytest.raises(UserError, match=rf"does not write the target's pre-norm final state as its state for id "
                                            rf"{parts.num_layers}: .* nats from the server's own .* start it with "
                                            r"PYTHONPATH="):
            sv.capture(batch)
    finally:
        srv.close()
