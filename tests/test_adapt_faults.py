"""An adaptation home never loses a version (issue 50): damaged logs and links, a kill at each step of a
promotion or rollback, the lock (status reads without it, rollback waits for a watch), signals to adapt and
the candidate's process group, folders of traffic for ``run``, and the regression rail's anchor. The home's
bookkeeping is tested directly, on drafts of two small files: nothing is trained or served here."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT
from specforge_lite.adapt.home import DECISIONS, AdaptHomeError, Home

STEPS = ("copied", "published", "logged", "link made", "linked")  # (as home.STEPS: checked below)

QUIET = dict(log=lambda message: None)
NUMBERS = {"current": {"traffic": 1.5, "regression": 1.4}, "candidate": {"traffic": 1.6, "regression": 1.4}}


def make_draft(tmp_path):
    """A draft as the home copies it: final/config.json and the run's config.yaml."""
    draft = tmp_path / "draft"
    (draft / "final").mkdir(parents=True, exist_ok=True)
    (draft / "final" / "config.json").write_text("{}")
    (draft / "config.yaml").write_text("x: 1\n")
    return draft


def promote(home, draft, numbers=NUMBERS):
    """A promotion as the old code made it (publish, log, link): the versions the damage tests protect."""
    name = home.publish(draft / "final", draft / "config.yaml")
    home.log("promote", version=name, parent=home.history()[-1], numbers=numbers)
    home.point_at(name)
    return name


def served_home(tmp_path, versions=3):
    """A home where v0001 was init and each later version was promoted, the newest current."""
    home, draft = Home(tmp_path / "home"), make_draft(tmp_path)
    home.root.mkdir()
    home.log("init", version=home.publish(draft / "final", draft / "config.yaml"))
    home.point_at("v0001")
    for _ in range(versions - 1):
        promote(home, draft)
    return home, draft


def state(home):
    """What a kill or a repair must never lose: the complete version folders, and the link (read from the disk)."""
    link = home.root / "current"
    return {"versions": sorted(p.parent.parent.name for p in home.root.glob("v[0-9][0-9][0-9][0-9]/final/config.json")),
            "current": os.readlink(link) if link.is_symlink() else None}


def adapt(*args, **kw):
    return subprocess.run([sys.executable, "-m", "specforge_lite.adapt", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, **kw)


def rewrite_line(home, n, text: bytes):
    lines = (home.root / DECISIONS).read_bytes().split(b"\n")
    lines[n - 1] = text
    (home.root / DECISIONS).write_bytes(b"\n".join(lines))


class Killed(Exception):
    """Stands for a kill at one step (raised from Home.on_step)."""


def kill_at(step):
    def on_step(done):
        if done == step:
            raise Killed(step)
    return on_step


class TestAHomeNeverLosesAVersion:
    def test_a_cut_short_last_line_does_not_swallow_the_next_event(self, tmp_path):
        """c1: a kill cut the log's last line short; the next event is written after it is cut off, so a
        completed promotion stays logged."""
        home = Home(tmp_path)
        home.log("init", version="v0001")
        with open(tmp_path / DECISIONS, "a") as f:
            f.write('{"event": "promote", "version": "v00')
        assert [e["event"] for e in home.events()] == ["init"]  # (the cut line never happened)
        home.log("promote", version="v0002", parent="v0001", numbers=NUMBERS)
        assert [e["event"] for e in home.events()] == ["init", "promote"] and home.history() == ["v0001", "v0002"]

    @pytest.mark.parametrize("damage, where", [
        (lambda home: rewrite_line(home, 2, b'{"event": "promote", "vers'), ":2:"),  # a damaged middle line
        (lambda home: rewrite_line(home, 1, b"\x00\x00\x00\x00"), ":1:"),  # a damaged first line
        (lambda home: rewrite_line(home, 2, b""), ":2:"),  # a line emptied
        (lambda home: rewrite_line(home, 3, b'{"event": "promote", "parent": "v0002"}'), ":3:"),  # its version lost
        (lambda home: rewrite_line(home, 2, b'["promote"]'), ":2:"),  # not an event
        (lambda home: (home.root / DECISIONS).write_bytes(b""), "holds no event"),  # the file emptied
        (lambda home: (home.root / DECISIONS).unlink(), "is missing"),  # the file gone
    ], ids=["middle", "first", "blank", "fields", "not-an-event", "emptied", "deleted"])
    def test_a_damaged_log_is_named_and_nothing_is_removed(self, tmp_path, damage, where):
        home, _ = served_home(tmp_path)
        before = state(home)
        damage(home)
        with pytest.raises(AdaptHomeError, match=f"{DECISIONS}.*{where}" if where.startswith(":") else where) as e:
            Home(home.root).repair(**QUIET)
        assert "Nothing was changed" in str(e.value) and "\n" not in str(e.value)
        assert state(home) == before == {"versions": ["v0001", "v0002", "v0003"], "current": "v0003"}

    def test_init_refuses_a_home_that_holds_versions(self, tmp_path):
        """A damaged first line once made the home look new, and init published over it."""
        from specforge_lite.adapt import init

        home, draft = served_home(tmp_path)
        rewrite_line(home, 1, b"garbage")
        before = state(home)
        with pytest.raises(AdaptHomeError, match="already holds an adaptation .*v0001, v0002, v0003"):
            init(home, draft, [], {"judge": "ours"}, **QUIET)
        assert state(home) == before

    @pytest.mark.parametrize("lose", ["linked", "rolled back", "two unlogged"])
    def test_whole_lines_lost_are_noticed_before_a_version_is_removed(self, tmp_path, lose):
        """A log cut at a line boundary looks like a kill before logging, unless the folder says otherwise: the
        link names the unlogged version, a decision's report is numbered past the log, two versions are unlogged."""
        home, draft = served_home(tmp_path, versions=2)
        kept = (home.root / DECISIONS).read_bytes()
        promote(home, draft)  # v0003
        if lose == "rolled back":
            home.rollback(**QUIET)
            (home.root / "reports" / "0004").mkdir(parents=True)  # (decision 3's report; a rollback writes none)
        if lose == "two unlogged":
            home.point_at("v0002")
            promote(home, draft)  # v0004
        (home.root / DECISIONS).write_bytes(kept)  # the lines since v0002 are lost whole
        before = state(home)
        with pytest.raises(AdaptHomeError, match="does not account for .*lost lines"):
            Home(home.root).repair(**QUIET)
        assert state(home) == before

    @pytest.mark.parametrize("step", STEPS)
    def test_a_promotion_killed_at_each_step_loses_no_version(self, tmp_path, step):
        from specforge_lite.adapt import home as home_module

        assert STEPS == home_module.STEPS
        home, draft = served_home(tmp_path, versions=2)
        home.on_step = kill_at(step)
        with pytest.raises(Killed):
            home.add_version("promote", draft / "final", draft / "config.yaml", parent="v0002", numbers=NUMBERS)
        after = Home(home.root)  # the next command
        after.repair(**QUIET)
        logged = STEPS.index(step) >= STEPS.index("logged")
        assert state(after) == {"versions": ["v0001", "v0002", *(["v0003"] if logged else [])],
                                "current": "v0003" if logged else "v0002"}
        assert after.history()[-1] == state(after)["current"] and not [
            p for p in after.root.iterdir() if p.name.startswith((".staging-", ".current."))]
        assert after.add_version("promote", draft / "final", draft / "config.yaml", parent=after.history()[-1],
                                 numbers=NUMBERS)["version"] == ("v0004" if logged else "v0003")

    @pytest.mark.parametrize("step", ["logged", "link made"])
    def test_a_rollback_killed_after_its_line_is_finished_by_repair(self, tmp_path, step):
        home, _ = served_home(tmp_path)
        home.on_step = kill_at(step)
        with pytest.raises(Killed):
            home.rollback(**QUIET)
        after = Home(home.root)
        after.repair(**QUIET)
        assert state(after) == {"versions": ["v0001", "v0002", "v0003"], "current": "v0002"}

    def test_a_link_that_is_gone_or_dangling_is_remade_and_a_folder_in_its_place_is_refused(self, tmp_path):
        home, _ = served_home(tmp_path)
        (home.root / "current").unlink()
        home.repair(**QUIET)
        assert state(home)["current"] == "v0003"
        home.point_at("v0009")  # dangling
        home.repair(**QUIET)
        assert state(home)["current"] == "v0003"
        (home.root / "current").unlink()
        (home.root / "current").mkdir()  # someone copied a draft there
        (home.root / "current" / "config.json").write_text("{}")
        with pytest.raises(AdaptHomeError, match="current is a folder, not a link: move it aside"):
            home.repair(**QUIET)
        assert (home.root / "current" / "config.json").is_file()
        assert state(home)["versions"] == ["v0001", "v0002", "v0003"]

    def test_a_current_version_that_is_gone_is_said_and_refused_and_rollback_gets_past_it(self, tmp_path):
        from specforge_lite.adapt.__main__ import status

        home, _ = served_home(tmp_path)
        (home.root / "v0003" / "final" / "config.json").unlink()
        with pytest.raises(AdaptHomeError, match="v0003, the current version .* missing .*roll back to v0002"):
            home.current()
        text, well = status(home)
        assert not well and sum("error:" in line and "v0003" in line for line in text.splitlines()) == 1
        home.repair(**QUIET)  # (nothing to repair: the link stays where the log says)
        assert home.rollback(**QUIET) == "v0002" and home.current() == home.root / "v0002"
        assert status(home)[1]

    def test_status_reads_without_the_lock_and_damage_is_one_line(self, tmp_path):
        """status while a command holds the lock (a watch adapting); a damaged log, named by status and by init."""
        home, draft = served_home(tmp_path)
        with home.lock(**QUIET):
            proc = adapt("status", "--home", home.root)
        assert proc.returncode == 0 and "current -> v0003" in proc.stdout, proc.stderr
        rewrite_line(home, 2, b"{not json")
        for args, said in ((["status"], f"{home.root / DECISIONS}:2: not a JSON line"),
                           (["init", "--draft", draft], f"{home.root} already holds an adaptation (v0001")):
            proc = adapt(*args, "--home", home.root)
            assert proc.returncode == 1 and proc.stderr.startswith(f"error: {said}") and "Traceback" not in proc.stderr
            assert len(proc.stderr.strip().splitlines()) == 2  # (the line, and where the traceback is)
        assert state(home)["versions"] == ["v0001", "v0002", "v0003"]

    def test_rollback_waits_for_a_watch_and_does_not_undo_what_it_promoted_meanwhile(self, tmp_path):
        home, draft = served_home(tmp_path)
        said, outcome = [], {}

        def rollback():
            try:
                outcome["current"] = Home(home.root).rollback(log=said.append)
            except AdaptHomeError as e:
                outcome["error"] = str(e)

        for promote_meanwhile in (False, True):
            said.clear(), outcome.clear()
            with home.lock(**QUIET):  # a watch, adapting
                waiter = threading.Thread(target=rollback)
                waiter.start()
                deadline = time.monotonic() + 10
                while not said and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert said and "waiting for" in said[0] and not outcome
                if promote_meanwhile:
                    promote(home, draft)
            waiter.join(10)
            if promote_meanwhile:
                assert "current moved from v0002 to v0004" in outcome["error"] and state(home)["current"] == "v0004"
            else:
                assert outcome == {"current": "v0002"} and state(home)["current"] == "v0002"


    def test_a_running_watch_lets_rollback_and_status_through_between_looks(self, tmp_path):
        """H4: a watch holds the home's lock only while it looks and adapts; between looks (here: a 60 s
        interval) a rollback takes the lock at once and status reads, both as separate commands."""
        from specforge_lite.adapt.loop import DEFAULTS

        home, _ = served_home(tmp_path)
        (home.root / "settings.json").write_text(json.dumps({**DEFAULTS, "judge": "ours"}))
        inbox = tmp_path / "inbox"
        inbox.mkdir()
        watcher = subprocess.Popen([sys.executable, "-m", "specforge_lite.adapt", "watch", str(inbox), "--home",
                                    str(home.root), "--interval", "60"], cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            assert "watching" in watcher.stdout.readline()
            time.sleep(0.5)  # (its first look, under the lock, is over well within this)
            rolled = adapt("rollback", "--home", home.root)
            assert rolled.returncode == 0 and "current -> v0002" in rolled.stdout, rolled.stdout + rolled.stderr
            assert "waiting for" not in rolled.stdout and state(home)["current"] == "v0002"
            assert adapt("status", "--home", home.root).returncode == 0
            assert watcher.poll() is None  # (the watch goes on)
        finally:
            watcher.terminate()
            watcher.communicate(timeout=30)


class TestRunAndTheRails:
    def test_run_takes_a_folders_unused_traffic_files_as_watch_does(self, tmp_path, monkeypatch):
        from specforge_lite.adapt import loop

        home, _ = served_home(tmp_path, versions=1)
        inbox = tmp_path / "inbox"
        (inbox / "day2").mkdir(parents=True)
        for name in ("a.jsonl", "day2/b.log", "notes.md"):
            (inbox / name).write_text(f'{{"file": "{name}"}}\n')  # (each its own content: a copy is used once)
        taken = []
        monkeypatch.setattr(loop, "adapt_once", lambda home, files, log: taken.append(files) or {"event": "skip"})
        loop.run(home, [inbox, inbox / "a.jsonl"], **QUIET)
        assert taken == [[inbox / "a.jsonl", inbox / "day2" / "b.log"]]  # each once, the .md left out
        home.log("skip", files=[loop._file_record(inbox / "a.jsonl")], why="used")
        loop.run(home, [inbox], **QUIET)
        assert taken[-1] == [inbox / "day2" / "b.log"]
        for bad, why in ((inbox / "gone.jsonl", "no such file or folder"), (inbox / "notes.md", "not a traffic file")):
            with pytest.raises(AdaptHomeError, match=why):
                loop.run(home, [bad], **QUIET)

    def test_a_slow_slide_on_the_regression_set_is_caught(self, tmp_path):
        """Each candidate falls 1.9% on the regression set, within the 2% tolerance of its parent: against its
        parent alone, ten promotions would lose 17%; against the first version the second is refused."""
        from specforge_lite.adapt.judge import decide

        home, draft = served_home(tmp_path, versions=1)
        current, decisions = {"traffic": 1.5, "regression": 1.4}, []
        for _ in range(10):
            candidate = {"traffic": current["traffic"] * 1.05, "regression": current["regression"] * 0.981}
            promoted, why = decide(current, candidate, 0.02, 0.02, home.first_regression())
            decisions.append(promoted)
            if not promoted:
                break
            promote(home, draft, {"current": current, "candidate": candidate})
            current = candidate
        assert decisions == [True, False] and why.startswith("the regression set fell below the first version's")
        assert "from the first version's 1.400" in why


def adapting_home(tmp_path, rows=40, **settings):
    """A home of one version with the adaptation's settings, and a traffic file (OpenAI exchange rows)."""
    from specforge_lite.adapt.loop import DEFAULTS

    home, _ = served_home(tmp_path, versions=1)
    (home.root / "settings.json").write_text(json.dumps({**DEFAULTS, "judge": "ours", "heldout_fraction": 0.25,
                                                         **settings}))
    return home, traffic_file(tmp_path / "day1.jsonl", rows)


def traffic_file(path, n, start=0):
    rows = [{"request": {"messages": [{"role": "user", "content": f"Question {i}: how do I sort list {i}?"}]},
             "response": {"choices": [{"message": {"role": "assistant", "content": f"Answer {i}: sorted()."}}]}}
            for i in range(start, start + n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class TestCandidates:
    def test_a_failed_candidates_work_is_removed_and_its_log_kept(self, tmp_path, monkeypatch):
        """H10: the work/ folder of a failed candidate (its run, its data) is removed; its training log is kept
        under reports/NNNN/ (NNNN: the fail decision's line), named by the decision."""
        from specforge_lite.adapt import loop

        home, traffic = adapting_home(tmp_path)

        def failing(home, current, train, work, log):
            (work / "run").mkdir()
            (work / "run" / "weights.bin").write_bytes(b"\0" * 1000)
            (work / "train.log").write_text("step 1\nOSError: No space left on device\n")
            raise RuntimeError("the candidate's training failed (exit 1)")

        monkeypatch.setattr(loop, "train_candidate", failing)
        event = loop.adapt_once(home, [traffic], **QUIET)
        assert event["event"] == "fail" and not (home.root / "work").exists()
        kept = home.root / event["log"]
        assert kept == home.root / "reports" / f"{len(home.events()):04d}" / "train.log"
        assert kept.read_text().endswith("No space left on device\n")
        home.repair(**QUIET)  # (the log accounts for the report's folder)
        assert state(home) == {"versions": ["v0001"], "current": "v0001"}

    def test_a_candidate_past_its_timeout_is_stopped_with_one_line(self, tmp_path, monkeypatch):
        """H10: the candidate's training has a timeout (timeout_minutes in settings.json, --timeout-minutes at
        init): past it, its whole process group is stopped and the failure is one line naming the setting."""
        from specforge_lite.adapt import candidate
        from specforge_lite.adapt.stopping import TimedOut, run_in_own_group

        sleeper = [sys.executable, "-c", "import os, sys, time; print(os.getpid(), flush=True); time.sleep(60)"]
        out = tmp_path / "out.txt"
        started = time.monotonic()
        with open(out, "w") as f, pytest.raises(TimedOut):
            run_in_own_group(sleeper, f, grace=1.0, timeout=0.5)
        assert time.monotonic() - started < 10
        assert wait_until(lambda: not alive(int(out.read_text().split()[-1])), 5)

        home, _ = adapting_home(tmp_path, timeout_minutes=0.01)
        monkeypatch.setattr(candidate, "candidate_config", lambda *args: {"trainer": {"max_steps": 1}})
        monkeypatch.setattr(candidate, "job_command", lambda config_file, run_dir: sleeper)
        work = home.root / "work"
        work.mkdir()
        with pytest.raises(candidate.CandidateTimedOut, match="ran past its timeout of 0.01 min") as e:
            candidate.train_candidate(home, home.root / "v0001", [[{"role": "user", "content": "hi"}]], work, **QUIET)
        assert "timeout_minutes" in str(e.value) and "\n" not in str(e.value)

        from specforge_lite.adapt import init  # (init refuses a timeout within the training's own budget)

        for minutes, timeout, said in ((10, 5, "more than its budget \\(--minutes 10\\)"), (None, 0, "more minutes")):
            with pytest.raises(AdaptHomeError, match=f"--timeout-minutes {timeout}: give the candidate's .* {said}"):
                init(Home(tmp_path / f"new{minutes}"), tmp_path, [], {"judge": "ours", "minutes": minutes,
                                                                      "timeout_minutes": timeout}, **QUIET)

    def test_traffic_is_used_once_whatever_its_name(self, tmp_path, monkeypatch):
        """H10: a traffic file is trained on once. run leaves out a file named again after its decision, and a
        copy of it under another name or in a folder (the same content: its fingerprint), as watch does."""
        from specforge_lite.adapt import loop

        home, traffic = adapting_home(tmp_path)
        taken, said = [], []

        def adapt_once(home, files, log):
            taken.append(files)
            return home.log("reject", files=[loop._file_record(f) for f in files], why="judged")

        monkeypatch.setattr(loop, "adapt_once", adapt_once)
        loop.run(home, [traffic], log=said.append)
        assert loop.run(home, [traffic], log=said.append) is None  # named again
        inbox = tmp_path / "inbox"
        inbox.mkdir()
        shutil.copy(traffic, inbox / "copy.jsonl")
        assert loop.run(home, [inbox / "copy.jsonl"], log=said.append) is None  # a copy, named
        assert loop.run(home, [inbox], log=said.append) is None  # a copy, in a folder
        loop.look(home, inbox, settle=0, wanted=1, log=said.append)  # watch
        assert taken == [[traffic]]
        assert any("used already" in line for line in said)
        fresh = traffic_file(inbox / "day2.jsonl", 40, start=40)
        loop.run(home, [inbox, traffic], log=said.append)
        assert taken == [[traffic], [fresh]]


def alive(pid: int) -> bool:
    """Running (a zombie, ended and waiting to be reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_until(condition, seconds=15.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


# adapt, as it runs a candidate: its signals handled, the candidate in a group of its own
PARENT = """import subprocess, sys
from specforge_lite.adapt.stopping import run_in_own_group, stopped_by_signals
with stopped_by_signals():
    run_in_own_group([sys.executable, "-c", sys.argv[1], *sys.argv[2:4]], subprocess.DEVNULL, grace=1.0)
"""
# a candidate with a child of its own; "deaf" ignores SIGTERM and SIGINT (both then inherit it)
CANDIDATE = """import os, signal, sys, time
if sys.argv[2] == "deaf":
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
child = os.fork()
if child == 0:
    time.sleep(120)
    os._exit(0)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {child}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(120)
"""


@pytest.fixture
def adapt_with_a_candidate(tmp_path):
    """Start a stand-in adapt whose candidate has a child; (adapt, [candidate, its child]). Whatever is left is
    killed at the end, by the ids this test started."""
    started = []

    def start(mode):
        pids = tmp_path / "pids"
        parent = subprocess.Popen([sys.executable, "-c", PARENT, CANDIDATE, str(pids), mode], cwd=ROOT,
                                  stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        started.append(parent.pid)
        assert wait_until(pids.is_file, 60), "the candidate did not start"
        group = [int(p) for p in pids.read_text().split()]
        started.extend(group)
        return parent, group

    yield start
    for pid in started:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("mode", ["obeys", "deaf"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_adapt_ends_the_candidates_whole_group(adapt_with_a_candidate, sig, mode):
    """The signal goes to the candidate's group; what ignores it is killed after the grace; adapt says so in one
    line and exits as a shell's signal death does."""
    parent, group = adapt_with_a_candidate(mode)
    os.kill(parent.pid, sig)
    _, err = parent.communicate(timeout=30)
    assert parent.returncode == 128 + sig and f"stopped by {signal.Signals(sig).name}" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert wait_until(lambda: not any(alive(p) for p in group), 5), [p for p in group if alive(p)]


def test_a_candidate_dies_with_adapt_even_by_sigkill(adapt_with_a_candidate):
    parent, (candidate, _) = adapt_with_a_candidate("obeys")
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(10)
    assert wait_until(lambda: not alive(candidate), 5)
