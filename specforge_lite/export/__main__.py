"""python -m specforge_lite.export --run-dir DIR --format vllm|sglang --out OUT"""

from __future__ import annotations

import argparse
from pathlib import Path

from . import FORMATS, export_run


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m specforge_lite.export", description=__doc__)
    p.add_argument("--run-dir", required=True, type=Path, help="a training run directory")
    p.add_argument("--format", default="vllm", choices=sorted(FORMATS))
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--checkpoint", type=Path, default=None, help="a checkpoint folder (default: the newest)")
    p.add_argument("--dtype", default="auto", help="auto (as trained) | bfloat16 | float16 | float32")
    a = p.parse_args(argv)
    out = export_run(a.run_dir, a.format, a.out, a.checkpoint, a.dtype)
    print(f"exported {a.format} draft to {out}")


if __name__ == "__main__":
    main()
