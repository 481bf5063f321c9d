"""Train an EAGLE3 draft: python train.py [model=...] [draft.use_aux_norm=true] [trainer.max_steps=...]

config -> data -> target (capture) -> draft -> training -> export / eval. Each stage lives in its
subpackage of specforge_lite; this file only wires them. `python train.py --help` lists the groups,
`python train.py --cfg job` prints the composed configuration.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from specforge_lite.config import Config, available_presets, check_settings, register_configs, to_config

register_configs()

# Errors about the user's input or settings, each raised with the reason and the fix: printed as that
# message alone. Anything else is a defect and keeps its traceback.
TRACEBACK_ENV = "SPECFORGE_LITE_TRACEBACK"
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError)


def _user_errors() -> tuple[type[BaseException], ...]:
    from specforge_lite.data import DataError
    from specforge_lite.offline.store import StoreError
    from specforge_lite.targets.acquire import ModelUnavailableError
    from specforge_lite.training.checkpoint import CheckpointError
    from specforge_lite.training.loop import NothingScored

    return (*USER_ERRORS, DataError, StoreError, ModelUnavailableError, CheckpointError, NothingScored)


def run(config: Config, run_dir: Path, log=print) -> dict:
    import torch

    from specforge_lite.data.prepare import check_data_sources
    from specforge_lite.evaluate.finish import check_served_setting, finish
    from specforge_lite.offline import store_run
    from specforge_lite.run import Run
    from specforge_lite.training.distributed import init_distributed
    from specforge_lite.training.loop import train

    check_settings(config)
    check_served_setting(config)
    if config.data.source != "offline":
        check_data_sources(config.data)
    ctx = init_distributed(config.trainer)
    if not ctx.is_main:
        log = lambda message: None  # noqa: E731  (rank 0 speaks for the run)
    if config.trainer.num_threads:
        torch.set_num_threads(config.trainer.num_threads)
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.structured(config), run_dir / "config.yaml")

    # the target (live, or read back from a store), data, draft vocabulary, teacher and objective
    job = store_run(config, ctx, log) if config.data.source == "offline" else Run.online(config, ctx, log)
    draft = job.build_draft()
    job.write_stats(run_dir)
    result = train(config.trainer, job.objective, job.teacher, draft, job.batches(), run_dir,
                   lambda step: job.tracker(run_dir, step), draft.spec.to_dict(), log=log, ctx=ctx)
    return finish(job, result, draft, run_dir, log)  # export, evaluation, served check


def _check_preset_argument(argv: list[str]) -> None:
    """Hydra's own message for an unknown group option does not say how to use a local model."""
    for arg in argv:
        if arg.startswith("model=") and "," not in arg:
            name = arg.split("=", 1)[1]
            if name not in available_presets("model"):
                sys.exit(f"error: unknown model preset {name!r}. Presets: {', '.join(available_presets('model'))}.\n"
                         f"For any other model, point at a local folder: model.path=/path/to/model (config.json + "
                         f"weights).")


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    config, hc = to_config(cfg), HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:  # one wandb group per sweep, each run named by its overrides
        config.tracker.group = config.tracker.group or Path(hc.sweep.dir).name
        config.tracker.name = config.tracker.name or (hc.job.override_dirname or f"job{hc.job.num}")
    try:
        run(config, Path(hc.runtime.output_dir))
    except _user_errors() as e:
        if os.environ.get(TRACEBACK_ENV) == "1":
            raise
        # what went wrong and the fix, as one message; a traceback only when asked for
        sys.exit(f"error: {e}\n(set {TRACEBACK_ENV}=1 for the traceback)")


if __name__ == "__main__":
    from specforge_lite.training.distributed import strip_launcher_args

    sys.argv = [sys.argv[0], *strip_launcher_args(sys.argv[1:])]
    _check_preset_argument(sys.argv[1:])
    main()
