"""python -m specforge_lite.offline dump [hydra overrides] store=DIR
torchrun --nproc_per_node N -m specforge_lite.offline dump [hydra overrides] store=DIR   (each rank 1/N, merged)
python -m specforge_lite.offline ingest --from vllm|speculators SRC [--layer-ids 2,14,27,30] [hydra overrides] store=DIR

``store=DIR`` is short for ``store.path=DIR``; the other overrides are the ones train.py takes (model,
data, draft.aux_layer_ids, draft.draft_vocab_size), so the store fits ``train.py <same overrides>
data.source=offline data.store=DIR``."""

from __future__ import annotations

import argparse
import sys

from ..errors import said_in_one_line


def _overrides(items: list[str]) -> list[str]:
    return [f"store.path={x.split('=', 1)[1]}" if x.startswith("store=") else x for x in items]


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m specforge_lite.offline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump", help="run the target over the prepared data and write a store")
    d.add_argument("overrides", nargs="*")
    i = sub.add_parser("ingest", help="convert a vLLM or speculators hidden-state extraction into a store")
    i.add_argument("--from", dest="kind", required=True, choices=["vllm", "speculators"])
    i.add_argument("--layer-ids", default=None, help="the layer ids the extraction was made with, comma-separated "
                                                     "(default: speculators' [2, L//2, L-3, L])")
    i.add_argument("src")
    i.add_argument("overrides", nargs="*")
    # (the overrides may follow --layer-ids, as the docs write them: argparse leaves those to the extras, and
    # parse_intermixed_args takes no subcommands)
    a, extra = p.parse_known_args(argv)
    unknown = [x for x in extra if "=" not in x or x.startswith("-")]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    a.overrides += extra
    with said_in_one_line():
        run(a)


def run(a: argparse.Namespace) -> None:
    from ..compose import load_config
    from ..run import Run
    from .dump import store_folder

    config = load_config(["tracker=none", *_overrides(a.overrides)])
    store_folder(config, a.command)  # the store settings are checked before the target loads
    if a.command == "dump":
        from .dump import dump

        from ..training.distributed import join_launched_group, process_group

        with process_group(join_launched_group) as ctx:
            dump(Run.online(config, ctx))
    else:
        from pathlib import Path

        from .ingest import extraction_files, ingest

        extraction_files(a.kind, Path(a.src))  # a missing or empty folder is said before the target loads
        ids = [int(x) for x in a.layer_ids.split(",")] if a.layer_ids else None
        ingest(Run.online(config, parts_only=True), a.kind, a.src, ids)  # (the target's weights it needs, no more)


if __name__ == "__main__":
    main()
