"""One training job from a composed configuration: what ``python train.py`` runs after Hydra, and what
``python -m specforge_lite.adapt`` runs for each candidate draft (from a configuration file).

config -> data -> target (capture) -> draft -> training -> export / eval, each stage from its subpackage.
"""

from __future__ import annotations

from pathlib import Path

from .config import Config


def run(config: Config, run_dir: Path, log=print) -> dict:
    """Train, export and evaluate one draft into ``run_dir``; the summary of what was written."""
    import torch
    from omegaconf import OmegaConf

    from .data.prepare import check_data_sources
    from .evaluate.finish import finish
    from .offline import store_run
    from .run import Run
    from .settings import check_settings
    from .training.distributed import init_distributed, process_group
    from .training.loop import train
    from .training.output_dir import hold_output_dir

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


def main(argv=None) -> None:
    """``python -m specforge_lite.job CONFIG.yaml RUN_DIR``: the job of a saved configuration (a run's
    config.yaml, or one that adapt wrote), in its own process."""
    import argparse

    from omegaconf import OmegaConf

    from .config import to_config
    from .errors import said_in_one_line

    p = argparse.ArgumentParser(prog="python -m specforge_lite.job", description=main.__doc__)
    p.add_argument("config", type=Path, help="a configuration file in the layout of a run's config.yaml")
    p.add_argument("run_dir", type=Path)
    a = p.parse_args(argv)
    with said_in_one_line():
        config = to_config(OmegaConf.load(a.config))
        config.output_dir = str(a.run_dir)
        a.run_dir.mkdir(parents=True, exist_ok=True)
        run(config, a.run_dir)


if __name__ == "__main__":
    main()
