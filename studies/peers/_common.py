"""What both peer drivers share: their arguments, the inputs, the vocabulary map, the timing loop and the JSON line.

A driver times one EAGLE3 draft training step of a peer's own code (its TTT unroll, its loss, then
backward): no target model, no optimizer step. By default on CPU in fp32 with sdpa attention; with
``--device cuda --dtype bfloat16`` on a GPU with the attention, loss kernel and precision the peer's
own trainer uses there. The step's inputs are random (seeded) or read from ``--inputs FILE.safetensors``
(keys, batch 1: aux [1, T, 3H], input_ids [1, T], final_hidden [1, T, H] after the target's final norm,
loss_mask [1, T]). ``--seq-len 2048,8192,...`` times several lengths in one process (one compile warm-up
of the process, not one per length): the model is built once, for the largest, then each length in the
order given gets its inputs (``{T}`` in ``--inputs`` stands for the length), a warm-up and the timed
steps. Each length prints one JSON line on stdout as soon as it is done (peer, version, seq_len, ttt,
median_s, tokens_per_s, peak_rss_mib, peak_mib, base_mib, oom, device, dtype, attention, loss, notes;
peak_mib and base_mib that length's, peak_rss_mib the process's so far); details go to stderr. A CUDA
out-of-memory at a length prints its line with "oom": true and goes on to the next (exit 0); any other
failure exits 1 with one line on stderr, after the lines of the lengths done.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time
import traceback
import warnings

warnings.filterwarnings("ignore")

STATE: dict = {}  # what is known so far (args, notes, base_mib, done), for the JSON line of an out-of-memory


def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", default=None,
                   help="T, or several comma-separated, timed in that order in one process (required without "
                   "--inputs; with it, T of each file; with a plain --inputs path and no --seq-len, the file's T)")
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--shape", default='{"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, '
                   '"num_key_value_heads": 3, "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 100000.0}',
                   help="the target's Llama config fields, as JSON (default: SmolLM2-135M)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the training precision, applied as the peer's trainer applies it (see the driver)")
    p.add_argument("--attention", default=None,
                   help="the peer's attention option (default: sdpa on cpu, the peer trainer's flex attention on cuda)")
    p.add_argument("--loss", default=None,
                   help="the peer's loss implementation (default: its reference/eager loss on cpu, its Triton "
                   "kernel on cuda)")
    p.add_argument("--teacher", choices=["logits", "hidden_state"], default=None,
                   help="SpecForge only: how its step gets the teacher (default: logits on cpu, hidden_state on cuda)")
    p.add_argument("--inputs", default=None,
                   help="a .safetensors file with the step's inputs (see above); {T} in it stands for each length")
    p.add_argument("--profile", action="store_true",
                   help="at the first length, one more step under torch's profiler: its wall ms and each kernel's "
                   "(on CPU: each aten op's own) name, calls and ms, in the JSON line's \"profile\"")
    p.add_argument("--count-flops", action="store_true",
                   help="at the first length, one more step under torch's FlopCounterMode: the JSON line's "
                   "\"gflop_per_token\" (matrix products; SDPA kernels are not counted on CPU) and \"trainable_m\"")
    a = p.parse_args()
    a.shape = json.loads(a.shape)
    try:
        a.seq_lens = [int(x) for x in a.seq_len.split(",")] if a.seq_len is not None else []
    except ValueError:
        p.error(f"--seq-len {a.seq_len}: want T or T1,T2,... (integers)")
    if any(T <= 0 for T in a.seq_lens):
        p.error(f"--seq-len {a.seq_len}: lengths must be positive")
    if a.inputs is None and not a.seq_lens:
        p.error("--seq-len is required without --inputs")
    a.inputs_pattern = a.inputs  # a.inputs: the current length's file (set_length)
    if a.inputs is not None:
        if "{T}" in a.inputs and not a.seq_lens:
            p.error("--inputs with {T} needs --seq-len")
        if "{T}" not in a.inputs and len(a.seq_lens) > 1:
            p.error("several --seq-len need {T} in --inputs (one file per length)")
        for T in a.seq_lens or [None]:  # every file there, with its T, before the model is built
            path = a.inputs.replace("{T}", str(T))
            if not os.path.isfile(path):
                fail(f"--inputs {path}: no such file")
            file_T = _file_len(path)
            if T is None:
                a.seq_lens = [file_T]
            elif T != file_T:
                fail(f"--seq-len {T} but --inputs {path} has T={file_T}")
    a.max_len = max(a.seq_lens)  # what the model is built for
    set_length(a, a.seq_lens[0])
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but torch.cuda.is_available() is False")
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    a.torch_dtype = getattr(torch, a.dtype)
    STATE.update(args=a, done=0)
    return a


def _file_len(path: str) -> int:
    """T of an inputs file, from its header (input_ids [1, T])."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        if "input_ids" not in f.keys():
            fail(f"--inputs {path}: missing keys ['input_ids']")
        return f.get_slice("input_ids").get_shape()[-1]


def set_length(a: argparse.Namespace, T: int) -> None:
    """Makes ``T`` the current length: ``a.seq_len`` and ``a.inputs`` (``{T}`` filled)."""
    a.seq_len = T
    a.inputs = a.inputs_pattern.replace("{T}", str(T)) if a.inputs_pattern else None


def inputs_note(a: argparse.Namespace) -> str:
    return "; inputs " + os.path.basename(a.inputs) if a.inputs else "; random inputs"


def fail(message: str) -> None:
    print(message.replace("\n", " ")[:2000], file=sys.stderr)
    sys.exit(1)


def load_inputs(a: argparse.Namespace) -> dict:
    """The current length's inputs on ``a.device``: aux and final_hidden in ``a.dtype``, input_ids int64, loss_mask
    int64 (0/1), all batch 1. From ``a.inputs`` (``a.seq_len`` becomes its T) or random (T ``a.seq_len``), seeded."""
    import torch

    H, V = a.shape["hidden_size"], a.shape["vocab_size"]
    if a.inputs:
        from safetensors.torch import load_file

        t = load_file(a.inputs)
        missing = {"aux", "input_ids", "final_hidden", "loss_mask"} - set(t)
        if missing:
            fail(f"--inputs {a.inputs}: missing keys {sorted(missing)}")
        T = t["input_ids"].shape[-1]
        want = {"aux": (1, T, 3 * H), "input_ids": (1, T), "final_hidden": (1, T, H), "loss_mask": (1, T)}
        for k, shape in want.items():
            if tuple(t[k].shape) != shape:
                fail(f"--inputs {a.inputs}: {k} has shape {tuple(t[k].shape)}, want {shape} (hidden {H} from --shape)")
        if a.seq_len is not None and a.seq_len != T:
            fail(f"--seq-len {a.seq_len} but --inputs has T={T}")
        if int(t["input_ids"].max()) >= V:
            fail(f"--inputs {a.inputs}: a token id >= vocab_size {V} of --shape")
        a.seq_len = T
    else:
        T = a.seq_len
        g = torch.Generator().manual_seed(0)
        t = {"aux": torch.randn(1, T, 3 * H, generator=g), "input_ids": torch.randint(0, V, (1, T), generator=g),
             "final_hidden": torch.randn(1, T, H, generator=g), "loss_mask": torch.ones(1, T, dtype=torch.long)}
    return {"aux": t["aux"].to(a.device, a.torch_dtype),
            "final_hidden": t["final_hidden"].to(a.device, a.torch_dtype),
            "input_ids": t["input_ids"].to(a.device, torch.long),
            "loss_mask": (t["loss_mask"] != 0).long().to(a.device)}


def target_head(vocab_size: int, hidden_size: int):
    """A fixed random target lm_head [V, H] (fp32, CPU), the same in both drivers: the teacher's head."""
    import torch

    g = torch.Generator().manual_seed(4321)
    return torch.randn(vocab_size, hidden_size, generator=g) * 0.02


def vocab_map(vocab_size: int, draft_vocab_size: int):
    """(t2d [V] bool, d2t [Vd]) for a fixed random choice of draft tokens, the same in both drivers."""
    import torch

    g = torch.Generator().manual_seed(1234)
    draft_ids = torch.randperm(vocab_size, generator=g)[:draft_vocab_size].sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return t2d, draft_ids - torch.arange(draft_vocab_size)


def time_steps(name: str, step, params, a: argparse.Namespace) -> float:
    """Median seconds of ``step()`` (forward + backward) over ``a.repeats`` runs after a warm-up (which
    includes any torch.compile / Triton compilation), grads dropped before each run outside the timing.
    On CUDA: synchronized around each step; the peak-memory counter is reset after the warm-up, once the
    grads are dropped, so peak_mib = max_memory_allocated over the timed steps (resident weights, inputs
    and whatever the warm-up left allocated, recorded as base_mib, included)."""
    import torch

    cuda = a.device == "cuda"
    times = []
    for i in range(a.repeats + 1):
        for p in params:
            p.grad = None
        if cuda:
            if i == 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                STATE["base_mib"] = torch.cuda.memory_allocated() / 2**20
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if i == 0:
            print(f"[{name}] warm-up {times[0]:.2f}s loss {float(loss):.4f}", file=sys.stderr)
        del loss
    print(f"[{name}] step seconds {[round(t, 3) for t in times[1:]]}", file=sys.stderr)
    if a.count_flops and not STATE["done"]:
        from torch.utils.flop_counter import FlopCounterMode

        for p in params:
            p.grad = None
        with FlopCounterMode(display=False) as flops:
            step()
        STATE["counted"] = {"gflop_per_token": flops.get_total_flops() / a.seq_len / 1e9,
                            "trainable_m": sum(p.numel() for p in params) / 1e6}
    if a.profile and not STATE["done"]:
        try:
            STATE["profile"] = _profile(step, params, cuda)
        except Exception as exc:  # noqa: BLE001 (the timing stands without it)
            print(f"[{name}] profile failed: {type(exc).__name__}: {exc}"[:300], file=sys.stderr)
    return statistics.median(times[1:])


def _profile(step, params, cuda: bool) -> dict:
    """One step under torch's profiler: wall ms and [name, calls, ms] of each device kernel (CPU: aten op)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for p in params:
        p.grad = None
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [[e.key, e.count, (e.device_time_total if cuda else e.self_cpu_time_total) / 1e3]
               for e in prof.key_averages() if not getattr(e, "is_user_annotation", False)
               and (e.device_type != DeviceType.CPU) == cuda]
    return {"wall_ms": wall * 1e3, "kernels": kernels}


def each_length(peer: str, a: argparse.Namespace, params, measure, notes: str) -> None:
    """For each of ``a.seq_lens`` in order (``set_length``): the previous length's gradients dropped and memory
    freed (on CUDA: empty_cache, then the peak counter reset), ``measure()`` (that length's inputs loaded, then
    ``time_steps``: returns its median; its locals, the inputs, go when it returns), and that length's JSON
    line (``notes`` + which inputs). A CUDA out-of-memory at one length frees what it held (the references
    dropped with the exception, gc, empty_cache), prints that length's line with "oom": true and goes on; any
    other failure propagates (``run``: exit 1)."""
    cuda = a.device == "cuda"
    for T in a.seq_lens:
        set_length(a, T)
        STATE.pop("base_mib", None)
        _free(params, cuda)
        if cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()
        why = None
        try:
            seconds = measure()
        except SystemExit:
            raise
        except BaseException as exc:  # noqa: BLE001
            why = _oom_line(exc) if cuda else None
            if why is None:
                raise
        if why is None:
            report(peer, a, seconds, notes + inputs_note(a))
        else:  # out of the except block: the exception, its traceback and the frames' tensors are gone
            _free(params, cuda)
            print(f"[{peer}] T={T}: {why}", file=sys.stderr)
            report(peer, a, None, STATE.get("notes", "") + inputs_note(a) + "; CUDA out of memory", oom=True)
        STATE["done"] += 1


def _free(params, cuda: bool) -> None:
    for p in params:
        p.grad = None
    gc.collect()
    if cuda:
        import torch

        torch.cuda.empty_cache()


def report(peer: str, a: argparse.Namespace, seconds, notes: str, oom: bool = False) -> None:
    from importlib.metadata import version

    peak = base = None
    if a.device == "cuda":
        import torch

        peak = torch.cuda.max_memory_allocated() / 2**20
        base = STATE.get("base_mib")
    print(json.dumps({"peer": peer, "version": version(peer), "seq_len": a.seq_len, "ttt": a.ttt,
                      "median_s": seconds, "tokens_per_s": a.seq_len / seconds if seconds and a.seq_len else None,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "peak_mib": peak, "base_mib": base, "oom": oom, "device": a.device, "dtype": a.dtype,
                      "attention": a.attention, "loss": a.loss, "notes": notes,
                      **({"profile": STATE.pop("profile")} if "profile" in STATE else {}),
                      **STATE.pop("counted", {})}), flush=True)


def _oom_line(exc: BaseException):
    """The first line of the CUDA out-of-memory error in ``exc``'s chain (compiled code may wrap it), or None.
    A string, so that no reference to the exception (and its frames' tensors) outlives the except block."""
    import torch

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, torch.cuda.OutOfMemoryError) or "CUDA out of memory" in str(exc):
            return (str(exc).strip().splitlines() or [""])[0][:300]
        exc = exc.__cause__ or exc.__context__
    return None


def run(peer: str, main) -> None:
    """Runs a driver's ``main()``: an out-of-memory outside ``each_length`` (building the model) prints the
    JSON line with "oom": true for each length not done and exits 0, any other failure prints one line on
    stderr and exits 1."""
    try:
        main()
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001
        a = STATE.get("args")
        why = _oom_line(exc) if a is not None and a.device == "cuda" else None
        if why is not None:
            print(f"[{peer}] {why}", file=sys.stderr)
            for T in a.seq_lens[STATE.get("done", 0):]:
                set_length(a, T)
                report(peer, a, None, STATE.get("notes", "") + inputs_note(a) + "; CUDA out of memory", oom=True)
            sys.exit(0)
        last = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        where = f" at {last.filename}:{last.lineno}" if last else ""
        fail(f"{peer} step failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
             f"{where}")
