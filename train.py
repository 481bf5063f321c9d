"""Train an EAGLE3 draft: python train.py [model=...] [draft.use_aux_norm=true] [trainer.max_steps=...]

config -> data -> target (capture) -> draft -> training -> export / eval. Each stage lives in its
subpackage of specforge_lite; this file only wires them. `python train.py --help` lists the groups,
`python train.py --cfg job` prints the composed configuration.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from specforge_lite.arguments import check_arguments
from specforge_lite.compose import register_configs, to_config, with_draft_group
from specforge_lite.config import with_recipe
from specforge_lite.errors import said_in_one_line
from specforge_lite.job import run  # (the job itself; tests call it as train.run)

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    config, hc = to_config(cfg), HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:  # one wandb group per sweep, each run named by its overrides
        config.tracker.group = config.tracker.group or Path(hc.sweep.dir).name
        config.tracker.name = config.tracker.name or (hc.job.override_dirname or f"job{hc.job.num}")
    with said_in_one_line():  # what went wrong and the fix, as one message; a traceback only when asked for
        run(config, Path(hc.runtime.output_dir))


if __name__ == "__main__":
    from specforge_lite.training.distributed import strip_launcher_args

    sys.argv = [sys.argv[0], *strip_launcher_args(sys.argv[1:])]
    check_arguments(sys.argv[1:], Path(__file__).parent / "conf")
    sys.argv = [sys.argv[0], *with_recipe(sys.argv[1:])]  # (a real target: recipe=scale, unless one is named)
    sys.argv = [sys.argv[0], *with_draft_group(sys.argv[1:])]  # (draft.method=<name> is draft=<name>)
    main()
