"""Every setting of a composed config checked once, before anything expensive runs: the numbers against their
ranges (config.RANGES), then what the draft method refuses (its own folder says, methods/<name>/), what the
export format cannot write of that draft, and what the evaluation cannot measure of it: the rules that span
settings (a closed choice's value is its type's to refuse, when the config is composed: compose.py). All problems
are said together, each naming the key and the fix, so a run never trains for hours to be refused at its export.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import torch

from .compose import unpacked_reason
from .config import Config, out_of_range
from .data.sources import data_setting_problems
from .draft.method import DraftMethod
from .evaluate.prompts import prompt_set_problems
from .evaluate.served import served_check_problems
from .export import export_format, export_refusals
from .methods import draft_method
from .records import checkpoint_folders, checkpoint_problem, unreadable
from .targets.families import FAMILIES
from .targets.served import served_target_problems
from .training.tracking import tracker_problems


def setting_problems(config: Config) -> list[str]:
    problems = out_of_range(config) + data_setting_problems(config.data) + tracker_problems(config.tracker)
    try:
        method = draft_method(config.draft.method)
    except ValueError as e:
        return [*problems, str(e)]
    problems += periodic_problems(config, method) + method.refused(config) + served_target_problems(config)
    problems += token_budget_problems(config) + resume_problems(config.trainer.resume)
    family = FAMILIES.get(config.model.family)
    if config.target.backend == "lean" and family is not None and family.lean_forward is None:
        problems.append(f"target.backend=lean: the {config.model.family} family has no lean forward (the transformers "
                        "modules would run); use target.backend=hf")
    d = config.draft
    if d.compile and not torch.cuda.is_available():
        problems += compiler_problems()
    if d.freeze_lm_head and not (d.init_lm_head_from_target or d.init_from):
        problems.append("draft.freeze_lm_head=true with draft.init_lm_head_from_target=false: a frozen lm_head would "
                        "keep its random rows; set draft.init_lm_head_from_target=true (or continue a draft with "
                        "draft.init_from)")
    t = config.trainer
    if t.optimizer == "muon" and t.deepspeed.enabled:
        problems.append("trainer.optimizer=muon with trainer.deepspeed.enabled=true: ZeRO steps flat partitions of "
                        "the weights, which Muon cannot orthogonalise as matrices; use trainer.optimizer=adamw "
                        "under DeepSpeed (the embedded recipe, cpu_20min, picks muon: recipe=none drops it), or "
                        "train in one process")
    if config.eval.enabled:
        problems += prompt_set_problems(list(config.eval.prompt_sets), dict(config.eval.prompt_files or {}))
    problems += method.refused_evaluation(config.draft, config.eval) + served_check_problems(config)
    try:
        form = export_format(config.export.format, config.draft.method)
        problems += export_refusals(form, config.draft)
    except ValueError as e:  # (an unknown format)
        form = None
        problems.append(str(e))
    if config.eval.serve and form is not None and form.cpu_serving_refusal and not torch.cuda.is_available():
        problems.append(f"eval.serve={config.eval.serve} with draft={config.draft.method}: "
                        f"{form.cpu_serving_refusal}; set eval.serve=null (our evaluation still measures it)")
    return problems


def resume_problems(resume: str) -> list[str]:
    """What keeps trainer.resume=PATH from resuming: no folder there, a run's folder instead of one of its
    checkpoints, or a checkpoint that does not read (said before the target loads, not after)."""
    if resume in ("auto", "never", "none", ""):
        return []
    path = Path(resume).expanduser()
    key, choices = f"trainer.resume={resume}", "auto (output_dir's newest checkpoint) or never"
    if not path.is_dir():
        return [f"{key}: no such folder; give a run's checkpoints/step_* folder, or {choices}"]
    if (path / "checkpoints").is_dir():
        newest = sorted(checkpoint_folders(path / "checkpoints"))
        named = f" ({path / 'checkpoints' / newest[-1]} is its newest)" if newest else ""
        return [f"{key} is a run's folder: give one of its checkpoints/step_* folders{named}, or continue that run "
                f"with output_dir={resume}"]
    problem = checkpoint_problem(path)
    return [f"{key}: {unreadable(path, problem)}"] if problem else []


def token_budget_problems(config: Config) -> list[str]:
    """What keeps trainer.micro_batch_tokens from sizing micro-batches by tokens, each in one line with the fix."""
    t, d = config.trainer, config.data
    budget = t.micro_batch_tokens
    if budget is None:
        return []
    key = f"trainer.micro_batch_tokens={budget}"
    off = "or trainer.micro_batch_tokens=null (trainer.micro_batch_size conversations per micro-batch)"
    reason = unpacked_reason(config.model.family, str(d.source), config.draft.method)
    if reason is not None:
        return [f"{key} packs conversations into one row, and {reason}: set trainer.micro_batch_tokens=null"]
    problems = []
    if budget < d.max_length:
        problems.append(f"{key} is below data.max_length={d.max_length}: a conversation of data.max_length tokens "
                        f"would fit no micro-batch; set trainer.micro_batch_tokens={d.max_length} or more, {off}")
    if t.micro_batch_size != 1:
        problems.append(f"{key} with trainer.micro_batch_size={t.micro_batch_size}: a micro-batch is sized either in "
                        f"tokens or in conversations; set trainer.micro_batch_size=1, {off}")
    if d.packing:
        problems.append(f"{key} with data.packing=true: a token-budget micro-batch is one packed row already; set "
                        f"data.packing=false, {off}")
    return problems


def cpp_compiler() -> str:
    """The C++ compiler torch.compile builds CPU kernels with on Linux: $CXX, else g++."""
    return os.environ.get("CXX") or "g++"


# How long the C++ compiler may take over a three-line file before it is taken for hung (a working one: well under
# a second; a loaded machine or a cold network file system: seconds).
COMPILER_CHECK_SECONDS = 60
_PROBE = "#include <cmath>\n#include <cstdint>\nextern \"C\" int64_t probe(double x) { return std::lround(x); }\n"


def compiler_problems() -> list[str]:
    """draft.compile=true on a CPU: the C++ compiler torch.compile builds its kernels with, found and tried on a
    tiny file as Inductor builds its kernels (a shared object), or why it cannot be used, with the fix."""
    compiler = cpp_compiler()
    named = f"$CXX={compiler}" if os.environ.get("CXX") else compiler
    fix = "point $CXX at a working compiler or unset it (g++ is the default)" if os.environ.get("CXX") else \
        "install or repair g++ (apt install g++), or point $CXX at a working compiler"
    found = shutil.which(compiler)
    if found is None and os.path.isfile(compiler):
        problem = "is not executable: make it executable (chmod +x)"
    elif found is None:
        fix = "point $CXX at an installed one or unset it" if os.environ.get("CXX") else "install g++ (apt install g++)"
        return [f"draft.compile=true on a CPU needs the C++ compiler torch.compile builds its kernels with, "
                f"{compiler}, which is not found: {fix}, or set draft.compile=false"]
    else:
        problem = _compiler_problem(found, COMPILER_CHECK_SECONDS)
    if problem is None:
        return []
    return [f"draft.compile=true on a CPU needs the C++ compiler torch.compile builds its kernels with: {named} "
            f"{problem}; {fix}, or set draft.compile=false"]


@functools.lru_cache(maxsize=None)
def _compiler_problem(compiler: str, seconds: float) -> str | None:
    """What goes wrong when ``compiler`` builds a shared object of a three-line file (within ``seconds``), or None;
    tried once per compiler in a process. A hung compiler is killed with everything it started."""
    with tempfile.TemporaryDirectory(prefix="specforge-lite-cxx-") as tmp:
        folder = Path(tmp)
        (folder / "probe.cpp").write_text(_PROBE)
        with open(folder / "output.txt", "w+b") as output:  # (a file: a killed compiler's children hold no pipe)
            try:
                proc = subprocess.Popen([compiler, "-shared", "-fPIC", "probe.cpp", "-o", "probe.so"], cwd=folder,
                                        stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                        start_new_session=True)
            except OSError as e:  # (a script without #!, a binary for another machine)
                return f"cannot be run ({e.strerror or e})"
            try:
                status = proc.wait(timeout=seconds)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return f"did not compile a three-line C++ file within {seconds:g} s (it hangs)"
            output.seek(0)
            said = [line.strip() for line in output.read().decode(errors="replace").splitlines() if line.strip()]
        if status != 0 or not (folder / "probe.so").is_file():
            last = f": {said[-1][:200]}" if said else ""
            return f"failed to compile a three-line C++ file (exit status {status}{last})"
    return None


def check_settings(config: Config) -> None:
    """Refuse, before anything is built, settings with which no run can do its job (each with the fix)."""
    problems = setting_problems(config)
    if problems:
        raise ValueError("; ".join(problems))


def periodic_problems(config: Config, method: DraftMethod) -> list[str]:
    """What keeps eval.every_steps / every_minutes and trainer.keep_best / export_best from doing their job for a
    draft of ``method`` (its settings ``config.draft``), each in one line with the fix."""
    ev, t = config.eval, config.trainer
    periodic = ev.every_steps is not None or ev.every_minutes is not None
    problems = []
    from .training.periodic import keep_best_names

    names = keep_best_names(method.scored_steps(config.draft))
    if t.keep_best is not None and t.keep_best not in names:
        problems.append(f"trainer.keep_best={t.keep_best!r}: use one of {', '.join(names)} (higher is better), "
                        "or null for no best checkpoint")
    elif t.keep_best is not None and not periodic:
        problems.append(f"trainer.keep_best={t.keep_best} chooses by the held-out evaluation during training: set "
                        "eval.every_steps or eval.every_minutes")
    if t.keep_best == "heldout_acceptance_length" and periodic and not ev.every_prompts:
        problems.append("trainer.keep_best=heldout_acceptance_length is measured on held-out prompts during "
                        "training: set eval.every_prompts (e.g. 4)")
    if ev.every_prompts and not periodic:
        problems.append(f"eval.every_prompts={ev.every_prompts} is measured by the evaluation during training: set "
                        "eval.every_steps or eval.every_minutes, or eval.every_prompts=0")
    if t.export_best and t.keep_best is None:
        problems.append("trainer.export_best=true needs trainer.keep_best (the metric the best checkpoint is chosen "
                        "by), e.g. trainer.keep_best=heldout_sim_accepted_drafts")
    if periodic and config.data.source == "offline":
        problems.append("eval.every_steps/eval.every_minutes with data.source=offline: a store-trained run has no "
                        "held-out conversations to measure; set both to null")
    elif periodic and (ev.heldout_batches == 0 or config.data.heldout_samples == 0):
        problems.append("eval.every_steps/eval.every_minutes measure on held-out conversations: set "
                        "eval.heldout_batches and data.heldout_samples to 1 or more, or both to null")
    return problems
