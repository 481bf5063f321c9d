"""What both peer training drivers share: their arguments, one of our hidden-state stores and a schedule read
back without specforge_lite, the training loop with its timing, and the metrics.jsonl lines.

A driver trains an EAGLE3 draft with a peer's own code (SpecForge 0.2.0 or speculators 0.9.0: its model
classes, loss, optimizer and scheduler at its defaults) on OUR batches, so that every recipe sees the same
samples in the same order, and exports the draft with the peer's own save code. It runs in the peers' venv
(scripts/setup_peers.sh), where specforge_lite is not installed: the store is read here with safetensors and
json only (its layout: specforge_lite/targets/store.py).

    --store DIR        a hidden-state store (manifest.json, target_parts.safetensors, shard_XXXXX.safetensors)
    --schedule FILE    {"batches": [[i, j, ...], ...]}: store sample indices, one list per optimizer step
    --target DIR       the target's HF folder (config.json + safetensors): the peer reads its weights from it
    --out DIR          the export folder (the peer's own format; vLLM loads it)
    --metrics FILE     metrics.jsonl, one JSON line appended per step
    --steps N | --minutes M   the schedule's first N batches, or as many as fit in M minutes (timed first)

A driver implements ``build(total_steps) -> Session`` (a fresh model, optimizer and scheduler from the seed)
where the session has ``step(rows) -> dict`` (loss, lr and extras; rows as ``Store.rows`` gives them) and
``export(out) -> dict`` (what was written); ``run`` does the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import random
import statistics
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
# specforge.utils picks its device from this first; pin it to the CPU these drivers run on
os.environ.setdefault("SPECFORGE_DEVICE", "cpu")

STORE_FORMAT, STORE_VERSION = "specforge_lite.store", 1


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", required=True, help="hidden-state store folder (python -m specforge_lite.offline dump)")
    p.add_argument("--schedule", required=True, help='JSON {"batches": [[sample indices], ...]}, one list per step')
    p.add_argument("--target", required=True, help="the target model's HF folder (config.json + safetensors)")
    p.add_argument("--out", required=True, help="export folder to write")
    p.add_argument("--metrics", required=True, help="metrics.jsonl to append one line per step to")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--steps", type=int, help="optimizer steps: the schedule's first N batches")
    budget.add_argument("--minutes", type=float, help="wall-time budget: the steps that fit (timed first)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    return a


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---- the store ---------------------------------------------------------------------------------------------
class StoreError(RuntimeError):
    pass


class Store:
    """Samples of a hidden-state store by index (shards walked in manifest order), its target parts, its
    draft vocabulary and the teacher's final norm."""

    def __init__(self, folder: str):
        from safetensors import safe_open

        self.folder = Path(folder).expanduser()
        path = self.folder / "manifest.json"
        if not path.is_file():
            raise StoreError(f"{self.folder} is not a hidden-state store (no manifest.json)")
        m = json.loads(path.read_text())
        if m.get("format") != STORE_FORMAT or m.get("version") != STORE_VERSION:
            raise StoreError(f"{path}: format {m.get('format')} v{m.get('version')}, expected {STORE_FORMAT} "
                             f"v{STORE_VERSION}")
        if m.get("teacher", "final") != "final":
            raise StoreError(f"{self.folder} keeps a top-k teacher (store.teacher={m['teacher']}); the peers need the "
                             "final hidden state: dump with store.teacher=final")
        if m.get("convention") != "input_of_layer":
            raise StoreError(f"{self.folder}: aux ids in convention {m.get('convention')!r}, expected 'input_of_layer'")
        self.manifest = m
        self.aux_layer_ids = list(m["aux_layer_ids"])
        self.num_layers, self.hidden_size = m["num_layers"], m["hidden_size"]
        self.vocab_size, self.draft_vocab_size = m["vocab_size"], m["draft_vocab_size"]
        self.target_config = m["target_config"]
        self._index: list[tuple[int, int]] = []
        for s, shard in enumerate(m["shards"]):
            self._index += [(s, r) for r in range(shard["samples"])]
        self._open: dict[int, object] = {}
        self._offsets: dict[int, list[int]] = {}
        with safe_open(str(self.folder / "target_parts.safetensors"), framework="pt") as f:
            self.parts = {k: f.get_tensor(k) for k in f.keys()}
        self._norm = None

    def __len__(self) -> int:
        return len(self._index)

    def _shard(self, s: int):
        from safetensors import safe_open

        if s not in self._open:
            path = self.folder / self.manifest["shards"][s]["file"]
            if not path.is_file():
                raise StoreError(f"store shard {path} is missing (listed in manifest.json)")
            self._open[s] = safe_open(str(path), framework="pt")
            self._offsets[s] = self._open[s].get_tensor("offsets").tolist()
        return self._open[s], self._offsets[s]

    def sample(self, i: int) -> dict:
        """Sample i: input_ids [T] long, loss_mask [T] long, aux [T, n_aux, H] and final [T, H] (the last
        layer's PRE-norm state) in float32, in_vocab [T] bool."""
        if not 0 <= i < len(self._index):
            raise StoreError(f"sample {i} is out of range: the store holds {len(self._index)} samples")
        s, r = self._index[i]
        f, offsets = self._shard(s)
        a, b = offsets[r], offsets[r + 1]
        row = {k: f.get_slice(k)[a:b] for k in ("input_ids", "loss_mask", "aux", "final", "in_vocab")}
        return {"index": i, "input_ids": row["input_ids"].long(), "loss_mask": row["loss_mask"].long(),
                "aux": row["aux"].float(), "final": row["final"].float(), "in_vocab": row["in_vocab"].bool()}

    def rows(self, indices) -> list[dict]:
        return [self.sample(int(i)) for i in indices]

    # ---- the target's parts the peers share --------------------------------------------------------------
    def vocab_maps(self):
        """(t2d [V] bool, d2t [Vd] int64) of the store's draft vocabulary: target id = draft id + d2t[draft id]."""
        import torch

        d2t = self.parts["d2t"].long()
        ids = torch.arange(d2t.numel()) + d2t
        t2d = torch.zeros(self.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        if int(t2d.sum()) != self.draft_vocab_size or not torch.all(ids[1:] > ids[:-1]):
            raise StoreError("the store's d2t does not describe an ascending draft vocabulary of "
                             f"{self.draft_vocab_size} tokens")
        return t2d, d2t

    def final_norm(self):
        """The target's own final-norm module (its class from transformers, built on the meta device from the
        stored config, so Gemma's (1+w) norms come out right), holding the stored weights, fp32."""
        if self._norm is None:
            import torch

            state = {k.removeprefix("final_norm."): v.float() for k, v in self.parts.items()
                     if k.startswith("final_norm.")}
            norm = None
            try:
                import transformers
                from transformers import AutoConfig, AutoModelForCausalLM

                cfg = AutoConfig.for_model(**self.target_config)
                arch = next((getattr(transformers, a) for a in (cfg.architectures or []) if hasattr(transformers, a)),
                            None)
                with torch.device("meta"):
                    meta = arch(cfg) if arch is not None else AutoModelForCausalLM.from_config(cfg)
                base = getattr(meta, "model", meta)
                for owner in (base, getattr(base, "language_model", None)):
                    module = getattr(owner, "norm", None) if owner is not None else None
                    if module is not None and set(module.state_dict()) == set(state):
                        norm = copy.deepcopy(module).to_empty(device="cpu")
                        norm.load_state_dict(state)
                        break
            except Exception as e:  # noqa: BLE001 (an architecture this transformers lacks: the plain norm below)
                log(f"[store] the target's norm class could not be built ({type(e).__name__}: {e}); plain RMSNorm")
            if norm is None:
                eps = float(self.target_config.get("rms_norm_eps", 1e-6))
                weight = state["weight"]

                def norm(x):
                    x32 = x.float()
                    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
            else:
                norm = norm.float().eval()
                for p in norm.parameters():
                    p.requires_grad_(False)
            self._norm = norm
        return self._norm

    def check_target(self, embedding, head_rows, final_norm_weight=None, who: str = "") -> None:
        """Fail when the weights a peer read from --target are not the ones the store was dumped from."""

        checks = [("embedding", embedding, self.parts["embedding"]), ("draft rows of the lm_head", head_rows,
                                                                      self.parts["draft_rows"])]
        if final_norm_weight is not None and "final_norm.weight" in self.parts:
            checks.append(("final norm", final_norm_weight, self.parts["final_norm.weight"]))
        for name, ours, stored in checks:
            ours, stored = ours.detach().float().cpu(), stored.float()
            if ours.shape != stored.shape:
                raise StoreError(f"{who}: the target's {name} has shape {tuple(ours.shape)}, the store's "
                                 f"{tuple(stored.shape)}: --target is not the model the store was dumped from")
            err = (ours - stored).abs().max().item()
            scale = stored.abs().max().item() or 1.0
            if err > 1e-2 * scale:  # (bf16 stores round the parts: 2**-8 relative)
                raise StoreError(f"{who}: the target's {name} differs from the store's (max |diff| {err:.3g} at "
                                 f"scale {scale:.3g}): --target is not the model the store was dumped from")


def load_schedule(path: str, store: Store) -> list[list[int]]:
    data = json.loads(Path(path).read_text())
    batches = data["batches"] if isinstance(data, dict) else data
    if not batches or not all(isinstance(b, list) and b for b in batches):
        raise StoreError(f"{path}: expected {{\"batches\": [[sample indices], ...]}} with non-empty batches")
    bad = sorted({i for b in batches for i in b if not 0 <= int(i) < len(store)})
    if bad:
        raise StoreError(f"{path}: sample indices {bad[:10]} are outside the store's {len(store)} samples")
    return [[int(i) for i in b] for b in batches]


def real_tokens(rows: list[dict]) -> int:
    return sum(int(r["input_ids"].numel()) for r in rows)


# ---- the loop ----------------------------------------------------------------------------------------------
def _plain(v):
    import torch

    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else [float(x) for x in v.flatten()]
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def run(peer: str, a: argparse.Namespace, store: Store, batches: list[list[int]], build) -> None:
    """Train with ``build``'s sessions on the schedule (``--steps`` or ``--minutes``) and export."""
    from importlib.metadata import version

    if a.steps is not None:
        if a.steps < 1 or a.steps > len(batches):
            raise SystemExit(f"--steps {a.steps}: the schedule has {len(batches)} batches")
        steps, deadline = a.steps, None
    else:
        steps, deadline = probe_steps(peer, a, store, batches, build), a.minutes * 60.0
    seed_everything(a.seed)
    session = build(steps)
    metrics = Path(a.metrics)
    metrics.parent.mkdir(parents=True, exist_ok=True)
    log(f"[{peer}] training {steps} steps" + (f" (budget {a.minutes} min)" if deadline else ""))
    t_start, done, losses = time.perf_counter(), 0, []
    with metrics.open("a") as fh:
        for k in range(steps):
            t0 = time.perf_counter()
            rows = store.rows(batches[k])
            t_read = time.perf_counter() - t0
            out = session.step(rows)
            dt = time.perf_counter() - t0
            elapsed = time.perf_counter() - t_start
            tokens = real_tokens(rows)
            loss = float(out.pop("loss"))
            losses.append(loss)
            line = {"peer": peer, "step": k + 1, "loss": loss, "lr": _plain(out.pop("lr")),
                    "tokens_per_s": tokens / dt, "elapsed_s": elapsed, "tokens": tokens, "step_s": dt,
                    "read_s": t_read, **{key: _plain(v) for key, v in out.items()}}
            fh.write(json.dumps(line) + "\n")
            fh.flush()
            done = k + 1
            if not math.isfinite(loss):
                raise SystemExit(f"[{peer}] step {k + 1}: loss {loss} is not finite")
            if k == 0 or (k + 1) % 10 == 0 or k + 1 == steps:
                log(f"[{peer}] step {k + 1}/{steps} loss {loss:.4f} lr {line['lr']} {tokens / dt:.0f} tok/s "
                    f"elapsed {elapsed:.1f}s")
            if deadline is not None and elapsed >= deadline and k + 1 < steps:
                log(f"[{peer}] the {a.minutes}-minute budget ran out after {k + 1} of {steps} steps: stopping")
                break
    train_s = time.perf_counter() - t_start
    with contextlib.redirect_stdout(sys.stderr):  # (stdout keeps one line: the summary below)
        written = session.export(a.out)
    print(json.dumps({"peer": peer, "version": version(peer), "steps": done, "planned_steps": steps,
                      "train_s": train_s, "first_loss": losses[0], "last_loss": losses[-1], "out": str(a.out),
                      "metrics": str(metrics), **written}), flush=True)


def probe_steps(peer: str, a: argparse.Namespace, store: Store, batches: list[list[int]], build) -> int:
    """--minutes: time 3 steps after a warm-up on the schedule's first batches (a throwaway model), and
    return the steps whose mean time fits the budget (at most the schedule's length)."""
    n_probe = min(4, len(batches))
    seed_everything(a.seed)
    session = build(max(n_probe, 2))
    times = []
    for k in range(n_probe):
        t0 = time.perf_counter()
        session.step(store.rows(batches[k]))
        times.append(time.perf_counter() - t0)
    del session
    timed = times[1:] or times
    per_step = statistics.mean(timed)
    steps = max(1, int(a.minutes * 60.0 / per_step))
    log(f"[{peer}] probe: warm-up {times[0]:.2f}s, steps {[round(t, 3) for t in timed]}s -> {per_step:.3f}s/step")
    if steps > len(batches):
        log(f"[{peer}] {steps} steps would fit in {a.minutes} min; the schedule has {len(batches)}: taking those")
        steps = len(batches)
    print(f"[{peer}] chosen step count for {a.minutes} min: {steps}", file=sys.stderr, flush=True)
    return steps
