"""The default draft adapted to a stream of requests unlike its training data, judged by vLLM.

    python -m specforge_lite.bench adapt [--base RUN] [--requests 320] [--steps 200] [--rounds 1] [--out DIR]

1. The draft: ``--base`` (a finished run of the embedded default), else ``python train.py`` is run once.
2. The traffic: code and math requests (written from templates with random numbers; the default trains on
   chit-chat and general requests) sent to vLLM serving the target alone, greedy, with its request log on
   (``--enable-log-requests --enable-log-outputs``): that log is the traffic, as a server writes it.
3. One adaptation per round (``python -m specforge_lite.adapt``'s own loop, ``watch --once`` on the traffic
   folder): the default draft is version v0001; each round's candidate trains from the current version on the
   new log's training split plus the default's data replayed, and vLLM serves both drafts on held-out
   requests of the stream and on the frozen regression set (the bundled assistant, MT-bench, GSM8K,
   summarisation and HumanEval prompts). Round r's requests are drawn with seed r - 1.

The table gives, from each round's decision, served acceptance before and after on each set and the ratio.
A bench run is resumable: the base run, the traffic logs and the decided rounds in ``--out`` are reused.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..serving import ROOT

CODE_TASKS = [
    "returns the n-th Fibonacci number", "checks whether a string is a palindrome", "merges two sorted lists",
    "counts the vowels in a string", "returns the largest of three numbers", "removes duplicates from a list",
    "reverses the words of a sentence", "computes the factorial of n", "checks whether a number is prime",
    "flattens a nested list", "returns the second largest element of a list", "converts Celsius to Fahrenheit",
    "sums the digits of an integer", "finds the most common word in a text", "rotates a list by k positions",
    "checks whether two strings are anagrams", "computes the greatest common divisor of two numbers",
    "returns the indices of two numbers that add up to a target", "validates an email address",
    "counts the lines of a file", "groups a list of words by their first letter", "transposes a matrix",
    "computes the running average of a list", "parses a date string into a datetime",
]
LANGUAGES = ["Python", "Python", "Python", "JavaScript", "C", "Rust"]
MATH = [
    "A shop sells pencils at {a} cents each. How much do {b} pencils cost in dollars?",
    "Solve for x: {a}x + {b} = {c}.",
    "What is {a}% of {c}?",
    "A train travels {c} km in {a} hours. What is its average speed?",
    "Find the area of a rectangle with sides {a} cm and {b} cm.",
    "If a recipe needs {a} eggs for {b} people, how many eggs are needed for {c} people?",
    "What is the sum of the integers from 1 to {c}?",
    "Simplify the fraction {b}/{c}.",
    "A car costs ${c}00 and loses {a}% of its value each year. What is it worth after two years?",
    "Compute {a} * {b} - {c}.",
]


def requests_stream(n: int, seed: int = 0) -> list[str]:
    """Code and math requests, half each, in a shuffled order."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            out.append(f"Write a {rng.choice(LANGUAGES)} function that {rng.choice(CODE_TASKS)}."
                       + rng.choice(["", " Explain it briefly.", " Add a short example.", " Keep it short."]))
        else:
            a, b, c = rng.randint(2, 19), rng.randint(2, 40), rng.randint(41, 400)
            out.append(rng.choice(MATH).format(a=a, b=b, c=c))
    rng.shuffle(out)
    return out


def serve_traffic(target: str, requests: list[str], log_file: Path, max_tokens: int, log=print) -> None:
    """vLLM serves the target alone on the requests (greedy, 16 at a time); its request log is the traffic."""
    from ..serving import VLLMServer

    with VLLMServer(target, max_model_len=1024, dtype="float32", log=log, log_requests=True) as server:
        def ask(text: str) -> None:
            body = {"model": target, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                    "temperature": 0}
            req = urllib.request.Request(server.base_url + "/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=900) as response:
                response.read()

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(ask, requests))
        shutil.copyfile(server.log_path, log_file)
    log(f"[bench] {len(requests)} requests served; the request log: {log_file}")


def report(events: list[dict], machine: str, command: str) -> str:
    lines = [f"Adaptation of the default draft ({machine}); `{command}`", "",
             "| round | decision | set | before | after | ratio | ours (before -> after) | outputs equal greedy |",
             "|---|---|---|---|---|---|---|---|"]
    for r, event in enumerate(events, 1):
        cur, cand = event["numbers"]["current"], event["numbers"]["candidate"]
        decision = f"{event['event']} {event.get('version', '')} (from {event['parent']})".replace("  ", " ")
        for s in ("traffic", "regression"):
            ours = f"{cur['ours'][s]:.3f} -> {cand['ours'][s]:.3f}" if "ours" in cur else ""
            equal = f"{cur.get('outputs_equal_greedy', '')}, {cand.get('outputs_equal_greedy', '')}"
            lines.append(f"| {r} | {decision} | {s} | {cur[s]:.3f} | {cand[s]:.3f} | {cand[s] / cur[s]:.3f}x | "
                         f"{ours} | {equal} |")
    lines += [""] + [f"Round {r}: {e['train_conversations']} conversations trained on, {e['heldout_conversations']} "
                     f"held-out requests judged; {e['why']}." for r, e in enumerate(events, 1)]
    return "\n".join(lines)


def traffic_log(folder: Path, r: int) -> Path:
    return folder / ("vllm_requests.log" if r == 1 else f"vllm_requests_{r}.log")


def main(argv=None) -> None:
    from ..adapt import Home, init, watch
    from ..device import describe_cpu

    p = argparse.ArgumentParser(prog="python -m specforge_lite.bench adapt", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, default=None, help="a finished run of the embedded default")
    p.add_argument("--requests", type=int, default=320, help="requests in each round's stream")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens served per request")
    p.add_argument("--steps", type=int, default=200, help="each candidate's optimizer steps")
    p.add_argument("--rounds", type=int, default=1, help="adaptations, each on a new log")
    p.add_argument("--judge", default="vllm", choices=["vllm", "ours"])
    p.add_argument("--out", type=Path, default=Path("runs/bench/adapt"))
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    base = a.base or a.out / "base"
    if not (base / "final" / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "train.py"), f"output_dir={base}", "tracker=none",
                        "eval.enabled=false"], cwd=ROOT, check=True)
    home, folder = Home(a.out / "drafts"), a.out / "traffic"
    folder.mkdir(exist_ok=True)
    if not home.events():
        init(home, base, [], {"judge": a.judge, "steps": a.steps})
    home.repair()
    for r in range(1, a.rounds + 1):
        log_file = traffic_log(folder, r)
        if not log_file.is_file():
            from omegaconf import OmegaConf

            from ..compose import to_config
            from ..targets.acquire import resolve_model_dir

            target = resolve_model_dir(to_config(OmegaConf.load(base / "config.yaml")).model)
            serve_traffic(target, requests_stream(a.requests, seed=r - 1), log_file, a.max_tokens)
        if str(log_file.resolve()) not in home.consumed():
            watch(home, folder, settle=0, once=True)
    events = [e for e in home.events() if e["event"] in ("promote", "reject", "fail")]
    failed = [e for e in events if e["event"] == "fail"]
    if failed:
        raise SystemExit(f"error: an adaptation failed: {failed[-1]['error']}")
    machine = describe_cpu()
    command = "python -m specforge_lite.bench adapt " + " ".join(argv if argv is not None else sys.argv[2:])
    text = report(events, machine, command.strip())
    (a.out / "report.md").write_text(text + "\n")
    (a.out / "report.json").write_text(json.dumps({"machine": machine, "events": events}, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
