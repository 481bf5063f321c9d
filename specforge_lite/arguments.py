"""train.py's command line, checked before Hydra composes it: Hydra's own messages for a mistyped group or key
do not list what exists, for a value a closed choice does not have span lines, for an unknown model preset do not
say how to use a local model, and it creates the output folder before a run could say that folder cannot be
used."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from .compose import override_problems, hydra_overrides
from .config import Config, available_presets
from .training.output_dir import OutputDirError, check_output_dir


def check_arguments(argv: list[str], conf_dir: Path) -> None:
    """Exit with one ``error:`` line for an argument Hydra would refuse unhelpfully (``conf_dir``: its groups)."""
    groups = sorted({p.name for p in conf_dir.iterdir() if p.is_dir()} | {"draft"})  # (draft: compose.py)
    keys = [f.name for f in dataclasses.fields(Config)]
    try:
        problems = override_problems(hydra_overrides(argv))
    except ValueError as e:
        problems = [str(e)]
    if problems:
        sys.exit(f"error: {'; '.join(problems)}")
    for arg in argv:
        name = arg.split("=", 1)[0].split(".", 1)[0].split("/", 1)[0]
        if "=" in arg and not arg.startswith(("+", "~", "-")) and name not in {*groups, *keys, "hydra"}:
            sys.exit(f"error: {arg!r}: no config group or key {name!r}. Groups: {', '.join(groups)}; top-level keys: "
                     f"{', '.join(keys)} (python train.py --help lists every key)")
        if arg.startswith("output_dir="):  # (Hydra creates the folder before run() could say what is wrong)
            try:
                check_output_dir(Path(arg.split("=", 1)[1]))
            except OutputDirError as e:
                sys.exit(f"error: {e}")
        if arg.startswith("model=") and "," not in arg:
            name = arg.split("=", 1)[1]
            if name not in available_presets("model"):
                sys.exit(f"error: unknown model preset {name!r}. Presets: {', '.join(available_presets('model'))}.\n"
                         f"For any other model, point at a local folder: model.path=/path/to/model (config.json + "
                         f"weights).")
