"""Drafts that learn from the traffic they serve.

    python -m specforge_lite.adapt init --home drafts --draft RUN_OR_EXPORT [options] [key=value ...]
    python -m specforge_lite.adapt run --home drafts TRAFFIC [TRAFFIC ...]
    python -m specforge_lite.adapt watch DIR --home drafts [--interval 30] [--settle 10] [--once]
    python -m specforge_lite.adapt rollback --home drafts
    python -m specforge_lite.adapt status --home drafts

``init`` makes the draft version v0001 of a new home (one holding versions is refused) and fixes the rails.
With a run folder its config.yaml is the base (``key=value`` overrides on top); with an export folder the
overrides compose it as train.py would (``model=... data=...``), for the target the export names (speculators'
verifier; one that names none is refused until model=... names it). ``run`` adapts once on the traffic files given
(OpenAI chat-completion logs, ShareGPT or messages JSONL, a vLLM request log) and the folders' files, ``watch``
whenever enough new conversations land in DIR; a file's content is trained on once, whatever its name. Each candidate
is trained from the current version on the traffic plus a replay slice of the base data, judged against the
current version on held-out traffic and the frozen regression set (served by vLLM unless --judge ours), and
promoted only past the rails. ``current`` always names a complete version; every decision is in
HOME/decisions.jsonl with its numbers. ``status`` reads without the home's lock, and says what a broken
``current`` link or a killed command left and what the next command does with it; ``rollback`` and ``watch`` wait
for the lock while another command holds it, ``run`` is refused, naming the holder. SIGTERM or SIGINT stops
adapt and the candidate's training with it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import said_in_one_line
from .home import WRITERS, AdaptHomeError, Home
from .loop import DEFAULTS, check_judge, init, run, watch
from .stopping import stopped_by_signals


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specforge_lite.adapt", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("init", "run", "watch", "rollback", "status"):
        c = sub.add_parser(name)
        c.add_argument("--home", type=Path, default=Path("drafts"), help="the adaptation's folder (default drafts/)")
        if name == "init":
            c.add_argument("--draft", type=Path, required=True, help="a finished run folder or an export folder")
            c.add_argument("--regression", type=Path, default=None,
                           help="the frozen regression prompts (MT-bench jsonl); default: the first prompts of "
                                "each bundled set")
            c.add_argument("--regression-prompts", type=int, default=4, help="per bundled set (default 4)")
            for key, value in DEFAULTS.items():
                kind = str if key == "judge" else (int if isinstance(value, int) else float)
                c.add_argument("--" + key.replace("_", "-"), type=kind, default=value,
                               help=f"default {value}")
            c.add_argument("overrides", nargs="*", help="key=value (a run's config) or train.py overrides (an export)")
        elif name == "run":
            c.add_argument("traffic", nargs="+", type=Path, help="traffic files or folders of them")
        elif name == "watch":
            c.add_argument("folder", type=Path, help="where traffic files land")
            c.add_argument("--interval", type=float, default=30, help="seconds between looks (default 30)")
            c.add_argument("--settle", type=float, default=10,
                           help="a file unchanged this long is complete (default 10 s)")
            c.add_argument("--once", action="store_true", help="look once, adapt at most once, then stop")
    return p


def status(home: Home) -> tuple[str, bool]:
    """Where the home stands, read without its lock (a watch may be adapting); whether all is well. A ``current``
    link that does not name the log's current version is said with what the next command does about it (an
    error when it names no complete version); so is what a command at work, or a killed one, left half-done."""
    events = home.require().events()
    history = home.history()
    want, holder = history[-1], home.held_by()
    lines, problem = [f"{home.root}: current -> {want}"], home.current_problem()
    if holder:
        lines.append(f"  {holder} is writing the home now")
    if problem:
        lines.append(f"  error: {problem}")
    try:
        unfinished, refused = home.unfinished(events), None
    except AdaptHomeError as e:  # (folders the log cannot account for: every command that writes refuses)
        unfinished, refused = [], str(e)
    # (what repair does with the link: nothing while it refuses, or while the current version is gone)
    then = "" if refused or problem else f": {WRITERS} points it at {want}"
    kind, said = home.link_state(want)
    if kind == "not a link":
        lines.append(f"  error: {said}: move it aside (it may hold a draft); every command that writes the home "
                     f"refuses until then (the decisions log says {want})")
    elif kind == "broken":
        lines.append(f"  error: {said}; the decisions log says {want}{then}")
    elif kind == "moved" and holder:
        lines.append(f"  {said}, the decisions log {want}: {holder} is swapping it")
    elif kind == "moved" and then:
        lines.append(f"  {said}, the decisions log {want} (a promotion or rollback killed after its line was logged, "
                     f"or a link changed by hand; to serve an older version, roll back){then}")
    if refused:
        lines.append(f"  error: {refused}")
    for what, next_does in unfinished:
        lines.append(f"  {what}: the command writing the home is at work on it" if holder else
                     f"  {what}, left by a command that was killed: {next_does}")
    for e in events[-10:]:
        what = e.get("why") or e.get("error") or e.get("source") or e.get("rolled_back", "")
        lines.append(f"  {e.get('time', '?')} {e['event']:<8} {e.get('version', e.get('parent', '')):<6} {what}")
    return "\n".join(lines), not (problem or refused) and kind not in ("broken", "not a link")


def main(argv=None) -> None:
    a = _parser().parse_args(argv)
    home = Home(a.home)
    with stopped_by_signals(), said_in_one_line():
        if a.command == "init":
            settings = {key: getattr(a, key) for key in DEFAULTS}
            init(home, a.draft, a.overrides, settings, a.regression, a.regression_prompts)
            return
        home.require()
        if a.command in ("run", "watch"):
            check_judge(home.settings()["judge"])
        if a.command == "run":
            event = run(home, a.traffic)
            if event is not None and event["event"] == "fail":
                sys.exit(f"error: {event['error']}")
        elif a.command == "watch":
            watch(home, a.folder, a.interval, a.settle, a.once)
        elif a.command == "rollback":
            home.rollback()
        text, well = status(home)
        print(text)
        if not well:
            sys.exit(1)


if __name__ == "__main__":
    main()
