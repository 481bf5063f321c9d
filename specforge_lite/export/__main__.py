"""python -m specforge_lite.export --run-dir DIR --format vllm|sglang|speculators --out OUT
python -m specforge_lite.export --check OUT     (any EAGLE3 draft folder: what each server would do with it)
python -m specforge_lite.export --push ORG/NAME --export OUT   (or --run-dir RUN: RUN/final; with --out: export, then
                                                              push OUT) uploads a folder --check passes to the hub"""

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
    p.add_argument("--push", metavar="ORG/NAME", help="upload the export folder (--export DIR, --out after an "
                                                      "export, or the run's final/) to this hub model repository")
    p.add_argument("--export", type=Path, metavar="DIR", help="with --push: the export folder to upload")
    p.add_argument("--private", action="store_true", help="with --push: create the repository private")
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
    if a.push and a.out is None:  # (an export folder already written)
        push(p, a, a.export or (a.run_dir / "final" if a.run_dir is not None else None))
        return
    if a.export is not None or a.private:
        p.error("--export and --private go with --push ORG/NAME")
    if a.run_dir is None or a.out is None:
        p.error("--run-dir and --out are required to export (or --check DIR, or --push ORG/NAME --export DIR)")
    out = export_run(a.run_dir, a.format, a.out, a.checkpoint, a.dtype)
    print(f"exported {a.format} draft to {out}")
    from .check import check_export

    print(check_export(out).text())
    if a.push:
        push(p, a, out)


def push(p: argparse.ArgumentParser, a: argparse.Namespace, folder: Path | None) -> None:
    from .push import push_export

    if folder is None:
        p.error("--push ORG/NAME needs the folder to upload: --export DIR, or --run-dir RUN (its final/)")
    if a.export is None and not folder.is_dir():  # (--run-dir RUN: the export the run wrote at its end)
        raise FileNotFoundError(f"--run-dir {a.run_dir} has no final/ export: export it first (python -m "
                                f"specforge_lite.export --run-dir {a.run_dir} --out DIR --push {a.push}), or give "
                                "--export DIR")
    url = push_export(a.push, folder, a.run_dir, a.private)
    print(f"pushed {folder} to {url}")


if __name__ == "__main__":
    main()
