"""Online training at a real target's shape on one GPU: ours against SpecForge's and speculators' own code.

    python -m studies gpu_scale [--target llama3_8b] [--seq-lens 2048,8192,32768,65536,131072]
        [--ways blockwise,flex,sdpa] [--peers specforge,speculators] [--out gpu_scale.json]
    python -m studies gpu_scale --dry-run       (tiny shapes on CPU: the same code, in seconds)

The target has the preset's exact shape with random bf16 weights (no download), built on the GPU. Per row
length T (micro-batch 1): the target's forward with capture and the teacher (``capture s``), then one draft
training step, forward + loss + backward (EAGLE 3.1, draft vocabulary 32k, TTT 7; fp32 master weights under
bf16 autocast, as trainer.precision=bf16 trains): tokens/s and the step's peak memory above its inputs. Every
row is scored (the teacher's argmax counted inside the draft vocabulary), as the peers score every row.

Ways of the TTT attention (draft.ttt_attention): blockwise (query blocks in a Python loop), flex (one
compiled flex-attention kernel per step), sdpa (one SDPA call per step over every step's keys with an
explicit mask: memory quadratic in T), dense, and default (the settings left null, as a run has them: the
device's way, the objective's device_defaults); a way's "+ckpt" recomputes each step in backward
(draft.checkpointing), its "+compile" runs the step's elementwise chains as compiled kernels (draft.compile), its
"+frozen_head" keeps the lm_head frozen (draft.freeze_lm_head=true, speculators' recipe: one product of the step
fewer). The table pairs like with like: our ways that train the lm_head against SpecForge (which trains it), our
"+frozen_head" ways against speculators (which freezes it).
``--packed T``: the default way also on packed rows (conversations of random lengths) at T and two shorter
lengths, each checked and timed, as a run's batches come.
``--real-mix B``: conversations of the bundled data's token lengths (studies/chitchat_lengths.json, drawn at
random), each micro-batch captured through the target and its default-way draft step run, end to end over the same
conversations two ways: one conversation per micro-batch (the scale recipe without a budget) and micro-batches of
up to B tokens packed in one row (trainer.micro_batch_tokens=B); the tokens/s of each and their ratio, and each
way's draft steps alone under the profiler (the device's busy share: does the step still wait on the host?).
Before timing, each way's loss and gradients at the first length are compared with blockwise's (bf16
tolerance): an incorrect way is never the chosen one.

Peers: studies/peers/NAME_step.py run by ``--peer-python`` (with ``--peer-path`` on PYTHONPATH) on the same
captured states (a safetensors file per length), on the GPU with the attention and loss their trainers use
there; a peer that runs out of memory is a row that says so. ``--methods dflash,dspark,dflash2`` times our block
drafts' steps at ``--method-seq-lens``. ``--budget-s``: rows not started by then are reported as not run.
Results go to ``--out`` (JSON, rewritten after every row) and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from specforge_lite.bench.real_shape import TARGETS, build_draft, build_target, capture, packed
from specforge_lite.bench.step_ways import (check_ways, draft_step, head_frozen, replace_attention,
                                            replace_objective, way_options)
from specforge_lite.bench.timing import KERNEL_KINDS, kernel_profile, measure, profile_kernels

# the peers' drivers, run by the peers' own interpreter (scripts/setup_peers.sh, studies/peers/gpu_wheels.sh)
PEER_DRIVERS = Path(__file__).resolve().parent / "peers"

DRY_RUN = dict(target="tiny", seq_lens="64,160",
               ways="blockwise,blockwise+compile,dense,sdpa,default,default+frozen_head",
               draft_vocab=256, methods="dflash,dspark,dflash2", method_seq_lens="64", repeats=1, packed=160,
               real_mix=160, real_mix_max_length=64, real_mix_conversations=6)

# The bundled conversations' token lengths (``--write-lengths`` makes the file), for ``--real-mix``.
LENGTHS = Path(__file__).resolve().parent / "chitchat_lengths.json"


def drawn_lengths(count: int, max_length: int, seed: int, path: Path = LENGTHS) -> list[int]:
    """``count`` conversation lengths drawn at random from ``path``'s, scaled from the data.max_length they were
    cut at to ``max_length`` (a dry run's tiny rows: the same shape of mix)."""
    data = json.loads(path.read_text())
    lengths = torch.tensor([int(n) for n in data["lengths"]])
    weights = torch.tensor([float(c) for c in data["lengths"].values()])
    picked = lengths[torch.multinomial(weights, count, replacement=True, generator=torch.Generator().manual_seed(seed))]
    return [max(2, round(int(n) * max_length / data["max_length"])) for n in picked]


def token_budget_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """The conversations of ``lengths`` in order as a run's token-budget micro-batches group them."""
    from specforge_lite.data.loader import group_ends

    ends = group_ends(lengths, list(range(len(lengths))), budget)
    return [lengths[start:end] for start, end in zip([0, *ends[:-1]], ends)]


def capture_conversations(target, teacher, lengths: list[int], seed: int):
    """One row of conversations of ``lengths`` random tokens (several: packed, positions restarting at each) through
    the target, as a run's micro-batch is captured: UnrollInputs with every row scored."""
    from specforge_lite.draft.objective import DraftObjective, UnrollInputs

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (1, sum(lengths)), generator=g).to(target.device)
    positions = (torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(target.device) if len(lengths) > 1
                 else None)
    loss_mask = torch.ones_like(ids)
    captured = target.capture(ids, None, position_ids=positions)
    logits, in_vocab = teacher(captured, DraftObjective.teacher_positions(loss_mask))
    return UnrollInputs(captured.aux, ids, logits, torch.ones_like(in_vocab), loss_mask, positions)


def write_lengths(path: Path) -> None:
    """The bundled conversations' token lengths under the default preset's tokenizer (offline), cut at the scale
    recipe's data.max_length, as ``drawn_lengths`` reads them."""
    from collections import Counter

    from specforge_lite.compose import load_config
    from specforge_lite.data.loader import conversation_lengths
    from specforge_lite.data.prepare import prepare_data
    from specforge_lite.targets.build import tokenizer_before_target

    config = load_config(["recipe=none", "data.max_length=2048", "data.heldout_samples=0"])
    counts = Counter(conversation_lengths(prepare_data(config.data, tokenizer_before_target(config)).train))
    path.write_text(json.dumps({
        "what": "token lengths of the bundled chitchat conversations (data.source=builtin_chitchat, as written), "
                "each conversation's training sample as data.max_length=2048 cuts it: {length: conversations}",
        "tokenizer": f"{config.model.name}'s (the default preset's, the one offline here)",
        "made_by": f"python -m studies gpu_scale --write-lengths {path}", "date": time.strftime("%Y-%m-%d"),
        "max_length": 2048, "conversations": sum(counts.values()), "lengths": dict(sorted(counts.items()))},
        separators=(",", ":")) + "\n")


def peer_driver(name: str) -> Path:
    """studies/peers/NAME_step.py; a name with no driver is refused in one line naming those there are."""
    path = PEER_DRIVERS / f"{name}_step.py"
    if not path.is_file():
        known = ", ".join(sorted(p.name.removesuffix("_step.py") for p in PEER_DRIVERS.glob("*_step.py")))
        raise SystemExit(f"error: no peer {name!r}: the peers with a driver in studies/peers/ are {known}")
    return path


def peer_shape(name: str) -> dict:
    """The preset's config fields as the peers' drivers take them (``--shape``: rope_theta flat)."""
    fields = dict(TARGETS[name][2])
    rope = fields.pop("rope_parameters")
    return {**fields, "rope_theta": rope["rope_theta"]}


def _oom_row(e: BaseException) -> dict:
    torch.cuda.empty_cache()
    return {"oom": True, "error": str(e).splitlines()[0][:160]}


def peer_lengths(spec: str, peers: list[str]) -> dict[str, list[int]]:
    """``--peer-seq-lens``: "T,T" (every peer at these lengths) or "NAME=T,T;NAME=T" (each peer at its own)."""
    if "=" not in spec:
        return {name: [int(x) for x in spec.split(",") if x] for name in peers}
    per = {name: [int(x) for x in lens.split(",") if x] for name, lens in (part.split("=") for part in spec.split(";"))}
    return {name: per.get(name, []) for name in peers}


def run_peer(name: str, a, lens: list[int], folder: Path, shape: dict, over) -> list[dict]:
    """One row per length: the peer's driver (studies/peers) over ``folder``'s inputs_T.safetensors, in one
    process; a length it did not reach is a row that says why."""
    if not lens:
        return []
    if over():
        return [{"T": T, "skipped": "past --budget-s"} for T in lens]
    cmd = [a.peer_python, str(peer_driver(name)), "--seq-len", ",".join(map(str, lens)),
           "--ttt", str(a.ttt), "--draft-vocab", str(a.draft_vocab), "--repeats", str(a.repeats),
           "--shape", json.dumps(shape), "--inputs", str(folder / "inputs_{T}.safetensors"), "--profile"]
    if a.device == "cuda":
        cmd += ["--device", "cuda", "--dtype", "bfloat16"]
    env = dict(os.environ)
    if a.peer_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (a.peer_path, env.get("PYTHONPATH", "")) if p)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.peer_timeout)
        stdout, why = proc.stdout, None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["?"])[-1]
    except subprocess.TimeoutExpired as e:
        stdout, why = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), \
            f"ran past --peer-timeout {a.peer_timeout:.0f}s"
    done = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            if r.get("peak_mib") is not None:
                r["peak_gib"] = r["peak_mib"] / 1024
            if r.get("profile"):  # (its first length's kernels, as the driver's profiler listed them)
                r["profile"] = kernel_profile(r["profile"]["wall_ms"], r["profile"]["kernels"])
            T = r.pop("seq_len")
            done[T] = {"T": T, **r}
    return [done.get(T) or {"T": T, "error": (why or "no result")[:200]} for T in lens]


def save_inputs(inputs, final_hidden, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"aux": torch.cat(inputs.aux, dim=-1).contiguous().cpu(), "input_ids": inputs.input_ids.cpu(),
               "final_hidden": final_hidden.contiguous().cpu(), "loss_mask": inputs.loss_mask.cpu()}, str(path))


class Results:
    """Rows as they come: printed, and the whole JSON rewritten after each (a run cut short keeps its rows)."""

    def __init__(self, path: str | None, header: dict):
        self.path, self.data = path, {**header, "rows": []}

    def add(self, row: dict) -> None:
        self.data["rows"].append(row)
        print(json.dumps(row), flush=True)
        if self.path:
            Path(self.path).write_text(json.dumps(self.data, indent=1))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m studies gpu_scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, every stage (the CI check)")
    p.add_argument("--target", default="llama3_8b", help=" | ".join(TARGETS))
    p.add_argument("--seq-lens", default="2048,8192,32768,65536,131072")
    p.add_argument("--ways", default="blockwise,flex,flex+compile,flex+ckpt,sdpa",
                   help="TTT attention ways to time (draft.ttt_attention; +ckpt: draft.checkpointing=true; "
                   "+compile: draft.compile=true; +frozen_head: draft.freeze_lm_head=true)")
    p.add_argument("--long-ways", default="flex+ckpt+compile,flex+ckpt", help="the ways timed from --long-from on")
    p.add_argument("--long-from", type=int, default=65536)
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--loss-chunks", default="", help="extra draft.loss_chunk_rows values timed at the first length")
    p.add_argument("--methods", default="dflash,dspark,dflash2", help="block drafts timed too ('' for none)")
    p.add_argument("--method-seq-lens", default="2048,8192")
    p.add_argument("--peers", default="", help="specforge,speculators: their drivers (studies/peers)")
    p.add_argument("--peer-python", default="python3")
    p.add_argument("--peer-path", default="", help="prepended to the peers' PYTHONPATH (their wheels)")
    p.add_argument("--peer-seq-lens", default="2048,8192,32768,65536",
                   help="T,T,... for every peer, or NAME=T,T;NAME=T,... for each")
    p.add_argument("--peer-timeout", type=float, default=300, help="seconds for each peer's process, all lengths")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=0, help="rows not started after this many seconds are skipped")
    p.add_argument("--online-only", action="store_true", help="one way, no check, no peers: a big target's run")
    p.add_argument("--packed", type=int, default=0, help="at this length (one of --seq-lens), the default way on "
                   "packed rows of three lengths, checked and timed")
    p.add_argument("--real-mix", type=int, default=0, metavar="B", help="conversations of the bundled data's "
                   "lengths one per micro-batch against micro-batches of up to B tokens, end to end (0: off)")
    p.add_argument("--real-mix-conversations", type=int, default=96, help="conversations drawn for --real-mix")
    p.add_argument("--real-mix-max-length", type=int, default=2048,
                   help="the lengths scaled to this data.max_length (theirs: 2048)")
    p.add_argument("--write-lengths", default=None, metavar="PATH", help="write the bundled conversations' token "
                   "lengths (what --real-mix draws from) and exit")
    p.add_argument("--out", default=None)
    p.add_argument("--table", default=None, metavar="RESULT.json", help="print the table of a result file and exit")
    a = p.parse_args(argv)
    if a.table:
        print_table(json.loads(Path(a.table).read_text()))
        return
    if a.write_lengths:
        write_lengths(Path(a.write_lengths))
        return
    if a.dry_run:
        for k, v in DRY_RUN.items():
            if p.get_default(k) == getattr(a, k):
                setattr(a, k, v)
    for way in filter(None, f"{a.ways},{a.long_ways}".split(",")):  # (before the target is built: GPU minutes count)
        way_options(way)
    for name in filter(None, a.peers.split(",")):
        peer_driver(name)
    a.device = "cuda" if torch.cuda.is_available() and not a.dry_run else "cpu"
    device = torch.device(a.device)
    autocast = device.type == "cuda"
    if device.type != "cuda":  # flex attention has no backward on CPU
        a.ways, a.long_ways = (",".join(w for w in ways.split(",") if w.split("+")[0] != "flex") or "blockwise"
                               for ways in (a.ways, a.long_ways))
    started = time.perf_counter()
    over = lambda: a.budget_s and time.perf_counter() - started > a.budget_s  # noqa: E731

    from importlib.metadata import version

    gpu = torch.cuda.get_device_name() if device.type == "cuda" else None
    res = Results(a.out, {"target": a.target, "device": gpu or "cpu", "torch": torch.__version__,
                          "transformers": version("transformers"), "ttt": a.ttt, "draft_vocab": a.draft_vocab,
                          "date": time.strftime("%Y-%m-%d"), "command": "python -m studies gpu_scale "
                          + " ".join(argv if argv is not None else __import__("sys").argv[2:])})
    t0 = time.perf_counter()
    target = build_target(a.target, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    draft, cfg, teacher, build_objective = build_draft(target, "eagle3", a.draft_vocab, a.ttt, device)
    res.add({"what": "setup", "seconds": time.perf_counter() - t0, "target_params_b":
             sum(p.numel() for p in target.model.parameters()) / 1e9,
             "draft_trainable_m": sum(p.numel() for p in draft.parameters() if p.requires_grad) / 1e6,
             "aux_layer_ids": target.aux_layer_ids})
    objective = build_objective(cfg)
    shape = peer_shape(a.target)
    run = Run(a, res, device, autocast, target, teacher, over, Path(tempfile.mkdtemp(prefix="gpu_scale_")), shape)
    seq_lens = [int(x) for x in a.seq_lens.split(",")]
    # short rows, the peers on them, then the long rows and the peers there: a run cut short has the comparison
    for group in ([T for T in seq_lens if T < a.long_from], [T for T in seq_lens if T >= a.long_from]):
        for T in group:
            if not run.ours_at(T, draft, objective, first=T == seq_lens[0]):
                break  # the target's own forward ran out of memory: longer rows cannot run either
        run.peers_at(group)
    if a.real_mix and not a.online_only:
        run.real_mix(draft, objective)
    del draft
    for name in filter(None, a.methods.split(",")):
        run.block_draft(name, build_draft(target, name, a.draft_vocab, a.ttt, device), build_objective)
    print_table(res.data)


class Run:
    """What the phases of one benchmark share: settings, results, the target and teacher, the clock, and the
    folder of captured rows handed to the peers."""

    def __init__(self, a, res, device, autocast, target, teacher, over, folder: Path, shape: dict):
        self.a, self.res, self.device, self.autocast = a, res, device, autocast
        self.target, self.teacher, self.over, self.folder, self.shape = target, teacher, over, folder, shape
        self.ways = [w for w in a.ways.split(",") if w]
        self.peers = [x for x in a.peers.split(",") if x]
        self.peer_lens = peer_lengths(a.peer_seq_lens, self.peers)

    def ours_at(self, T: int, draft, objective, first: bool) -> bool:
        """Capture one row of T tokens, then time our draft step on it in each way (at the first length: each
        way checked against blockwise first, and the loss chunk sizes); False if the capture ran out of memory."""
        a, res, device, autocast = self.a, self.res, self.device, self.autocast
        if self.over():
            res.add({"what": "ours", "T": T, "skipped": "past --budget-s"})
            return True
        try:
            inputs, final_hidden = capture(self.target, self.teacher, T, seed=T)
            cap = measure(lambda: capture(self.target, self.teacher, T, seed=T), device, 1, warm_up=False)
        except torch.cuda.OutOfMemoryError as e:
            res.add({"what": "capture", "T": T, **_oom_row(e)})
            return False
        res.add({"what": "capture", "T": T, "seconds": cap["seconds"], "tokens_per_s": T / cap["seconds"],
                 "peak_gib": cap["peak_gib"]})
        if first and not a.online_only:
            res.add({"what": "check", "T": T, "against": "blockwise in fp32", "ways": check_ways(
                draft, objective, inputs, [w for w in self.ways if w != "blockwise"], autocast)})
            for rows in [int(x) for x in a.loss_chunks.split(",") if x]:
                way = "flex" if "flex" in self.ways else "blockwise"
                _time_way(res, draft, replace_objective(replace_attention(objective, way), loss_chunk_rows=rows),
                          inputs, device, autocast, a.repeats, T, way, cap, chunk=rows)
        long = T >= a.long_from  # (one timed step: a long row's step takes seconds)
        for way in (a.long_ways.split(",") if long else self.ways)[: 1 if a.online_only else None]:
            _time_way(res, draft, replace_attention(objective, way), inputs, device, autocast,
                      1 if long else a.repeats, T, way, cap, profile=first and not a.online_only)
        if T == a.packed and not a.online_only:
            self.packed_at(T, draft, objective, inputs)
        if any(T in lens for lens in self.peer_lens.values()):  # the peers run on these very states
            save_inputs(inputs, final_hidden, self.folder / f"inputs_{T}.safetensors")
        return True

    def packed_at(self, T: int, draft, objective, inputs) -> None:
        """The run's default step (``default`` way) on packed rows at three lengths up to ``T`` (a run's
        batches differ in length: compiled kernels must follow), each checked against the fp32 reference on
        the same rows, then timed."""
        for length in (T, T - T // 8 - 3, T - T // 4 - 5):
            rows, conversations = packed(inputs, length, seed=length)
            row = {"what": "packed", "T": length, "way": "default", "conversations": conversations}
            try:
                verdict = check_ways(draft, objective, rows, ["default"], self.autocast)["default"]
                r = measure(draft_step(draft, replace_attention(objective, "default"), rows, self.autocast),
                            self.device, self.a.repeats)
            except torch.cuda.OutOfMemoryError as e:
                draft.zero_grad(set_to_none=True)
                self.res.add({**row, **_oom_row(e)})
                continue
            self.res.add({**row, **verdict, **r, "tokens_per_s": length / r["seconds"]})

    def real_mix(self, draft, objective) -> None:
        """``--real-mix B``: the same drawn conversations one per micro-batch, then in micro-batches of up to B
        tokens, each pass over all of them timed end to end (captures and default-way draft steps); one row each,
        the budget's with its ratio to one per micro-batch."""
        a = self.a
        lengths = drawn_lengths(a.real_mix_conversations, a.real_mix_max_length, seed=0)
        step_objective = replace_attention(objective, "default")
        tokens, single = sum(lengths), None
        for way, batches in (("one_per_micro_batch", [[n] for n in lengths]),
                             ("token_budget", token_budget_groups(lengths, a.real_mix))):
            if self.over():
                self.res.add({"what": "real_mix", "way": way, "budget": a.real_mix, "skipped": "past --budget-s"})
                continue

            def epoch(batches=batches):
                for i, group in enumerate(batches):
                    draft_step(draft, step_objective, capture_conversations(self.target, self.teacher, group, i),
                               self.autocast)()

            row = {"what": "real_mix", "way": way, "budget": a.real_mix, "conversations": len(lengths),
                   "micro_batches": len(batches), "tokens": tokens, "max_length": a.real_mix_max_length}
            try:
                # (a warm-up pass compiles every length on a GPU; the CPU's default way compiles nothing)
                r = measure(epoch, self.device, self.a.repeats, warm_up=self.device.type == "cuda")
            except torch.cuda.OutOfMemoryError as e:
                draft.zero_grad(set_to_none=True)
                self.res.add({**row, **_oom_row(e)})
                continue
            row.update(r, tokens_per_s=tokens / r["seconds"])
            row["steps_profile"] = self.steps_profile(draft, step_objective, batches)
            if way == "one_per_micro_batch":
                single = row["tokens_per_s"]
            elif single:
                row["ratio_to_one_per_micro_batch"] = row["tokens_per_s"] / single
            self.res.add(row)

    def steps_profile(self, draft, objective, batches: list[list[int]]) -> dict:
        """The draft steps of one pass over ``batches`` alone (captured beforehand) under the profiler: whether
        the device still waits on the host there (its busy share of the wall: the profiler's own cost makes it a
        lower bound), which decides whether CUDA graphs over length buckets are worth building."""
        try:
            captured = [capture_conversations(self.target, self.teacher, group, i) for i, group in enumerate(batches)]
            steps = [draft_step(draft, objective, inputs, self.autocast) for inputs in captured]
            return profile_kernels(lambda: [step() for step in steps], self.device)
        except Exception as e:  # noqa: BLE001 (the timing stands without it: out of memory, the profiler's own)
            draft.zero_grad(set_to_none=True)
            return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}

    def peers_at(self, lens: list[int]) -> None:
        """Each peer in its own process, one for all these lengths (its compiles paid once), on the saved rows."""
        lens = [T for T in lens if (self.folder / f"inputs_{T}.safetensors").exists()]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        for name in self.peers:
            for row in run_peer(name, self.a, [T for T in lens if T in self.peer_lens[name]], self.folder, self.shape,
                                self.over):
                self.res.add({"what": name, **row})
        for T in lens:
            (self.folder / f"inputs_{T}.safetensors").unlink()

    def block_draft(self, name: str, built, build_objective) -> None:
        block, cfg, teacher, _ = built  # (its own teacher: DFlash 2 keeps the whole vocabulary)
        objective = build_objective(cfg)
        for T in [int(x) for x in self.a.method_seq_lens.split(",")]:
            if self.over():
                self.res.add({"what": name, "T": T, "skipped": "past --budget-s"})
                continue
            try:
                inputs, _ = capture(self.target, teacher, T, seed=T)
                r = measure(draft_step(block, objective, inputs, self.autocast), self.device, self.a.repeats)
                self.res.add({"what": name, "T": T, **r, "tokens_per_s": T / r["seconds"]})
            except torch.cuda.OutOfMemoryError as e:
                self.res.add({"what": name, "T": T, **_oom_row(e)})


def _time_way(res, draft, objective, inputs, device, autocast, repeats, T, way, cap, chunk=None, profile=False):
    """One row: the draft step in ``way``, timed (and with ``profile``, one more step under the profiler)."""
    row = {"what": "ours", "T": T, "way": way, **({"loss_chunk_rows": chunk} if chunk else {})}
    step = draft_step(draft, objective, inputs, autocast, way)
    try:
        r = measure(step, device, repeats)
    except torch.cuda.OutOfMemoryError as e:
        draft.zero_grad(set_to_none=True)
        res.add({**row, **_oom_row(e)})
        return
    except Exception as e:  # noqa: BLE001 (a way that fails here is a row that says so, not the end of the run)
        draft.zero_grad(set_to_none=True)
        res.add({**row, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
        return
    if profile:
        try:
            r["profile"] = profile_kernels(step, device)
        except Exception as e:  # noqa: BLE001 (the timing stands without it)
            r["profile"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        draft.zero_grad(set_to_none=True)
    online = cap["seconds"] + r["seconds"]
    res.add({**row, **r, "tokens_per_s": T / r["seconds"], "online_tokens_per_s": T / online})


def print_table(data: dict) -> None:
    print("\n" + tables_markdown(data))


def tables_markdown(data: dict) -> str:
    """A result file's tables: per length (table_markdown), the real-length mix, the profiled steps."""
    return "\n\n".join(filter(None, [table_markdown(data), real_mix_markdown(data["rows"]),
                                      profiles_markdown(data["rows"])]))


# Like for like: each peer against the way that trains what it trains. SpecForge trains the lm_head, as our
# default does; speculators freezes it, as our "+frozen_head" does (one weight-gradient product fewer).
PAIRS = (("specforge", False, "ours / specforge (both train the head)"),
         ("speculators", True, "ours +frozen_head / speculators (both freeze it)"))


def table_markdown(data: dict) -> str:
    """The Markdown table of a result file: per length, the draft step's tokens/s and peak of each way and
    peer, and per peer (PAIRS) the fastest of our ways the check found correct that trains what that peer
    trains, against it."""
    rows = data["rows"]
    check = next((r["ways"] for r in rows if r.get("what") == "check"), {})

    def counted(way: str, frozen: bool) -> bool:  # (correct, and training exactly the weights the peer trains)
        correct = way.split("+")[0] == "blockwise" or check.get(way, {}).get("correct", False)
        return correct and head_frozen(way) == frozen

    cols = sorted({(r["what"], r.get("way", "")) for r in rows if "T" in r and r["what"] not in ("capture", "check")
                   and not r.get("loss_chunk_rows")}, key=lambda c: (c[0] != "ours", c))
    lines = [f"{data['device']}, target {data['target']} (random weights), TTT {data['ttt']}, draft vocab "
             f"{data['draft_vocab']}, micro-batch 1; draft step = forward + loss + backward, tokens/s (peak GiB)",
             "",
             "| T | capture tok/s | " + " | ".join(f"{w} {x}".strip() for w, x in cols) + " | "
             + " | ".join(title for _, _, title in PAIRS) + " |",
             "|---" * (len(cols) + 2 + len(PAIRS)) + "|"]
    for T in sorted({r["T"] for r in rows if "T" in r}):
        at = {(r["what"], r.get("way", "")): r for r in rows if r.get("T") == T and not r.get("loss_chunk_rows")}
        cap = at.get(("capture", ""), {})
        cells = [_cell(at.get(c)) for c in cols]
        ratios = []
        for peer, frozen, _ in PAIRS:
            ours = max((r["tokens_per_s"] for (w, x), r in at.items() if w == "ours" and "tokens_per_s" in r
                        and counted(x, frozen)), default=None)
            theirs = at.get((peer, ""), {})
            theirs = theirs.get("tokens_per_s") if not theirs.get("oom") else None
            ratios.append(f"{ours / theirs:.2f}x" if ours and theirs else "")
        capture = f"{cap['tokens_per_s']:.0f}" if "tokens_per_s" in cap else _cell(cap or None)
        lines.append(f"| {T} | {capture} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def real_mix_markdown(rows: list[dict]) -> str:
    """``--real-mix``: the bundled data's conversations one per micro-batch against token-budget micro-batches,
    captures and draft steps end to end."""
    mixed = [r for r in rows if r.get("what") == "real_mix"]
    if not mixed:
        return ""
    lines = ["Bundled conversations' lengths, captured and trained end to end: one per micro-batch against "
             "micro-batches of a token budget", "",
             "| micro-batches | budget | conversations | micro-batch count | tokens | tokens/s (peak GiB) | ratio "
             "| draft steps: device busy |",
             "|---|---|---|---|---|---|---|---|"]
    for r in mixed:
        ratio, prof = r.get("ratio_to_one_per_micro_batch"), r.get("steps_profile", {})
        busy = f"{prof['busy_ms'] / prof['wall_ms']:.0%}" if prof.get("wall_ms") else prof.get("error", "")
        lines.append(f"| {r['way']} | {r['budget'] if r['way'] == 'token_budget' else ''} | "
                     f"{r.get('conversations', '')} | {r.get('micro_batches', '')} | {r.get('tokens', '')} | "
                     f"{_cell(r)} | {f'{ratio:.2f}x' if ratio else ''} | {busy} |")
    return "\n".join(lines)


def profiles_markdown(rows: list[dict]) -> str:
    """Where one step's time went, per profiled row: wall ms, the device's share of it, ms by kind of kernel."""
    profiled = [r for r in rows if r.get("profile", {}).get("by_kind_ms")]
    if not profiled:
        return ""
    kinds = [k for k, _ in KERNEL_KINDS] + ["elementwise"]
    lines = ["One step under the profiler: wall ms, device busy, ms by kind of kernel", "",
             "| step | T | wall ms | busy | " + " | ".join(kinds) + " |",
             "|---" * (len(kinds) + 4) + "|"]
    for r in profiled:
        prof = r["profile"]
        who = f"{r['what']} {r.get('way', '')}".strip()
        lines.append(f"| {who} | {r['T']} | {prof['wall_ms']:.1f} | {prof['busy_ms'] / prof['wall_ms']:.0%} | "
                     + " | ".join(f"{prof['by_kind_ms'].get(k, 0):.1f}" for k in kinds) + " |")
    return "\n".join(lines)


def _cell(r: dict | None) -> str:
    if r is None:
        return ""
    if r.get("oom"):
        return "out of memory"
    if r.get("skipped"):
        return r["skipped"]
    if r.get("correct") is False:
        return "incorrect"
    if r.get("error"):  # (a peer's process cut at --peer-timeout is no failure of its code)
        return "past --peer-timeout" if r["error"].startswith("ran past --peer-timeout") else "failed"
    peak = r.get("peak_gib")
    return f"{r['tokens_per_s']:.0f}" + (f" ({peak:.1f})" if peak else "")


if __name__ == "__main__":
    main()
