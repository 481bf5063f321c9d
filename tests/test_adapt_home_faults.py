"""The adaptation home's symptoms of issue 63, each as a user meets it: a ``current`` link broken in any way, an
export adapted for another target than its own, two ``adapt run`` at once, a damaged settings file, and what a
killed promotion leaves behind as ``status`` tells it. Tested on homes laid out by hand (test_adapt_faults.py's
helpers): nothing is trained or served here."""

from __future__ import annotations

import json
import os
import threading

import pytest

from specforge_lite.adapt.home import AdaptHomeError, Home
from test_adapt_faults import NUMBERS, QUIET, Killed, kill_at, served_home, state, traffic_file


def status_of(home):
    from specforge_lite.adapt.__main__ import status

    return status(Home(home.root))


def main_error(*argv) -> str:
    """What ``python -m specforge_lite.adapt ARGV`` ends with on stderr (run in this process: fast)."""
    from specforge_lite.adapt.__main__ import main

    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    return str(e.value.code)


# ---- 1. the current link, broken in any way -------------------------------------------------------------
def _relink(home, target):
    (home.root / "current").unlink()
    os.symlink(target, home.root / "current")


BROKEN_LINKS = {
    "dangling": lambda home, tmp: _relink(home, "v0009"),
    "loop": lambda home, tmp: _relink(home, "current"),
    "to-a-file": lambda home, tmp: _relink(home, "decisions.jsonl"),
    "into-a-version": lambda home, tmp: _relink(home, "v0003/final"),
    "outside": lambda home, tmp: _relink(home, str(tmp / "elsewhere")),
    "missing": lambda home, tmp: (home.root / "current").unlink(),
}


@pytest.mark.parametrize("damage", BROKEN_LINKS)
def test_a_broken_current_link_is_an_error_in_status_and_remade_from_the_log(tmp_path, damage):
    """status exits 1 naming what the link is and what the next command does; that command remakes it as the
    decisions log says and says what it was."""
    home, _ = served_home(tmp_path)
    (tmp_path / "elsewhere" / "final").mkdir(parents=True)
    (tmp_path / "elsewhere" / "final" / "config.json").write_text("{}")
    BROKEN_LINKS[damage](home, tmp_path)
    text, well = status_of(home)
    errors = [line for line in text.splitlines() if "error:" in line]
    assert not well and len(errors) == 1, text
    assert str(home.root / "current") in errors[0] and "points it at v0003" in errors[0], errors[0]
    said = []
    Home(home.root).repair(log=said.append)
    assert state(home) == {"versions": ["v0001", "v0002", "v0003"], "current": "v0003"}
    assert any("current -> v0003" in line and str(home.root / "current") in line for line in said), said
    assert status_of(home)[1]


@pytest.mark.parametrize("what", ["folder", "file"])
def test_a_folder_or_file_in_place_of_current_is_an_error_in_status_and_refused(tmp_path, what):
    home, _ = served_home(tmp_path)
    (home.root / "current").unlink()
    if what == "folder":
        (home.root / "current").mkdir()
        (home.root / "current" / "config.json").write_text("{}")
    else:
        (home.root / "current").write_text("v0003\n")
    text, well = status_of(home)
    errors = [line for line in text.splitlines() if "error:" in line]
    assert not well and len(errors) == 1 and f"current is a {what}, not a link: move it aside" in errors[0], text
    with pytest.raises(AdaptHomeError, match=f"current is a {what}, not a link: move it aside"):
        Home(home.root).repair(**QUIET)
    assert (home.root / "current").exists() and not (home.root / "current").is_symlink()


# ---- 2. an export is adapted for its own target -------------------------------------------------------------
def export_folder(tmp_path, target=None, method="eagle3"):
    """An export folder as ours are written (config.json with our provenance block; speculators' names its
    target as its verifier)."""
    folder = tmp_path / "exported"
    folder.mkdir()
    config = {"architectures": ["LlamaForCausalLMEagle3"], "specforge_lite": {"spec": {"method": method}}}
    if target:
        config["speculators_config"] = {"verifier": {"name_or_path": target}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_an_export_that_does_not_name_its_target_is_refused_at_init(tmp_path):
    """Without model=..., init composed the embedded default's target (SmolLM2) for every candidate."""
    from specforge_lite.adapt import init

    export, home = export_folder(tmp_path), Home(tmp_path / "home")
    with pytest.raises((AdaptHomeError, ValueError), match="config.json does not name the target .*model=") as e:
        init(home, export, ["data=sharegpt"], {"judge": "ours"}, **QUIET)
    assert "\n" not in str(e.value) and not (home.root / "v0001").exists()
    assert not (home.root / "decisions.jsonl").exists()


@pytest.mark.parametrize("setting, value", [("heldout_fraction", 1.5), ("k", 0), ("steps", 0), ("minutes", -1)])
def test_init_refuses_a_setting_run_would_refuse(tmp_path, setting, value):
    """init wrote --heldout-fraction 1.5 (and --k 0, --steps 0, --minutes -1) into the home; adapt run then called
    settings.json damaged and sent the user to a backup."""
    from specforge_lite.adapt import init

    export, home = export_folder(tmp_path, target="meta-llama/Llama-3.1-8B-Instruct"), Home(tmp_path / "home")
    with pytest.raises(AdaptHomeError, match=rf"^--{setting.replace('_', '-')} {value}: ") as e:
        init(home, export, [], {"judge": "ours", setting: value}, **QUIET)
    assert "\n" not in str(e.value) and not (home.root / "settings.json").exists()


def test_an_export_is_adapted_for_the_target_and_method_it_names(tmp_path):
    from specforge_lite.adapt.loop import base_config

    export = export_folder(tmp_path, target="meta-llama/Llama-3.1-8B-Instruct", method="dflash2")
    config = base_config(export, [])
    assert config.model.path == "meta-llama/Llama-3.1-8B-Instruct" and config.draft.method == "dflash2"
    config = base_config(export, ["model=qwen3_8b"])  # (the overrides name it: theirs)
    assert config.model.path == "Qwen/Qwen3-8B"


# ---- 3. one adapt run at a time ----------------------------------------------------------------------
def test_a_second_adapt_run_is_refused_naming_the_first(tmp_path, monkeypatch):
    """Two adapt run on one home: the second waited for the first and ran too; it is refused, naming the
    holder (as a second training run in one output folder is)."""
    from specforge_lite.adapt import loop

    home, _ = served_home(tmp_path, versions=1)
    started, release, outcome = threading.Event(), threading.Event(), {}

    def adapt_once(home, files, log):
        started.set()
        release.wait(10)
        return home.log("reject", numbers=NUMBERS, why="judged")

    monkeypatch.setattr(loop, "adapt_once", adapt_once)
    first = threading.Thread(target=lambda: loop.run(Home(home.root), [traffic_file(tmp_path / "a.jsonl", 4)],
                                                     **QUIET))
    first.start()

    def second():
        try:
            outcome["event"] = loop.run(Home(home.root), [traffic_file(tmp_path / "b.jsonl", 4, start=4)], **QUIET)
        except AdaptHomeError as e:
            outcome["error"] = str(e)

    waiter = threading.Thread(target=second)
    try:
        assert started.wait(10)
        waiter.start()
        waiter.join(5)
        assert not waiter.is_alive(), "the second run waited for the first"
    finally:
        release.set()
        first.join(10)
        waiter.join(10)
    assert "error" in outcome, outcome
    assert f"adapt run, pid {os.getpid()}" in outcome["error"] and "wait for it" in outcome["error"]
    assert [e["event"] for e in home.events()] == ["init", "reject"]  # (the second changed nothing)


# ---- 4. a damaged settings file ----------------------------------------------------------------------
def full_settings(**changes):
    from specforge_lite.adapt.loop import DEFAULTS

    return {**DEFAULTS, "judge": "ours", **changes}


SETTINGS_DAMAGE = {
    "unterminated": '{\n "judge": "ours",\n "margin": 0.02,\n "tolerance": 0.02,\n "replay_ratio": 0.25,\n'
                    ' "heldout_fraction": 0.2,\n "min_conversations": 64,\n "steps": "2',
    "empty": "",
    "not-a-mapping": "[0.02, 0.02]\n",
    "number-as-text": json.dumps(full_settings(margin="0.02")),
    "bool-as-count": json.dumps(full_settings(steps=True)),
    "fraction-as-count": json.dumps(full_settings(min_conversations=6.5)),
    "judge-unknown": json.dumps(full_settings(judge="gpt4")),
    "missing-key": json.dumps({k: v for k, v in full_settings().items() if k != "tolerance"}),
    "unknown-key": json.dumps(full_settings(margn=0.5)),
}


@pytest.mark.parametrize("damage", SETTINGS_DAMAGE)
def test_a_damaged_settings_file_is_named_with_the_way_out(tmp_path, damage):
    from specforge_lite.adapt.home import KINDS
    from specforge_lite.adapt.loop import DEFAULTS

    assert set(KINDS) == set(DEFAULTS)  # (every setting init writes is checked when it is read)
    home, _ = served_home(tmp_path, versions=1)
    path = home.root / "settings.json"
    path.write_text(json.dumps(full_settings()))
    assert home.settings() == full_settings()
    path.write_text(SETTINGS_DAMAGE[damage])
    with pytest.raises(AdaptHomeError) as e:
        home.settings()
    said = str(e.value)
    assert said.startswith(f"{path}") and "\n" not in said and "docs/adapt.md" in said, said


def test_adapt_run_with_damaged_settings_says_which_file(tmp_path):
    """The symptom as it was met: 'Unterminated string starting at: line 7 column 2' and nothing else."""
    home, _ = served_home(tmp_path, versions=1)
    (home.root / "settings.json").write_text(SETTINGS_DAMAGE["unterminated"])
    said = main_error("run", "--home", home.root, traffic_file(tmp_path / "a.jsonl", 4))
    assert said.startswith(f"error: {home.root / 'settings.json'}: not JSON (Unterminated string"), said
    (home.root / "settings.json").unlink()
    said = main_error("run", "--home", home.root, tmp_path / "a.jsonl")
    assert said.startswith(f"error: {home.root / 'settings.json'} is missing"), said


# ---- 5. what a kill left, as status tells it -------------------------------------------------------------
@pytest.mark.parametrize("step, left, next_does", [
    ("copied", ".staging-v0004", "removes it"),
    ("published", "v0004", "removes it"),
    ("link made", "v0004", "points it at v0004"),
])
def test_status_says_what_a_killed_promotion_left_and_what_comes_next(tmp_path, step, left, next_does):
    home, draft = served_home(tmp_path)
    home.on_step = kill_at(step)
    with pytest.raises(Killed):
        home.add_version("promote", draft / "final", draft / "config.yaml", parent="v0003", numbers=NUMBERS)
    text, well = status_of(home)
    said = [line for line in text.splitlines() if left in line and "the next command" in line]
    assert well and said and next_does in said[0], text
    if step != "link made":  # (its decision was not logged: the traffic is adapted on again)
        assert "again" in said[0], said[0]
    Home(home.root).repair(**QUIET)
    text, _ = status_of(home)
    assert "the next command" not in text, text


def test_status_tells_a_kill_from_a_command_at_work(tmp_path):
    """A staging folder, a candidate's work/ and a cut-short log line: left by a kill when nothing holds the
    home; being written by the holder (named) when a command holds it."""
    home, _ = served_home(tmp_path)
    (home.root / ".staging-v0004" / "final").mkdir(parents=True)
    (home.root / "work" / "run").mkdir(parents=True)
    with open(home.root / "decisions.jsonl", "a") as f:
        f.write('{"event": "promote", "vers')
    text, well = status_of(home)
    assert well and "killed" in text and "work" in text and "decisions.jsonl:4" in text, text
    with home.lock(**QUIET):
        text, well = status_of(home)
    assert well and f"pid {os.getpid()}" in text and "killed" not in text, text


def test_status_names_folders_the_log_cannot_account_for(tmp_path):
    """Lost log lines (two versions it never logged, current linked to one): status says what every command that
    writes the home will refuse, and promises no repair of the link."""
    from test_adapt_faults import promote

    home, draft = served_home(tmp_path, versions=1)
    kept = (home.root / "decisions.jsonl").read_bytes()
    promote(home, draft), promote(home, draft)
    (home.root / "decisions.jsonl").write_bytes(kept)
    text, well = status_of(home)
    assert not well and "error:" in text and "does not account for" in text and "points it at" not in text, text
