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

from specforge_lite.config import Config, available_presets, check_settings, register_configs, to_config
from specforge_lite.errors import said_in_one_line
from specforge_lite.training.output_dir import OutputDirError, check_output_dir

register_configs()

def run(config: Config, run_dir: Path, log=print) -> dict:
    import torch

    from specforge_lite.data.prepare import check_data_sources
    from specforge_lite.evaluate.finish import check_served_setting, finish
    from specforge_lite.offline import store_run
    from specforge_lite.run import Run
    from specforge_lite.training.distributed import init_distributed
    from specforge_lite.training.loop import train
    from specforge_lite.training.output_dir import hold_output_dir

    check_settings(config)
    check_served_setting(config)
    if config.data.source != "offline":
        check_data_sources(config.data)
    ctx = init_distributed(config.trainer)
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


def _check_arguments(argv: list[str]) -> None:
    """Hydra's own messages for a mistyped group or key do not list what exists, and for an unknown model
    preset do not say how to use a local model."""
    import dataclasses

    groups = sorted(p.name for p in (Path(__file__).parent / "conf").iterdir() if p.is_dir())
    keys = [f.name for f in dataclasses.fields(Config)]
    for arg in argv:
        name = arg.split("=", 1)[0].split(".", 1)[0].split("/", 1)[0]
        if "=" in arg and not arg.startswith(("+", "~", "-")) and name not in {*groups, *keys, "hydra"}:
            sys.exit(f"error: {arg!r}: no config group or key {name!r}. Groups: {', '.join(groups)}; top-level keys: "
                     f"{', '.join(keys)} (python train.py --help lists every key)")
        if arg.startswith("output_dir="):  # (Hydra creates the folder before run() could say what is wrong)
            try:
                check_output_dir(Path(arg.split("=", 1)[1]))
            except OutputDirError as e:
                sys.exit(f"error: {e}")
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
    with said_in_one_line():  # what went wrong and the fix, as one message; a traceback only when asked for
        run(config, Path(hc.runtime.output_dir))


if __name__ == "__main__":
    from specforge_lite.training.distributed import strip_launcher_args

    sys.argv = [sys.argv[0], *strip_launcher_args(sys.argv[1:])]
    _check_arguments(sys.argv[1:])
    main()
