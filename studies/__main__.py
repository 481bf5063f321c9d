"""python -m studies <study> [options]   (from a checkout's root; --help on each)

Studies: levers (what raises served acceptance per unit of compute, each lever against the embedded default),
recipe_parity (our recipe against SpecForge's and speculators' own on identical inputs), recipe_card (every
draft method on small real targets at k = 1, 3 and 5). Each writes its report and names the command that
regenerates it."""

from __future__ import annotations

import importlib
import sys

STUDIES = ("levers", "recipe_parity", "recipe_card")


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    usage = f"usage: python -m studies {{{','.join(STUDIES)}}} [options]  (--help on each)"
    if args and args[0] in ("-h", "--help"):
        print(f"{usage}\n\n{__doc__}")
        return
    if not args or args[0] not in STUDIES:
        sys.exit(usage)
    from specforge_lite.bench import say_machine

    say_machine()
    importlib.import_module(f"studies.{args[0]}").main(args[1:])


if __name__ == "__main__":
    main()
