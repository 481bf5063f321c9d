"""Train an EAGLE3 draft: specforge-lite train (or python train.py in a checkout) [model=...] [draft.use_aux_norm=true]
[trainer.max_steps=...].

config -> data -> target (capture) -> draft -> training -> export / eval. Each stage lives in its subpackage;
this module only wires them, with the Hydra groups of the package's conf/ (so an installed wheel trains as a
checkout does). ``--help`` lists the groups, ``--cfg job`` prints the composed configuration.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from .arguments import check_arguments
from .compose import as_given, hydra_overrides, register_configs, to_config
from .config import CONF_DIR, with_recipe
from .errors import said_in_one_line
from .job import run

register_configs()


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    with said_in_one_line():  # what went wrong and the fix, as one message; a traceback only when asked for
        # (refused here: a preset's model.family that names no family, a setting given where the run would not read it)
        config = as_given(to_config(cfg), list(hc.overrides.task))
        if hc.mode == RunMode.MULTIRUN:  # one wandb group per sweep, each run named by its overrides
            config.tracker.group = config.tracker.group or Path(hc.sweep.dir).name
            config.tracker.name = config.tracker.name or (hc.job.override_dirname or f"job{hc.job.num}")
        run(config, Path(hc.runtime.output_dir))


def cli() -> None:
    """The command line (sys.argv) checked and completed, then Hydra's: what train.py and specforge-lite train run."""
    from .training.distributed import strip_launcher_args

    args = strip_launcher_args(sys.argv[1:])
    check_arguments(args, CONF_DIR)
    try:
        args = with_recipe(args)  # (a real target: recipe=scale, unless one is named)
    except ValueError as e:
        sys.exit(f"error: {e}")
    sys.argv = [sys.argv[0], *hydra_overrides(args)]  # (draft.method=<name> is draft=<name>, ...)
    main()


if __name__ == "__main__":
    cli()
