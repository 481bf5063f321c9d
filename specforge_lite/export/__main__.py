"""python -m specforge_lite.export --run-dir DIR --format vllm|sglang|speculators --out OUT
python -m specforge_lite.export --check OUT     (any EAGLE3 draft folder: what each server would do with it)"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import said_in_one_line
from ..hub import DRAFT_FILES, local_or_hub
from . import FORMATS, export_run


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m specforge_lite.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", type=Path, help="a training run directory")
    p.add_argument("--format", default="vllm", choices=sorted(FORMATS))
    p.add_argument("--out", type=Path)
    p.add_argument("--checkpoint", type=Path, default=None, help="a checkpoint folder (default: the newest)")
    p.add_argument("--dtype", default="auto", help="auto (as trained) | bfloat16 | float16 | float32")
    p.add_argument("--check", metavar="DIR", help="validate an export folder (or a public draft's hub id) and exit "
                                                   "(1 on errors)")
    p.add_argument("--server", choices=sorted(FORMATS), default=None,
                   help="with --check: the format the folder will be served as (default: the one it was exported "
                        "for); aux ids that server would read other than the trained ones are an error")
    a = p.parse_args(argv)
    with said_in_one_line():
        run(p, a)


def run(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.check:
        from .check import check_export

        folder = local_or_hub(a.check, "--check", only=DRAFT_FILES)  # (a public draft's hub id too)
        report = check_export(folder, a.server)
        print(report.text())
        sys.exit(0 if report.ok else 1)
    if a.run_dir is None or a.out is None:
        p.error("--run-dir and --out are required to export (or --check DIR)")
    out = export_run(a.run_dir, a.format, a.out, a.checkpoint, a.dtype)
    print(f"exported {a.format} draft to {out}")
    from .check import check_export

    print(check_export(out).text())


if __name__ == "__main__":
    main()
