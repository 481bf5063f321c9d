"""The house's floors. Data flows config -> data / targets -> draft -> training -> export -> evaluate, and what wires
the stages into a run (run.py, offline/, job.py, the entry points) stands above them. Each unit (a subpackage or a
top-level module of specforge_lite) declares what it stands on; it may import those and whatever they stand on, at
import time or inside a function, and nothing else. So evaluate/ never imports run.py (a stage measures an export;
the run that made it is wiring), export/ and evaluate/ never import training/ (they read checkpoints and metrics
from records.py, below the trainer that writes them), data/ and targets/ stand side by side, and nothing of the
package imports the studies beside it. A method owns its export formats: what every format shares (formats/) stands
below the methods, and the entry points that write, read and check a folder (export/) above them. A method's folder is
its own: the stages ask the method through the registry (methods/__init__.py), and only the benchmarks, which time one
method's parts, import a module of it. Read from the code's own imports (ast), as the method-name rule of
tests/test_settings.py reads its text."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

from conftest import ROOT

STANDS_ON = {
    # the ground: one-line messages, files written whole, the serving venv, the settings
    "errors": (), "files": (), "serving": (), "config": ("errors",), "hub": ("errors",),  # (a hub id, fetched)
    "records": ("errors", "files"),  # what a run leaves in its folder (metrics, checkpoints), read back
    "device": ("config",),  # the machine, and the precision auto chooses on it
    "data": ("config", "errors", "files"),  # conversations -> samples
    # the frozen target, its capture and its store; a target served by vLLM (targets/served.py) starts the server
    "targets": ("config", "device", "errors", "files", "hub", "serving"),
    "generation": ("data", "targets", "serving"),  # the target writing answers
    "draft": ("targets",),  # what every draft method shares: the spec, the model base, the objective, drafting
    # what every export format shares, knowing no method: the format interface, what every layout writes alike,
    # the check's report
    "formats": ("draft",),
    "methods": ("draft", "formats"),  # the draft methods, one folder each (export formats included), by name
    "compose": ("methods",),  # a run's settings composed through Hydra, the draft's as its method's class
    "training": ("draft", "data", "records"),
    "export": ("methods", "records"),  # the registered methods' formats, written, read back and checked
    # an export measured on its target (a finished run's settings read back through compose)
    "evaluate": ("export", "generation", "records", "serving", "compose"),
    "run": ("training", "export", "generation"),  # the wiring: one training run assembled from the stages
    # hidden-state stores dumped or ingested through a run, and a run read back from one
    "offline": ("run", "compose"),
    "settings": ("training", "evaluate"),  # every setting checked once, before anything runs
    "arguments": ("training", "compose"),  # train.py's arguments, checked before Hydra
    "config_reference": ("compose",),
    "job": ("offline", "settings", "evaluate"),  # train, export and evaluate one draft
    "adapt": ("evaluate", "training", "serving"),  # a draft adapted to served traffic
    "train": ("job", "arguments"),  # the training command (specforge-lite train; train.py calls it)
    "plan": ("job",),  # a run sized before it runs: its capture and step on fake tensors
    "bench": ("job", "adapt"),  # the benchmarks
    "cli": (),  # the console entry point (it runs each tool's module by name)
}


@functools.cache
def below(unit: str) -> frozenset[str]:
    """Every unit ``unit`` may import: what it stands on, and what those stand on."""
    return frozenset(u for under in STANDS_ON[unit] for u in (under, *below(under)))


def floors() -> list[list[str]]:
    """The drawing: units by floor, each one floor above the highest it stands on."""
    floor = {}
    for unit in sorted(STANDS_ON, key=lambda u: len(below(u))):
        floor[unit] = 1 + max((floor[u] for u in STANDS_ON[unit]), default=-1)
    return [sorted(u for u, f in floor.items() if f == n) for n in range(max(floor.values()) + 1)]


def unit_of(module: str) -> str:
    """specforge_lite.evaluate.finished -> evaluate; specforge_lite.run -> run."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports_of(path: Path, package: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in ``path`` (relative ones resolved), nested ones included."""
    here = list(path.relative_to(package.parent).parts[:-1])  # (the package a relative import starts from)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[: len(here) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            # ``from . import x`` names a module of the package: each name is its own import
            found += [(node.lineno, f"{module}.{a.name}") for a in node.names] if not node.module else \
                [(node.lineno, module)]
    return found


# "studies", "studies/peers", "studies.levers", ".../studies": the folder or module, not the word in a sentence
STUDIES_PATH = re.compile(r"^studies$|\bstudies[/\\.]\w|[/\\]studies\b")


def studies_paths_of(path: Path) -> list[tuple[int, str]]:
    """(line, the words around it) of every string in ``path`` that names the studies as a folder or module (a path
    built from it, a module name handed to importlib); docstrings, which may point a reader there, are not counted."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    strings = [node for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]
    return [(node.lineno, node.value[max(found.start() - 20, 0): found.end() + 20]) for node in strings
            for found in [STUDIES_PATH.search(node.value)] if found]


METHOD_PARTS_READERS = ("methods", "bench")  # (the benchmarks time one method's parts: its attention, its drafting)


def broken_rules(package: Path) -> list[str]:
    """Every import that breaks the floors, as 'file:line: A imports B (floor m above floor n)'; a unit that is on
    no floor, an import of the studies and a path to them are broken rules too."""
    broken = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent)
        unit = unit_of(".".join(rel.with_suffix("").parts))
        if unit in ("", "__init__"):
            continue
        if unit not in STANDS_ON:
            broken.append(f"{rel}: the unit {unit!r} stands on no floor: say what it stands on in STANDS_ON "
                          "(tests/test_layers.py)")
            continue
        for line, text in studies_paths_of(path):
            broken.append(f"{rel}:{line}: names the studies in a path ({text!r}): the package stands without "
                          "the studies beside it")
        for line, module in imports_of(path, package):
            if module.split(".")[0] == "studies":
                broken.append(f"{rel}:{line}: imports {module}: the package stands without the studies beside it")
            if module.split(".")[0] != package.name:
                continue
            other = unit_of(module)
            if other in ("", "__init__", unit) or other not in STANDS_ON:
                continue
            method_folder = module.split(".")[2:3] if other == "methods" and module.count(".") >= 3 else []
            if method_folder and unit not in METHOD_PARTS_READERS:
                broken.append(f"{rel}:{line}: {unit} imports {module}, a module of the {method_folder[0]} method: "
                              "ask the method (methods' registry: draft_method(name))")
            if other not in below(unit):
                broken.append(f"{rel}:{line}: {unit} imports {other} ({module}), which {unit} does not stand on "
                              f"(it stands on {', '.join(sorted(below(unit))) or 'nothing'})")
    return broken


def test_every_import_runs_down_the_floors():
    assert broken_rules(ROOT / "specforge_lite") == []


def test_the_floors_hold_no_circle_and_put_the_stages_in_their_order():
    """What the units stand on is itself a house: no unit stands on itself, and the stages come in the order the
    data flows, the wiring above them."""
    assert all(unit not in below(unit) for unit in STANDS_ON)
    level = {u: n for n, units in enumerate(floors()) for u in units}
    order = ["config", "data", "generation", "training", "run", "offline", "job", "bench"]
    assert [level[u] for u in order] == sorted(level[u] for u in order)
    assert level["targets"] < level["draft"] < level["training"]
    assert level["draft"] < level["methods"] < level["export"] < level["evaluate"]
    assert level["draft"] < level["formats"] < level["methods"] and "methods" not in below("formats")
    assert "training" not in below("export") | below("evaluate") and "run" not in below("evaluate")


def test_an_import_up_a_floor_or_of_the_studies_is_named(tmp_path):
    """The rule fails where it should: evaluate importing run (the wiring), export importing training (reading a
    checkpoint), the formats' core asking the methods' registry, a sibling importing a sibling, an unplaced unit,
    the package importing a study or reaching the studies' folder by path (a docstring may name it), and a stage
reaching into a method's folder instead of asking the method."""
    package = tmp_path / "specforge_lite"
    files = {"evaluate/finished.py": "def f():\n    from ..run import Run\n",
             "export/__init__.py": "from ..training.checkpoint import load_checkpoint\n",
             "data/prepare.py": "from ..targets import build_target\n",
             "records.py": "import json\n", "targets/store.py": "from ..files import fsync\n",
             "evaluate/rank.py": "from ..records import read_metrics\n",
             "newstage/x.py": "from ..config import Config\n", "bench/levers.py": "from studies import levers\n",
             "formats/format.py": "def f():\n    from ..methods import draft_method\n",
             "methods/eagle3/export/vllm.py": "from ....formats import ExportFormat\n",
             "evaluate/tree.py": "from ..methods import draft_method\nfrom ..methods.eagle3.drafting import X\n",
             "bench/draft_cache.py": "def f():\n    from ..methods.eagle3.drafting import DraftContext\n",
             "bench/peers.py": '"""Drivers in studies/peers/ (a docstring may say so)."""\nfrom pathlib import Path\n'
                               'DRIVERS = Path(__file__).parents[2] / "studies" / "peers"\n'
                               'NAME, HELP = "studies.levers", f"run {DRIVERS} (the studies beside the package)"\n'}
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    broken = "\n".join(broken_rules(package))
    assert "evaluate/finished.py:2: evaluate imports run" in broken
    assert "export/__init__.py:1: export imports training" in broken
    assert "data/prepare.py:1: data imports targets" in broken
    assert "'newstage' stands on no floor" in broken
    assert "bench/levers.py:1: imports studies" in broken
    assert "formats/format.py:2: formats imports methods" in broken
    assert "records.py" not in broken and "targets/store.py" not in broken and "rank.py" not in broken
    assert "vllm.py" not in broken and "bench/draft_cache.py" not in broken
    assert "evaluate/tree.py:2: evaluate imports specforge_lite.methods.eagle3.drafting, a module of" in broken
    assert "evaluate/tree.py:1" not in broken
    assert "bench/peers.py:3: names the studies in a path ('studies')" in broken
    assert "bench/peers.py:4: names the studies in a path ('studies.levers')" in broken
    assert "bench/peers.py:1" not in broken and "beside the package" not in broken
    assert len(broken.splitlines()) == 9


PACKAGE_LINES_BUDGET = 24_000  # docs/design.md, "What belongs in the package"


def test_the_package_stays_within_its_size_budget():
    """What grows past the budget moves out (a study to studies/) or is written once below the stages that share it."""
    lines = sum(len(p.read_text().splitlines()) for p in (ROOT / "specforge_lite").rglob("*.py"))
    assert lines <= PACKAGE_LINES_BUDGET, f"specforge_lite/ holds {lines} lines of Python, over {PACKAGE_LINES_BUDGET}"
