"""The documentation: the README a newcomer reads, the site that mkdocs builds in strict mode, the configuration
reference that cannot drift from the dataclasses, the shell examples that run, and the console entry point."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specforge_lite import config_reference

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BIN = Path(sys.executable).parent
# the page a study writes (its commands are the study's own, named in the page)
WRITTEN_BY_BENCHMARKS = {"recipe_card.md"}
MARKERS = ("cpu", "gpu", "hub", "long")
SHELL = re.compile(r"^```(bash|sh|shell|console)\s*$")


def shell_examples() -> list[tuple[Path, int, str, str]]:
    """(page, line, marker, the block's text) of every shell block in the docs; marker '' when it has none."""
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        if page.name in WRITTEN_BY_BENCHMARKS:
            continue
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if not SHELL.match(line):
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            marker = re.fullmatch(r"<!-- example: (\w+) -->", lines[i - 1].strip()) if i else None
            found.append((page, i + 1, marker.group(1) if marker else "", "\n".join(lines[i + 1:end])))
    return found


def test_the_readme_is_short_and_its_links_lead_somewhere():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert "bash scripts/setup.sh && .venv/bin/python train.py" in text and "bash scripts/test.sh" in text
    for target in re.findall(r"\]\(([^)#\s]+)", text):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_the_site_builds_in_strict_mode(tmp_path):
    """The documented command exactly: a broken link or #anchor, or a page missing from the nav, fails the build
    (no -q: a quiet build drops the warnings that strict mode counts)."""
    proc = subprocess.run([str(BIN / "mkdocs"), "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()


def docs_figures():
    spec = importlib.util.spec_from_file_location("docs_figures", ROOT / "scripts" / "docs_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_figure_is_written_from_its_result_file():
    """Each figure between <!-- figure:NAME --> markers is what scripts/docs_figures.py writes from
    docs/results/: a figure edited by hand, or a result file changed without regenerating, fails here."""
    figures = docs_figures()
    stale = [str(p.relative_to(ROOT)) for p in figures.PAGES if figures.rewrite(p.read_text()) != p.read_text()]
    assert not stale, f"figures differ from docs/results in {stale}: run python scripts/docs_figures.py"
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- figure:default_run/readme -->\n(.*?)<!-- /figure -->", readme, re.S).group(1)
    chat = str(json.loads((ROOT / "docs" / "results" / "default_run.json").read_text())["runs"][0]["chat"])
    assert chat in block
    edited = readme.replace(block, block.replace(chat, chat + "9"))
    assert figures.rewrite(edited) == readme  # a hand edit is what the check sees, and what a rewrite undoes


def test_every_result_file_names_its_machine_and_date_and_is_shown():
    figures = docs_figures()
    shown = {name.split("/")[0] for page in figures.PAGES
             for name in re.findall(r"<!-- figure:([\w./-]+) -->", page.read_text())}
    for path in sorted(figures.RESULTS.glob("*.json")):
        text = path.read_text()
        json.loads(text)
        assert path.stem in shown, f"{path.name} is in no page"
        assert '"date"' in text and ('"machine"' in text or '"device"' in text), f"{path.name}: machine or date"


def test_the_configuration_reference_is_the_dataclasses_own():
    """Regenerated from config.py and compared: a key added, removed, re-defaulted or re-documented without
    regenerating the page fails here. Every key says what it does."""
    assert config_reference.undocumented() == []
    page = config_reference.PAGE.read_text()
    assert page == config_reference.render(), "run: python -m specforge_lite.config_reference"
    for key in ("draft.ttt_length", "trainer.deepspeed.zero_stage", "data.mix[].weight", "eval.num_draft_tokens"):
        assert f"| `{key}` |" in page


def test_every_shell_example_is_marked():
    """Each is run by test_the_cpu_examples_run, or says what it needs: a GPU, a hub model, or minutes."""
    examples = shell_examples()
    assert examples, "no shell example found in docs/"
    unmarked = [f"{page.relative_to(ROOT)}:{line}" for page, line, marker, _ in examples if marker not in MARKERS]
    assert not unmarked, f"shell examples without <!-- example: {'|'.join(MARKERS)} -->: {unmarked}"


def test_the_cpu_examples_run(tmp_path):
    """Every example marked cpu, as a user would paste it, in a fresh folder with the checkout's train.py."""
    examples = [(page, line, text) for page, line, marker, text in shell_examples() if marker == "cpu"]
    assert examples, "no example is marked cpu"
    for name in ("train.py",):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "WANDB_MODE": "offline",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}  # (one under the suite's two processes)
    for page, line, text in examples:
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", text], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=600)
        where = f"{page.relative_to(ROOT)}:{line}"
        assert proc.returncode == 0, f"{where}:\n{text}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"


def train_commands() -> list[tuple[str, list[str]]]:
    """(where, overrides) of every ``train.py`` command in a shell block of the docs or the README, however it
    is launched (python, torchrun, deepspeed), line continuations joined, comments dropped."""
    import shlex

    blocks = [(f"{page.relative_to(ROOT)}:{line}", text) for page, line, _, text in shell_examples()]
    readme = (ROOT / "README.md").read_text()
    blocks += [("README.md", m) for m in re.findall(r"```bash\n(.*?)```", readme, re.S)]
    found = []
    for where, text in blocks:
        for command in text.replace("\\\n", " ").splitlines():
            words = shlex.split(command, comments=True)
            if "train.py" in words:
                args = words[words.index("train.py") + 1:]
                found.append((where, [a for a in args if not a.startswith("-") and "=" in a]))
    return found


def test_every_train_command_in_the_docs_composes():
    """Every example's overrides, the GPU and hub ones too, compose into a config that passes the settings
    check: a renamed key, group or preset breaks the example that still shows it."""
    from specforge_lite.compose import load_config
    from specforge_lite.settings import setting_problems

    commands = train_commands()
    assert len(commands) >= 20
    for where, overrides in commands:
        sweep = [o for o in overrides if "," in o.split("=", 1)[1] and not o.split("=", 1)[1].startswith("[")]
        for choice in ([o.split(",")[0] for o in sweep] if sweep else [None]):  # (a sweep: its first run)
            chosen = [o for o in overrides if o not in sweep] + ([choice] if choice else [])
            try:
                config = load_config(chosen)
            except Exception as e:  # noqa: BLE001  (Hydra's own refusal is the finding)
                pytest.fail(f"{where}: python train.py {' '.join(overrides)}: {e}")
            assert setting_problems(config) == [], f"{where}: {' '.join(overrides)}"


@pytest.mark.parametrize("args", [["--cfg", "job", "model=llama3_tiny", "draft.ttt_length=5"]])
def test_the_console_entry_point_is_train_py(args):
    """specforge-lite train composes exactly what python train.py composes from the same arguments."""
    direct = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, capture_output=True, text=True)
    entry = subprocess.run([str(BIN / "specforge-lite"), "train", *args], cwd=ROOT, capture_output=True, text=True)
    assert direct.returncode == 0 and entry.returncode == 0, direct.stderr + entry.stderr
    assert "ttt_length: 5" in direct.stdout
    assert entry.stdout == direct.stdout


def test_the_console_entry_point_runs_each_tool_and_names_a_mistyped_one():
    listing = subprocess.run([str(BIN / "specforge-lite"), "--help"], capture_output=True, text=True)
    assert listing.returncode == 0 and "export" in listing.stdout and "bench" in listing.stdout
    export = subprocess.run([str(BIN / "specforge-lite"), "export", "--help"], capture_output=True, text=True)
    direct = subprocess.run([sys.executable, "-m", "specforge_lite.export", "--help"], capture_output=True, text=True)
    assert export.returncode == 0 and export.stdout == direct.stdout
    typo = subprocess.run([str(BIN / "specforge-lite"), "exprot"], capture_output=True, text=True)
    assert typo.returncode == 1 and "no tool 'exprot'" in typo.stderr and "export" in typo.stderr
