"""``specforge-lite``: one command for every tool, installed with the package.

    specforge-lite train [overrides ...]      = python train.py [overrides ...]   (python -m specforge_lite.train)
    specforge-lite plan model=llama3_8b ...   = python -m specforge_lite.plan model=llama3_8b ...
    specforge-lite export --run-dir RUN ...   = python -m specforge_lite.export --run-dir RUN ...
    specforge-lite <tool> --help              each tool's own help

Each tool is the module ``python -m`` runs, given the remaining arguments as they are: nothing is parsed
twice, so the two spellings cannot differ.
"""

from __future__ import annotations

import runpy
import sys

# tool -> (the module python -m runs, what it does)
TOOLS = {
    "train": ("specforge_lite.train", "train a draft (python train.py): target, data, draft, training, export, eval"),
    "plan": ("specforge_lite.plan", "size a run before it runs: memory per GPU, the command that fits, its time"),
    "export": ("specforge_lite.export", "rewrite a run's draft for vLLM, SGLang or speculators; --check an export"),
    "evaluate": ("specforge_lite.evaluate", "speculative decoding of an export on prompt sets"),
    "served": ("specforge_lite.evaluate.served", "vLLM serves an export on the run's prompts"),
    "rank": ("specforge_lite.evaluate.rank", "train several draft methods on one capture and rank them"),
    "sweep": ("specforge_lite.evaluate.sweep", "the table of a --multirun sweep's runs"),
    "offline": ("specforge_lite.offline", "hidden-state stores: dump the target's, or ingest vLLM's or speculators'"),
    "adapt": ("specforge_lite.adapt", "adapt a draft to served traffic: versions, promotion rails, rollback, watch"),
    "bench": ("specforge_lite.bench", "the benchmarks (speed, memory, stores, packing, resumes)"),
    "config-reference": ("specforge_lite.config_reference", "write (or --check) the configuration reference page"),
}


def usage() -> str:
    width = max(map(len, TOOLS))
    return "usage: specforge-lite TOOL [arguments ...]\n\ntools:\n" + "\n".join(
        f"  {name.ljust(width)}  {what}" for name, (_, what) in TOOLS.items()) + "\n\n" + \
        "specforge-lite TOOL --help shows a tool's own arguments."


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return
    tool, rest = args[0], args[1:]
    if tool not in TOOLS:
        sys.exit(f"error: no tool {tool!r}.\n{usage()}")
    module, _ = TOOLS[tool]
    sys.argv = [f"specforge-lite {tool}", *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
