"""python -m studies <study> [options]   (from a checkout's root; --help on each)

Studies: levers (what raises served acceptance per unit of compute, each lever against the embedded default),
recipe_parity (our recipe against SpecForge's and speculators' own on identical inputs), recipe_card (every
draft method on small real targets at k = 1, 3 and 5), gpu_scale (online training at a real target's shape on one
GPU: every way of our step checked and timed, against the peers' own steps on the same captured rows), step_speed
(one draft step's tokens/s on CPU, ours and the peers'), step_flops (the work of one draft step, ours and the
peers', at a real target's shape), step_traffic (the memory traffic of our step by kind of op: what compiled
kernels can win on a GPU), step_memory (what our step holds at its peaks, by what made it), scale_run (a finished
run as a result table's row: answers/s of its regeneration, training, loss, evaluation per prompt set). Each
writes its report and names the command that regenerates it."""

from __future__ import annotations

from specforge_lite.bench import run_named

STUDIES = {name: f"studies.{name}" for name in ("levers", "recipe_parity", "recipe_card", "gpu_scale",
                                                      "step_speed", "step_flops", "step_traffic", "step_memory",
                                                      "scale_run")}


def main(argv: list[str] | None = None) -> None:
    run_named("python -m studies", STUDIES, __doc__, argv)


if __name__ == "__main__":
    main()
