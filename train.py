"""Train an EAGLE3 draft: python train.py [model=...] [draft.use_aux_norm=true] [trainer.max_steps=...]

config -> data -> target (capture) -> draft -> training -> export / eval. Each stage lives in its
subpackage of specforge_lite; this file only wires them. `python train.py --help` lists the groups,
`python train.py --cfg job` prints the composed configuration.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from specforge_lite.arguments import check_arguments
from specforge_lite.config import Config, register_configs, to_config
from specforge_lite.errors import said_in_one_line

register_configs()


def run(config: Config, run_dir: Path, log=print) -> dict:
    import torch

    from specforge_lite.data.prepare import check_data_sources
    from specforge_lite.evaluate.finish import finish
    from specforge_lite.offline import store_run
    from specforge_lite.run import Run
    from specforge_lite.settings import check_settings
    from specforge_lite.training.distributed import init_distributed, process_group
    from specforge_lite.training.loop import train
    from specforge_lite.training.output_dir import hold_output_dir

    check_settings(config)  # (every setting, once, before anything is built)
    if config.data.source != "offline":
        check_data_sources(config.data)
    with process_group(lambda: init_distributed(config.trainer)) as ctx:  # (destroyed when the run ends)
        if not ctx.is_main:
            log = lambda message: None  # noqa: E731  (rank 0 speaks for the run)
        if config.trainer.num_threads:
            torch.set_num_threads(config.trainer.num_threads)
        with hold_output_dir(run_dir, holder=ctx.is_main):  # (one run writes a folder at a time)
            if ctx.is_main:
                OmegaConf.save(OmegaConf.structured(config), run_dir / "config.yaml")
            # the target (live, or read back from a store), data, draft vocabulary, teacher and objective
            job = store_run(config, ctx, log) if config.data.source == "offline" else Run.online(config, ctx, log)
            draft = job.build_draft()
            job.write_stats(run_dir)
            result = train(config.trainer, job.objective, job.teacher, draft, job.batches(), run_dir,
                           lambda step: job.tracker(run_dir, step), draft.spec.to_dict(), log=log, ctx=ctx)
            return finish(job, result, draft, run_dir, log)  # export, evaluation, served check


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
    main()
