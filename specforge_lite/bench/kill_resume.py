"""Kill torture: a tiny training run killed with SIGKILL at random moments and resumed each time must end
bit-equal to the same run left alone, and no listing of its checkpoints/ may ever show a folder that
fails to load.

    python -m specforge_lite.bench kill_resume [--kills 10] [--steps 12] [--seed 0] [--out DIR] [overrides]

Every run is ``python train.py`` in its own process group (as a user's run is), with a checkpoint at
every step and only the newest kept, so most moments of the run are spent inside a checkpoint write or
a prune. Every other kill waits for a checkpoint write to begin (a ``.tmp-step_*`` folder) and lands
inside it; the others land at a uniform random moment of the run. After each kill every folder under
checkpoints/ is loaded (weights, state, optimizer), then the run is started again with resume=auto;
after the last kill it runs to the end. Compared with the uninterrupted run: the final checkpoint's
weights and optimizer state, tensor by tensor, for bit equality.

``--full-disk N`` adds N trials of a disk that fills up under the run: the killed run's folder is a small
tmpfs of its own (mounting one needs root), and at a random moment (every other trial: as a checkpoint write
begins) another file takes every free byte. The run must stop by itself with a one-line ``error:`` naming the
path and exit non-zero, with no traceback and no unloadable checkpoint listed; the space is then freed and
the same command resumes it.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN = ["model=llama3_tiny", "recipe=none", "tracker=none", "data.max_length=96", "data.max_samples=24",
       "data.heldout_samples=4", "draft.draft_vocab_size=49152", "draft.ttt_length=3", "trainer.save_every=1",
       "trainer.keep_checkpoints=1", "trainer.progress_bar=false", "trainer.precision=fp32", "trainer.lr=1e-3",
       "trainer.micro_batch_size=2", "eval.enabled=false"]


def _command(out: Path, steps: int, overrides: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), *RUN, f"trainer.max_steps={steps}", *overrides, f"output_dir={out}"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _finish(cmd: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def check_listing(run_dir: Path) -> list[str]:
    """Load every published checkpoint folder; the names of those that fail, with why."""
    from ..records import checkpoint_root, load_checkpoint
    from ..training.optimizer_state import OptimizerState

    bad = []
    for folder in sorted(checkpoint_root(run_dir).glob("step_*")):
        try:
            load_checkpoint(folder)
            OptimizerState.load(folder)
        except Exception as e:  # noqa: BLE001  (any failure is the finding)
            bad.append(f"{folder.name}: {type(e).__name__}: {e}")
    return bad


def _kill_once(cmd: list[str], run_dir: Path, duration: float, during_write: bool, rng: random.Random) -> dict:
    """Start the run, kill its process group at the chosen moment; what the kill hit."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    root = run_dir / "checkpoints"
    deadline = time.perf_counter() + (2 * duration if during_write else rng.uniform(0.3, 1.0) * duration)
    while time.perf_counter() < deadline and proc.poll() is None:
        if during_write and any(root.glob(".tmp-step_*")):
            time.sleep(rng.uniform(0, 0.02))
            break
        time.sleep(0.002)
    writing = any(root.glob(".tmp-step_*"))
    finished = proc.poll() is not None
    if not finished:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return {"finished": finished, "during_write": writing and not finished}


def _mount_small_disk(folder: Path, megabytes: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(folder)],
                              capture_output=True, text=True)
    except FileNotFoundError:  # (no mount command)
        proc = subprocess.CompletedProcess([], 127, "", "no mount command")
    if proc.returncode != 0:
        raise SystemExit(f"error: --full-disk mounts a {megabytes} MiB tmpfs at {folder} to fill, which needs root "
                         f"(mount said: {proc.stderr.strip() or proc.returncode}); run without --full-disk")


def _fill(folder: Path) -> Path:
    """Take every free byte of the disk holding ``folder``."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for chunk in (1 << 20, 4096, 1):  # then the last partial megabyte, and its last bytes
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def _fill_once(cmd: list[str], run_dir: Path, duration: float, during_write: bool, rng: random.Random) -> dict:
    """Start the run, fill its disk at the chosen moment, let it stop by itself; what it said."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    root = run_dir / "checkpoints"
    deadline = time.perf_counter() + (2 * duration if during_write else rng.uniform(0.3, 1.0) * duration)
    while time.perf_counter() < deadline and proc.poll() is None:
        if during_write and any(root.glob(".tmp-step_*")):
            break
        time.sleep(0.002)
    filler = _fill(run_dir) if proc.poll() is None else None
    try:
        _, err = proc.communicate(timeout=4 * duration + 60)
    except subprocess.TimeoutExpired:  # a run that neither stops nor fails on a full disk is the finding
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        err += "\n(hung on the full disk: killed)"
    if filler is not None:
        filler.unlink()
    said = [line for line in err.splitlines() if line.strip()]
    return {"finished": proc.returncode == 0, "rc": proc.returncode,
            "error": next((line for line in said if line.startswith("error:")), None),
            "traceback": "Traceback (most recent call last)" in err, "tail": said[-3:]}


def _full_disk_trials(trials: int, cmd: list[str], run_dir: Path, duration: float, rng: random.Random,
                      log) -> tuple[list[dict], list[str], int]:
    """(what each filled run said, unloadable listings, restarts after a run finished before its disk filled)."""
    said, bad, finished_early = [], [], 0
    while len(said) < trials:
        what = _fill_once(cmd, run_dir, duration, during_write=len(said) % 2 == 0, rng=rng)
        if what["finished"]:  # the run ended before the disk filled: start it over to keep filling
            finished_early += 1
            _clear(run_dir)
            continue
        said.append(what)
        bad += check_listing(run_dir)
        log(f"[kill_resume] full disk {len(said)}/{trials}: exit {what['rc']}; "
            f"{what['error'] or 'NO error: line'}{'; TRACEBACK' if what['traceback'] else ''}")
    return said, bad, finished_early


def _folder_megabytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) >> 20


def torture(kills: int, steps: int, seed: int, out: Path, overrides: list[str], log=print,
            full_disk: int = 0) -> dict:
    """The uninterrupted run, then the killed-and-resumed one; the comparison and what the kills hit."""
    from ..records import latest_checkpoint

    rng = random.Random(seed)
    straight, killed = out / "straight", out / "killed"
    duration = _finish(_command(straight, steps, overrides))
    log(f"[kill_resume] uninterrupted run: {steps} steps in {duration:.1f} s")
    cmd = _command(killed, steps, overrides)
    said, full_disk_differ, bad, finished_early = [], [], [], 0
    if full_disk:  # room for the run and three checkpoints; the filler takes the rest when it comes
        _mount_small_disk(killed, 3 * _folder_megabytes(straight) + 16)
        said, bad, finished_early = _full_disk_trials(full_disk, cmd, killed, duration, rng, log)
        _finish(cmd)  # resumed to the end once there is room: it must end where the uninterrupted run did
        full_disk_differ = _compare(straight, killed)[1]
        _clear(killed)  # (the kills then start from a fresh run, as without full disks)
    done, hit_writes = 0, 0
    while done < kills:
        what = _kill_once(cmd, killed, duration, during_write=done % 2 == 0, rng=rng)
        if what["finished"]:  # the run ended before the kill: start it over to keep killing
            finished_early += 1
            _clear(killed)
            continue
        done += 1
        hit_writes += what["during_write"]
        bad += check_listing(killed)
        latest = latest_checkpoint(killed)
        log(f"[kill_resume] kill {done}/{kills}: {'inside a checkpoint write' if what['during_write'] else 'between'}"
            f"; newest checkpoint {latest.name if latest else 'none'}")
    _finish(cmd)
    final_steps, differ = _compare(straight, killed)
    return {"kills": done, "inside_checkpoint_writes": hit_writes, "unloadable_listings": bad,
            "final_steps": final_steps, "differing_tensors": differ, "restarts_after_finishing": finished_early,
            "full_disk": said, "full_disk_differing_tensors": full_disk_differ}


def _compare(straight: Path, resumed: Path) -> tuple[list[str], list[str]]:
    """(the two final checkpoints' names, the tensors of weights and optimizer state that differ)."""
    from safetensors.torch import load_file

    from ..records import latest_checkpoint
    from ..training.optimizer_state import TENSORS

    a, b = latest_checkpoint(straight), latest_checkpoint(resumed)
    differ = []
    for name in ("draft.safetensors", TENSORS):
        x, y = load_file(str(a / name)), load_file(str(b / name))
        differ += [f"{name}:{k}" for k in x if k not in y or not bool((x[k] == y[k]).all())]
        differ += [f"{name}:{k} (missing)" for k in y if k not in x]
    return [a.name, b.name], differ


def _clear(folder: Path) -> None:
    for child in folder.iterdir():  # (the folder itself may be a mount point)
        shutil.rmtree(child) if child.is_dir() else child.unlink()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m specforge_lite.bench kill_resume", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--full-disk", type=int, default=0, help="trials of a disk filling up under the run (root)")
    p.add_argument("--out", default=None, help="where the two runs go (default: a temporary folder, removed)")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="kill_resume-"))
    try:
        result = torture(a.kills, a.steps, a.seed, out, a.overrides, full_disk=a.full_disk)
    finally:
        if a.full_disk:
            subprocess.run(["umount", str(out / "killed")], capture_output=True)
        if not a.out:
            shutil.rmtree(out, ignore_errors=True)
    equal = (not result["differing_tensors"] and not result["full_disk_differing_tensors"]
             and result["final_steps"][0] == result["final_steps"][1])
    print(f"[kill_resume] {result['kills']} SIGKILLs ({result['inside_checkpoint_writes']} inside a checkpoint "
          f"write); listings with an unloadable folder: {len(result['unloadable_listings'])}; final weights and "
          f"optimizer state {'bit-equal to' if equal else 'DIFFERENT from'} the uninterrupted run")
    unclear = [t for t in result["full_disk"] if t["rc"] == 0 or not t["error"] or t["traceback"]]
    if result["full_disk"]:
        print(f"[kill_resume] {len(result['full_disk'])} full disks: {len(result['full_disk']) - len(unclear)} "
              "stopped with a one-line error and a non-zero exit; the space freed, each resumed")
    for line in result["unloadable_listings"] + result["differing_tensors"][:10]:
        print(f"  {line}")
    for trial in unclear:
        print(f"  full disk without a clear stop (exit {trial['rc']}): {' | '.join(trial['tail'])}")
    if not equal or result["unloadable_listings"] or unclear:
        sys.exit(1)


if __name__ == "__main__":
    main()
