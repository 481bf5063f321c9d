"""Adaptation: start a home from a draft, adapt it once on traffic files, or watch a folder for them.

One adaptation: read the traffic (bad rows counted and named), split it into training and held-out
conversations, train a candidate from the current version, measure both on held-out traffic and the
regression set (judge.py), then promote (publish a version, log, swap ``current``) or reject (log). Every
step before the log line can be killed and is started over: the traffic files count as used only once their
decision is logged.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from ..data.prepare import opening
from .candidate import TIMEOUT_MINUTES, as_prompts, split_traffic, train_candidate
from ..files import sha256_file, write_jsonl
from .home import REPORTS, AdaptHomeError, Home, setting_problem, write_json_atomic
from .judge import JUDGES, decide, judge_folder, measure
from .traffic import read_traffic

TRAFFIC_SUFFIXES = (".jsonl", ".json", ".log", ".txt")
HELDOUT_KEPT = 256  # held-out traffic conversations the home keeps (the newest)
REGRESSION_SETS = ("assistant", "mtbench", "gsm8k", "summarization", "humaneval")

DEFAULTS = {
    "judge": "vllm",  # vllm | ours: whose acceptance decides (judge.py)
    "margin": 0.02,  # the candidate's held-out traffic acceptance must beat the current's by this (relative)
    "tolerance": 0.02,  # its regression acceptance may fall by at most this (relative)
    "replay_ratio": 0.25,  # share of the candidate's training conversations drawn from the base data
    "heldout_fraction": 0.2,  # share of the traffic held out for judging (by each conversation's opening)
    "min_conversations": 64,  # adapt watch: new conversations that start an adaptation
    "steps": 200,  # the candidate's optimizer steps
    "minutes": None,  # or its training minutes (trainer.max_minutes), whichever ends first
    "timeout_minutes": TIMEOUT_MINUTES,  # its training is stopped past this (a failed candidate)
    "k": 3,  # draft tokens per verification when judging
    "eval_prompts": 24,  # prompts per judged set
    "max_new_tokens": 48,  # tokens generated per judged prompt
}


def check_judge(judge: str) -> None:
    """The judge can run here (checked before anything is trained)."""
    if judge not in JUDGES:
        raise AdaptHomeError(f"--judge {judge}: use one of {', '.join(JUDGES)}")
    if judge == "vllm":
        from ..serving import serving_python

        if serving_python() is None:
            raise AdaptHomeError("the judge vllm needs the serving environment: build it with bash "
                                 "scripts/setup_serving.sh, or judge by our speculative decoding with --judge ours")


# ---- init -----------------------------------------------------------------------------------------------
def base_config(draft: Path, overrides: list[str]):
    """The configuration candidates start from: a run's own config.yaml (with ``key=value`` overrides on
    top), or, for an export folder, train.py's composition of the overrides (model=..., data=...) for the
    export's own target and method (``export_target``)."""
    from omegaconf import OmegaConf

    from ..compose import load_config, to_config

    if (draft / "config.yaml").is_file() and (draft / "final" / "config.json").is_file():
        return to_config(OmegaConf.merge(OmegaConf.load(draft / "config.yaml"), OmegaConf.from_dotlist(overrides)))
    if (draft / "config.json").is_file():
        return load_config([*export_target(draft, overrides), *overrides])
    raise AdaptHomeError(f"--draft {draft}: no draft there (a finished run folder with config.yaml and final/, or an "
                         "export folder with config.json)")


def export_target(draft: Path, overrides: list[str]) -> list[str]:
    """The overrides that give an export folder its own target and method: the target its config.json names
    (speculators' verifier; as evaluate --export reads it), unless the overrides name one (model=...,
    model.path=...), and the method its provenance block records, unless they name one. An export that names no
    target is refused, saying how to name it: the embedded default's target is never taken in silence."""
    from ..evaluate.finished import target_overrides
    from ..export.published import named_target
    from ..formats import PROVENANCE_KEY

    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    try:
        exported = json.loads((draft / "config.json").read_bytes())
        named = named_target(draft) if isinstance(exported, dict) else None
    except (ValueError, AttributeError) as e:
        raise AdaptHomeError(f"--draft {draft}: its config.json does not read ({e}): export the draft again, or give "
                             "another --draft") from None
    if not named and not keys & {"model", "model.path"}:
        run = draft.parent if draft.name == "final" and (draft.parent / "config.yaml").is_file() else None
        raise AdaptHomeError(f"--draft {draft}: its config.json does not name the target it drafts for "
                             "(speculators' verifier, or this project's provenance block): name it after --draft, "
                             "e.g. model=llama3_8b (a preset) or model.path=meta-llama/Llama-3.1-8B-Instruct (a hub "
                             "id or a local folder)"
                             + (f", or give the run that wrote it: --draft {run}" if run else ""))
    spec = (exported.get(PROVENANCE_KEY) or {}).get("spec") if isinstance(exported, dict) else None
    method = spec.get("method") if isinstance(spec, dict) else None
    return [*target_overrides(draft, overrides),
            *([f"draft={method}"] if isinstance(method, str) and not keys & {"draft", "draft.method"} else [])]


def regression_prompts(source: Path | None, per_set: int) -> list[dict]:
    """The frozen regression set: a file's MT-bench rows, or the first prompts of each bundled set."""
    from ..evaluate.prompts import load_file_set

    if source is not None:
        return [{"turns": item.turns} for item in load_file_set("regression", source).items]
    return [{"turns": item.turns} for name in REGRESSION_SETS for item in load_file_set(name, None, per_set).items]


def init(home: Home, draft: Path, overrides: list[str], settings: dict, regression: Path | None = None,
         regression_per_set: int = 4, log=print) -> str:
    """Make ``draft`` version v0001 of a new home and fix its settings; its name."""
    with home.lock(log, wait=False, doing="init"):
        return _init(home, draft, overrides, settings, regression, regression_per_set, log)


def _init(home: Home, draft: Path, overrides: list[str], settings: dict, regression: Path | None,
          regression_per_set: int, log) -> str:
    from omegaconf import OmegaConf

    home.refuse_to_start_over()
    settings = {**DEFAULTS, **settings}
    check_judge(settings["judge"])
    if settings["timeout_minutes"] <= (settings["minutes"] or 0):
        budget = f"than its budget (--minutes {settings['minutes']:g})" if settings["minutes"] else "minutes"
        raise AdaptHomeError(f"--timeout-minutes {settings['timeout_minutes']:g}: give the candidate's training more "
                             f"{budget} to start and finish in")
    for key, value in settings.items():  # (what adapt run would call a damaged settings.json, refused here)
        problem = setting_problem(key, value)
        if problem:
            raise AdaptHomeError(f"--{key.replace('_', '-')} {value}: {problem}; nothing was written")
    draft = Path(draft).expanduser().resolve()
    config = base_config(draft, overrides)
    if config.data.source == "offline" and settings["replay_ratio"] > 0:
        raise AdaptHomeError("the draft was trained from a hidden-state store, which cannot be replayed online: "
                             "name its data (data.source=... data.path=...) or use --replay-ratio 0")
    final = draft / "final" if (draft / "final").is_dir() else draft
    if settings["judge"] == "vllm":
        import torch

        from ..export import cpu_serving_refusal

        refusal = None if torch.cuda.is_available() else cpu_serving_refusal(final)
        if refusal:
            raise AdaptHomeError(f"{refusal}; judge its candidates by our speculative decoding: --judge ours")
    home.root.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(config), home.root / "base_config.yaml")
    write_json_atomic(home.root / "settings.json", settings)
    write_jsonl(home.root / "regression.jsonl", regression_prompts(regression, regression_per_set))
    name = home.add_version("init", final, home.root / "base_config.yaml", source=str(draft))["version"]
    log(f"[adapt] {home.root}: current -> {name} (from {draft})")
    return name


# ---- one adaptation -------------------------------------------------------------------------------------
def _file_record(path: Path) -> dict:
    return {"path": str(path.resolve()), "fingerprint": fingerprint(path)}


def fingerprint(path: Path) -> str:
    return sha256_file(path)[:20]


def _update_heldout(home: Home, held: list[list[dict]]) -> Path:
    """The home's held-out traffic with this batch's added (each opening once, the newest kept)."""
    path = home.root / "heldout.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    seen = {opening(r["messages"]) for r in rows}
    rows += [{"messages": c} for c in held if opening(c) not in seen and not seen.add(opening(c))]
    write_jsonl(path, rows[-HELDOUT_KEPT:])
    return path


def adapt_once(home: Home, files: list[Path], log=print) -> dict:
    """One adaptation on these traffic files, under the home's lock; the logged event (promote, reject, skip or
    fail)."""
    current = home.current()  # (a current version that is gone refuses before anything is read)
    settings = home.settings()
    traffic = read_traffic(files)
    log(f"[adapt] traffic: {traffic.summary()}")
    records = [_file_record(f) for f in files]
    skipped = {"skipped_rows": len(traffic.skipped), "first_skipped": traffic.skipped[:5]}
    train, held = split_traffic(traffic.conversations, settings["heldout_fraction"])
    if not train:
        return home.log("skip", files=records, why="no training conversations in these files", **skipped)
    heldout_file = _update_heldout(home, held)
    work = home.root / "work"
    shutil.rmtree(work, ignore_errors=True)  # (a killed attempt starts over)
    work.mkdir()
    try:
        heldout = as_prompts([json.loads(x)["messages"] for x in heldout_file.read_text().splitlines()])
        if not heldout:
            raise AdaptHomeError("no held-out traffic to judge on yet: raise --heldout-fraction or send more traffic")
        prompts = {"traffic": work / "traffic_prompts.jsonl", "regression": home.root / "regression.jsonl"}
        write_jsonl(prompts["traffic"], heldout[::-1])
        run_dir = train_candidate(home, current, train, work, log)
        folders = {"current": judge_folder(run_dir, current, work / "judge-current"),
                   "candidate": judge_folder(run_dir, run_dir, work / "judge-candidate")}
        numbers = measure(folders, prompts, settings, log)
    except Exception as e:  # a failed candidate is a decision too: logged, and the loop goes on
        return _failed(home, e, work, parent=current.name, files=records, **skipped, log=log)
    # (the first version's regression acceptance is unmeasured only while it is current: decide() then takes this)
    promote, why = decide(numbers["current"], numbers["candidate"], settings["margin"], settings["tolerance"],
                          home.first_regression())
    common = {"parent": current.name, "files": records, "train_conversations": len(train),
              "heldout_conversations": len(heldout[: settings["eval_prompts"]]), "numbers": numbers, "why": why,
              **skipped}
    if promote:
        event = home.add_version("promote", run_dir / "final", run_dir / "config.yaml", **common)
        log(f"[adapt] promoted {event['version']}: {why}")
    else:
        event = home.log("reject", **common)
        log(f"[adapt] rejected the candidate, current stays {current.name}: {why}")
    _keep_reports(home, folders, len(home.events()))
    shutil.rmtree(work, ignore_errors=True)
    return event


def _failed(home: Home, error: Exception, work: Path, log=print, **fields) -> dict:
    """Log a failed candidate, keep its training log under reports/<its decision's number>/ and remove the rest of
    its work (logged first: a report folder numbered past the log would read as lost lines)."""
    train_log = work / "train.log"
    kept = Path(REPORTS) / f"{len(home.events()) + 1:04d}" / "train.log"
    event = home.log("fail", error=f"{type(error).__name__}: {error}"[:2000],
                     **({"log": str(kept)} if train_log.is_file() else {}), **fields)
    if train_log.is_file():
        (home.root / kept).parent.mkdir(parents=True, exist_ok=True)
        os.replace(train_log, home.root / kept)
    shutil.rmtree(work, ignore_errors=True)
    log(f"[adapt] candidate failed: {event['error']}" + (f" (its log: {home.root / kept})" if "log" in event else ""))
    return event


def run(home: Home, paths: list[Path], log=print) -> dict | None:
    """``adapt run``: one adaptation on the files named and each folder's traffic files not used yet (as
    ``watch`` takes them), under the home's lock (refused, naming the holder, while another command holds it); the
    logged event, or None when there was nothing new."""
    with home.holding(log, wait=False, doing="run"):
        files = traffic_files(home, paths, log)
        if not files:
            log(f"[adapt] nothing new in {', '.join(map(str, paths))}: every traffic file there was used already")
            return None
        return adapt_once(home, files, log)


def traffic_files(home: Home, paths: list[Path], log=print) -> list[Path]:
    """The files named and each folder's traffic files, in order, whose content no decision has used yet."""
    found: dict[Path, None] = {}
    for path in map(lambda p: Path(p).expanduser(), paths):
        if path.is_dir():
            found.update(dict.fromkeys(settled_files(path, settle=0)))
        elif not path.is_file():
            raise AdaptHomeError(f"adapt run {path}: no such file or folder")
        elif path.suffix not in TRAFFIC_SUFFIXES:
            raise AdaptHomeError(f"adapt run {path}: not a traffic file (name it {', '.join(TRAFFIC_SUFFIXES)})")
        else:
            found[path] = None
    named = {Path(p).expanduser() for p in paths}
    return unused(home, list(found), log, say_used=lambda path: path in named)


def _keep_reports(home: Home, folders: dict[str, Path], number: int) -> None:
    """Each judged draft's evaluation (ours, and vLLM's) under HOME/reports/<decision number>/."""
    out = home.root / "reports" / f"{number:04d}"
    out.mkdir(parents=True, exist_ok=True)
    for name, folder in folders.items():
        for report in ("eval.json", "vllm_eval.json"):
            if (folder / report).is_file():
                shutil.copyfile(folder / report, out / f"{name}_{report}")


# ---- the loop -------------------------------------------------------------------------------------------
def settled_files(folder: Path, settle: float) -> list[Path]:
    """Traffic files in ``folder`` (and its subfolders) unchanged for ``settle`` seconds (still being written
    otherwise)."""
    out, now = [], time.time()
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file() and p.suffix in TRAFFIC_SUFFIXES):
        try:
            if now - path.stat().st_mtime >= settle:
                out.append(path)
        except OSError:
            continue  # (gone between listing and reading: a later poll sees what is there)
    return out


def new_files(home: Home, folder: Path, settle: float, log=print) -> list[Path]:
    """Traffic files in ``folder``, settled, whose content no decision has used yet (``unused``)."""
    return unused(home, settled_files(folder, settle), log)


def unused(home: Home, files: list[Path], log=print, say_used=lambda path: False) -> list[Path]:
    """Of ``files``, those whose content no decision has used, each content once: a traffic file is trained on
    once, whatever its name (its fingerprint). A file used already is left out (said when ``say_used``); one
    that changed since it was read, or that repeats a content under another name, is logged as skipped, so
    that it counts as used and is said once."""
    consumed = home.consumed()
    used = {fp: path for path, fp in consumed.items()}
    out = []
    for path in files:
        try:
            key, fp = str(path.resolve()), fingerprint(path)
        except OSError:
            continue  # (gone between listing and reading: a later poll sees what is there)
        if consumed.get(key) == fp:
            if say_used(path):
                log(f"[adapt] left out {path}: used already (a traffic file is trained on once)")
            continue
        if key in consumed:
            why = ("the file changed after it was read; a traffic file is read once: write new traffic to new files "
                   "(rotate the log)")
        elif fp in used:
            why = f"the same content as {used[fp]}, used already (a traffic file is trained on once)"
        else:
            out.append(path)
            used[fp] = key
            continue
        home.log("skip", files=[{"path": key, "fingerprint": fp}], why=why)
        consumed[key] = fp
        log(f"[adapt] left out {path}: {why}")
    return out


def watch(home: Home, folder: Path, interval: float = 30, settle: float = 10, once: bool = False, log=print) -> None:
    """Adapt whenever ``min_conversations`` new conversations have landed in ``folder``; keep going after a bad
    file or a failed candidate. ``once``: one poll (and at most one adaptation), then return. The home's lock is
    held only while it looks and adapts, so a rollback waits at most for one adaptation."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise AdaptHomeError(f"adapt watch {folder}: no such folder (the folder the server's traffic files land in)")
    wanted = home.settings()["min_conversations"]
    log(f"[adapt] watching {folder} (adapting every {wanted} new conversations)")
    while True:
        with home.holding(log, doing="watch"):
            look(home, folder, settle, wanted, log)
        if once:
            return
        time.sleep(interval)


def look(home: Home, folder: Path, settle: float, wanted: int, log=print) -> None:
    """One poll of ``folder``: bad files logged as skipped, and an adaptation once ``wanted`` conversations wait."""
    home.current()  # (a watch stops, with the fix, when the current version is gone)
    ready, count = [], 0
    for path in new_files(home, folder, settle, log):
        traffic = read_traffic([path])
        if traffic.conversations:
            ready.append(path)
            count += len(traffic.conversations)
        else:  # a bad file is named in the log, counted as used, and the loop goes on
            home.log("skip", files=[_file_record(path)], why="no conversation could be read",
                     skipped_rows=len(traffic.skipped), first_skipped=traffic.skipped[:5])
            log(f"[adapt] skipped {path}: {traffic.summary()}")
    if ready and count >= wanted:
        adapt_once(home, ready, log)
