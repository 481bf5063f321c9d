"""An adaptation home: the draft versions side by side, the ``current`` pointer and the decisions log.

    HOME/
      v0001/ v0002/ ...   each a draft as a run folder holds it: config.yaml and final/ (what servers load)
      current -> v0002    a symbolic link, replaced atomically (a new link renamed over the old one)
      decisions.jsonl     one JSON line per event (init, promote, reject, fail, skip, rollback) with its numbers
      settings.json       what ``adapt init`` fixed: the base configuration, the rails, the judge
      base_config.yaml    the configuration every candidate starts from (target, data, draft, trainer)
      regression.jsonl    the frozen regression prompts (MT-bench format)
      heldout.jsonl       held-out traffic (never trained on), newest last
      reports/NNNN/       the judged drafts' evaluations (ours and vLLM's) behind decision NNNN (its line), or
                          the training log of a candidate that failed
      work/               the candidate being made; removed once it is decided or has failed
      .lock               held by the command writing the home (a watch holds it only while it looks and adapts),
                          which it names; ``run`` and ``init`` are refused while another holds it, naming it

The decisions log is the truth. ``current`` is the version of its last init, promote or rollback event. A
version is added in steps (``STEPS``): copied under a hidden name, published (renamed into place, complete),
logged, then linked. ``repair`` (run first by every command that writes, under the lock) makes the folder agree
with the log after a kill at any step: a version published but never logged is removed, a logged one whose
link was not swapped is linked. Only an unterminated last line of the log counts as a kill (its event never
happened; it is cut off before the next line is written). Any other line that does not read, or folders the
log cannot account for (a lost line), stop every command, named, before anything is changed: a version a
damaged line might name is never removed. ``current`` broken in any way (missing, dangling, a loop, naming a file
or anything but a complete version of the home) is remade from the log; a folder or a file in its place (it may
hold a draft) is refused until it is moved aside. ``status`` names all of this without changing anything.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from ..errors import UserError
from ..files import fsync, write_then_rename
from ..training.output_dir import LOCK
from .judge import JUDGES

DECISIONS, CURRENT, REPORTS, SETTINGS = "decisions.jsonl", "current", "reports", "settings.json"
VERSION = re.compile(r"v[0-9]{4}")
# each event's fields that the home cannot do without (a line without them is damaged)
EVENT_FIELDS = {"init": ("version",), "promote": ("version",), "reject": (), "fail": (), "skip": (),
                "rollback": ("version",)}
ADDS_A_VERSION = ("init", "promote")
# the steps of adding a version (publish, log, point_at), in order: on_step is called after each
STEPS = ("copied", "published", "logged", "link made", "linked")
MEND = ("Nothing was changed: mend that line (one JSON event per line, see docs/adapt.md) or restore the file from "
        "a backup, then run the command again")
SETTINGS_FIX = ("fix it (one JSON object of the settings adapt init fixed: docs/adapt.md#the-settings-file) or "
                "restore it from a backup, then run the command again")
WRITERS = "the next command that writes the home (run, watch or rollback)"
# a lock held this briefly (a status looking, a watch's look at an empty folder) is waited out without a word
LOCK_GRACE_S = 0.5
LOST = ("it has lost lines. Nothing was changed: restore it from a backup, then run the command again (a version "
        "published but never logged is only ever the newest, and never current)")

# what each setting in HOME/settings.json must be (``settings_problem``); timeout_minutes may be absent (a home made
# before it: loop.py's TIMEOUT_MINUTES), minutes and timeout_minutes null (no budget, no timeout)
KINDS = {"judge": "judge", "margin": "number", "tolerance": "number", "replay_ratio": "share",
         "heldout_fraction": "share", "min_conversations": "count", "steps": "positive count",
         "minutes": "positive number or null", "timeout_minutes": "positive number or null", "k": "positive count",
         "eval_prompts": "positive count", "max_new_tokens": "positive count"}
WANTED = {"judge": f"one of {', '.join(JUDGES)}", "count": "a whole number, 0 or more",
          "positive count": "a whole number, 1 or more", "share": "a share in [0, 1)",
          "positive number or null": "a number above 0, or null"}


def settings_problem(settings: dict) -> str | None:
    """What is wrong with a home's settings (HOME/settings.json read as a JSON object), or None: a setting missing
    or unknown, or not of its kind (``setting_problem``)."""
    unknown = sorted(set(settings) - set(KINDS))
    if unknown:
        return f"{', '.join(unknown)} {'is not a setting' if len(unknown) == 1 else 'are not settings'} (the " \
               f"settings: {', '.join(KINDS)})"
    missing = [k for k in KINDS if k not in settings and k != "timeout_minutes"]
    if missing:
        return f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing"
    return next((f"{key} is {json.dumps(value)}: {problem}" for key, value in settings.items()
                 if (problem := setting_problem(key, value))), None)


def setting_problem(key: str, value) -> str | None:
    """What is wrong with one setting of a home (``KINDS``: a number, a count, a share in [0, 1), a judge), or None
    (adapt init checks what it is given with it, so a home never holds what adapt run refuses)."""
    kind, number = KINDS[key], isinstance(value, (int, float)) and not isinstance(value, bool)
    count = number and isinstance(value, int)
    wrong = {"judge": value not in JUDGES, "number": not number,
             "positive number or null": value is not None and not (number and value > 0),
             "count": not (count and value >= 0), "positive count": not (count and value >= 1),
             "share": not (number and 0 <= value < 1)}[kind]
    return f"it must be {WANTED.get(kind, f'a {kind}')}" if wrong else None


class AdaptHomeError(UserError):
    """An adaptation home that is missing, not initialised, damaged, or asked for what it does not hold."""


def fsync_tree(path: Path) -> None:
    """Every file under ``path`` and the folders themselves on disk (a rename after it publishes whole files)."""
    for root, _, files in os.walk(path):
        for name in files:
            fsync(Path(root) / name)
        fsync(Path(root))


def write_json_atomic(path: Path, value: Any) -> None:
    write_then_rename(path, lambda tmp: tmp.write_text(json.dumps(value, indent=1) + "\n"))


def line_problem(line: bytes, first: bool) -> tuple[dict | None, str | None]:
    """One terminated line of the log read as an event, or why it cannot be."""
    try:
        row = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"not a JSON line ({e})"
    if not isinstance(row, dict) or row.get("event") not in EVENT_FIELDS:
        return None, f"not an event (one of {', '.join(EVENT_FIELDS)})"
    missing = [k for k in EVENT_FIELDS[row["event"]] if k not in row]
    if missing:
        return None, f"a {row['event']} event without its {', '.join(missing)}"
    if "version" in row and not (isinstance(row["version"], str) and VERSION.fullmatch(row["version"])):
        return None, f"version {row['version']!r} is not a version name (vNNNN)"
    if not _is_file_list(row.get("files", [])):
        return None, "its files are not a list of {path, fingerprint}"
    if "numbers" in row and not _has_numbers(row["numbers"]):
        return None, "its numbers lack the current and candidate drafts' traffic and regression acceptance"
    if first != (row["event"] == "init"):
        return None, ("the first event is not init (the log lost its start)" if first else "a second init event")
    return row, None


def _is_file_list(files) -> bool:
    return isinstance(files, list) and all(
        isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("fingerprint"), str) for f in files)


def _has_numbers(numbers) -> bool:
    drafts = [numbers.get(d) if isinstance(numbers, dict) else None for d in ("current", "candidate")]
    return all(isinstance(d, dict) and all(isinstance(d.get(s), (int, float)) for s in ("traffic", "regression"))
               for d in drafts)


@dataclass
class Home:
    root: Path
    # called with each of STEPS as it is done (tests stop a promotion there, as a kill would)
    on_step: Callable[[str], None] = field(default=lambda step: None, repr=False)

    def __post_init__(self):
        self.root = Path(self.root).expanduser().resolve()

    # ---- reading (no lock: a line being written is unterminated, and left out) -------------------
    def versions(self) -> list[str]:
        """The version folders there are, oldest first."""
        return sorted(p.name for p in self.root.glob("v[0-9][0-9][0-9][0-9]") if p.is_dir())

    def events(self) -> list[dict]:
        """The decisions log, oldest first. An unterminated last line is left out (a kill cut it short: its
        event never happened); any other line that does not read stops the command, named by file:line."""
        path = self.root / DECISIONS
        data = path.read_bytes() if path.is_file() else None
        terminated = (data or b"")[: (data or b"").rfind(b"\n") + 1]
        out = []
        for n, line in enumerate(terminated.split(b"\n")[:-1], 1):
            row, problem = line_problem(line, first=n == 1)
            if problem:
                raise AdaptHomeError(f"{path}:{n}: {problem}. {MEND}")
            out.append(row)
        if not out and self.versions():
            said = "is missing" if data is None else "holds no event"
            raise AdaptHomeError(f"{path} {said}, yet {self.root} holds {', '.join(self.versions())}: restore the "
                                 "log from a backup (an init killed before it logged leaves only v0001: then remove "
                                 f"{self.root} and init again). Nothing was changed")
        return out

    def require(self) -> "Home":
        if not self.events():
            raise AdaptHomeError(f"{self.root} is not an adaptation home: start one with python -m "
                                 "specforge_lite.adapt init --home HOME --draft RUN_OR_EXPORT")
        return self

    def settings(self) -> dict:
        """HOME/settings.json, each setting checked (``settings_problem``); a file that is missing, does not
        read or holds a wrong setting stops the command, naming the file and the setting."""
        path = self.root / SETTINGS
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise AdaptHomeError(f"{path} is missing: restore it from a backup, or write it again (the settings adapt "
                                 "init fixed, listed in docs/adapt.md#the-settings-file), then run the command "
                                 "again") from None
        if not data.strip():
            raise AdaptHomeError(f"{path} is empty: {SETTINGS_FIX}")
        try:
            settings = json.loads(data)
        except ValueError as e:  # (json's errors, and bytes that are not UTF-8)
            raise AdaptHomeError(f"{path}: not JSON ({e}): {SETTINGS_FIX}") from None
        if not isinstance(settings, dict):
            raise AdaptHomeError(f"{path}: a JSON {type(settings).__name__}, not an object of settings: {SETTINGS_FIX}")
        problem = settings_problem(settings)
        if problem:
            raise AdaptHomeError(f"{path}: {problem}: {SETTINGS_FIX}")
        return settings

    def history(self) -> list[str]:
        """The versions that were current, in order, with rolled-back ones taken off: the last is current."""
        stack: list[str] = []
        for e in self.events():
            if e["event"] in ADDS_A_VERSION:
                stack.append(e["version"])
            elif e["event"] == "rollback" and len(stack) > 1:
                stack.pop()
        return stack

    def refuse_to_start_over(self) -> None:
        """A home that holds versions, a log or a link is never started over (init would publish over it)."""
        held = [*self.versions(), *[n for n in (DECISIONS, CURRENT) if os.path.lexists(self.root / n)]]
        if held:
            raise AdaptHomeError(f"{self.root} already holds an adaptation ({', '.join(held)}): use another --home, "
                                 "or adapt run/watch/status with this one (status names a damaged log)")

    def complete(self, version: str) -> bool:
        return (self.root / version / "final" / "config.json").is_file()

    def current_problem(self) -> str | None:
        """Why the current version cannot be served or trained from (its folder is gone), or None."""
        history = self.require().history()
        if self.complete(history[-1]):
            return None
        fix = (f"roll back to {history[-2]} (python -m specforge_lite.adapt rollback --home {self.root})"
               if len(history) > 1 else f"remove {self.root} and init again")
        return (f"{self.root / history[-1]}, the current version by {DECISIONS}, is missing or incomplete (no "
                f"final/config.json): restore it from a backup, or {fix}")

    def current(self) -> Path:
        problem = self.current_problem()
        if problem:
            raise AdaptHomeError(problem)
        return self.root / self.history()[-1]

    def linked(self) -> str | None:
        """Where the ``current`` link points (None: no link)."""
        link = self.root / CURRENT
        return os.readlink(link) if link.is_symlink() else None

    def link_state(self, want: str) -> tuple[str, str]:
        """What ``current`` is on disk against ``want``, the log's current version: ("ok", ""); ("moved", what):
        a link to another complete version of the home (a swap killed after its line, or a link changed by hand);
        ("broken", what): missing, dangling, a loop, or naming anything but a complete version of the home; or
        ("not a link", what): a folder or a file in its place."""
        link = self.root / CURRENT
        if not os.path.lexists(link):
            return "broken", f"{link} is missing"
        if not link.is_symlink():
            return "not a link", f"{link} is a {'folder' if link.is_dir() else 'file'}, not a link"
        target = os.readlink(link)
        if target == want:
            return "ok", ""
        try:
            real = (self.root / target).resolve(strict=True)
        except RuntimeError:  # (a loop, as Python before 3.13 says it)
            return "broken", f"{link} names {target}, a link loop"
        except OSError as e:
            return "broken", f"{link} names {target}, " + ("a link loop" if e.errno == errno.ELOOP else
                                                           "which does not exist")
        if real.parent != self.root or not VERSION.fullmatch(real.name):
            return "broken", (f"{link} names {target}, {'a folder' if real.is_dir() else 'a file'} that is not one of "
                              f"{self.root}'s versions (vNNNN)")
        if not self.complete(real.name):
            return "broken", f"{link} names {target}, which is incomplete (no final/config.json)"
        return ("ok", "") if real.name == want else ("moved", f"{link} names {real.name}")

    def consumed(self) -> dict[str, str]:
        """Traffic files already used (read into a decision, or skipped as unreadable): path -> fingerprint."""
        return {f["path"]: f["fingerprint"] for e in self.events() for f in e.get("files", [])}

    def first_regression(self) -> float | None:
        """The first version's regression acceptance as first measured (None: no decision has measured it)."""
        first = self.history()[0]
        return next((e["numbers"]["current"]["regression"] for e in self.events()
                     if e.get("parent") == first and "numbers" in e), None)

    # ---- the lock --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, log=print, wait: bool = True, doing: str = "") -> Iterator[None]:
        """Hold the home's lock while the block runs (the kernel drops a holder's lock when it ends in any way,
        kill -9 included), named in it as ``adapt <doing>``, its pid and host (as a training run holds its output
        folder: training/output_dir.py). Held by another: waited for (``wait``), or refused, naming the holder."""
        if self.root.exists() and not self.root.is_dir():
            raise AdaptHomeError(f"--home {self.root} is a file, not a folder: name a folder")
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / LOCK, "a+") as handle:
            if not _take(handle, LOCK_GRACE_S):
                handle.seek(0)
                holder = handle.read().strip() or "another command"
                if not wait:
                    raise AdaptHomeError(f"{self.root} is being written by another command ({holder}): wait for it to "
                                         "end, or stop it, then run this again (one command writes a home at a time; "
                                         "a watch holds it only while it looks and adapts)")
                log(f"[adapt] waiting for {self.root}'s lock, held by {holder} (a watch lets go once its adaptation "
                    "is decided)")
                fcntl.flock(handle, fcntl.LOCK_EX)
            handle.seek(0)
            handle.truncate()
            handle.write(f"adapt{' ' + doing if doing else ''}, pid {os.getpid()} on {socket.gethostname()}, since "
                         f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            handle.flush()
            yield

    @contextlib.contextmanager
    def holding(self, log=print, wait: bool = True, doing: str = "") -> Iterator[None]:
        """The lock, with the home repaired first: how every command that writes the home begins."""
        with self.lock(log, wait, doing):
            self.repair(log)
            yield

    def held_by(self) -> str | None:
        """Who holds the home's lock now (as it names itself), or None; looked at without waiting or writing (a
        shared lock taken and let go at once: a writer meanwhile waits it out, ``LOCK_GRACE_S``)."""
        try:
            handle = open(self.root / LOCK)
        except OSError:
            return None  # (no lock file: nothing ever held it)
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return handle.read().strip() or "another command"
            fcntl.flock(handle, fcntl.LOCK_UN)
            return None

    # ---- writing (under the lock) ----------------------------------------------------------------
    def cut_unterminated_tail(self) -> int | None:
        """Cut off a last line a kill left unterminated (so the next line does not join it); its line number."""
        path = self.root / DECISIONS
        if not path.is_file():
            return None
        with open(path, "rb+") as f:
            data = f.read()
            keep = data.rfind(b"\n") + 1
            if keep == len(data):
                return None
            f.truncate(keep)
            os.fsync(f.fileno())
            return data.count(b"\n") + 1

    def log(self, event: str, **fields) -> dict:
        """Append one event to the decisions log, on disk before this returns."""
        row = {"event": event, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **fields}
        self.cut_unterminated_tail()
        with open(self.root / DECISIONS, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return row

    def publish(self, final: Path, config: Path) -> str:
        """Copy a draft (its export folder and its run's config.yaml) in as the next version; its name. The
        copy is made under a hidden name and renamed into place whole."""
        name = f"v{max([int(n[1:]) for n in self.versions()] + [0]) + 1:04d}"
        staging = self.root / f".staging-{name}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        shutil.copytree(final, staging / "final")
        shutil.copy2(config, staging / "config.yaml")
        fsync_tree(staging)
        self.on_step("copied")
        os.rename(staging, self.root / name)
        fsync(self.root)
        self.on_step("published")
        return name

    def point_at(self, version: str) -> None:
        """Swap ``current`` to ``version``: a new link renamed over the old one (never absent, never half)."""
        tmp = self.root / f".{CURRENT}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        os.symlink(version, tmp)
        self.on_step("link made")
        os.replace(tmp, self.root / CURRENT)
        fsync(self.root)
        self.on_step("linked")

    def add_version(self, event: str, final: Path, config: Path, **fields) -> dict:
        """Publish a draft as the next version, log ``event`` (init or promote) for it, then point at it."""
        row = self.log(event, version=self.publish(final, config), **fields)
        self.on_step("logged")
        self.point_at(row["version"])
        return row

    def rollback(self, log=print) -> str:
        """Point ``current`` back at the version before it, and log it; the version now current. Waits for the
        lock (a watch holds it while it adapts); a promotion made while it waited is not rolled back unasked."""
        seen = self.require().history()[-1]
        with self.holding(log, doing="rollback"):
            history = self.history()
            if history[-1] != seen:
                raise AdaptHomeError(f"current moved from {seen} to {history[-1]} while rollback waited for the lock: "
                                     f"nothing was rolled back; run rollback again to undo {history[-1]}")
            if len(history) < 2:
                raise AdaptHomeError(f"nothing to roll back to: {seen} is the only version that was current")
            if not self.complete(history[-2]):
                raise AdaptHomeError(f"{self.root / history[-2]} is missing or incomplete (no final/config.json): "
                                     "restore it from a backup, then roll back")
            self.log("rollback", version=history[-2], rolled_back=seen)
            self.on_step("logged")
            self.point_at(history[-2])
        log(f"[adapt] rolled back: current -> {history[-2]} (was {seen})")
        return history[-2]

    # ---- repair ----------------------------------------------------------------------------------
    def unlogged(self, events: list[dict]) -> list[str]:
        """The version folders a kill left unlogged (at most one, the newest, never linked); refused when the
        folder holds what only lost log lines explain."""
        logged = {e["version"] for e in events if e["event"] in ADDS_A_VERSION}
        unlogged = [v for v in self.versions() if v not in logged]
        reports = [int(p.name) for p in (self.root / REPORTS).glob("[0-9][0-9][0-9][0-9]")]
        found = []
        if len(unlogged) > 1 or any(v < max(logged) for v in unlogged):
            found.append(f"version folders {', '.join(unlogged)} that it never logged")
        if self.linked() in unlogged:
            found.append(f"a current link to {self.linked()}, which it never logged")
        if max(reports, default=0) > len(events):
            found.append(f"{REPORTS}/{max(reports):04d} while it holds {len(events)} events")
        if found:
            raise AdaptHomeError(f"{self.root / DECISIONS} does not account for {'; '.join(found)}: {LOST}")
        return unlogged

    def unfinished(self, events: list[dict]) -> list[tuple[str, str]]:
        """What a command left half-done (at work now, or killed): (what it is, what the next command that writes
        the home does with it), as ``repair`` (and, for work/, the next adaptation) finishes or undoes it."""
        again = "; its traffic was not logged as used, so the next run or watch on it adapts again"
        removes = f"{WRITERS} removes it"
        out = [(f"{p}, a promoted candidate's copy, not published", removes + again)
               for p in sorted(self.root.glob(".staging-*"))]
        out += [(f"{self.root / v}, published, its promotion not logged", removes + again)
                for v in self.unlogged(events)]
        out += [(f"{p}, a new current link not put in place", removes)
                for p in sorted(self.root.glob(f".{CURRENT}.*"))]
        path = self.root / DECISIONS
        data = path.read_bytes() if path.is_file() else b""
        if data and not data.endswith(b"\n"):
            line = data.count(b"\n") + 1
            out.append((f"{path}:{line}, a line not finished (its event has not happened)", f"{WRITERS} drops it"))
        if (self.root / "work").exists():
            out.append((f"{self.root / 'work'}, a candidate not decided", "the next run or watch removes it and "
                        "starts the adaptation over (its traffic was not logged as used)"))
        return out

    def repair(self, log=print) -> None:
        """Make the folder agree with the decisions log after a kill (see the module docstring); everything is
        checked before anything is removed."""
        events = self.events()
        history = self.history()
        kind, said = self.link_state(history[-1]) if history else ("ok", "")
        if kind == "not a link":
            raise AdaptHomeError(f"{said}: move it aside (it may hold a draft), then run the command again; the "
                                 f"decisions log names the version ({history[-1]})")
        unlogged = self.unlogged(events)
        cut = self.cut_unterminated_tail()
        if cut:
            log(f"[adapt] {self.root / DECISIONS}:{cut}: dropped a line a kill cut short (its event never happened)")
        for leftover in [*self.root.glob(".staging-*"), *self.root.glob(f".{CURRENT}.*")]:
            if leftover.name.startswith(".staging-"):
                log(f"[adapt] removing {leftover.name}: killed while it was copied, before its promotion was logged")
            shutil.rmtree(leftover) if leftover.is_dir() and not leftover.is_symlink() else leftover.unlink()
        for name in unlogged:  # published, then killed before its decision was logged
            log(f"[adapt] removing {name}: killed before its promotion was logged")
            shutil.rmtree(self.root / name)
        if history and self.complete(history[-1]) and kind != "ok":
            log(f"[adapt] {said}: current -> {history[-1]} (as the decisions log says)")
            self.point_at(history[-1])


def _take(handle, grace: float) -> bool:
    """Take ``handle``'s exclusive lock if it is free, or freed within ``grace`` seconds; whether it was."""
    deadline = time.monotonic() + grace
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
