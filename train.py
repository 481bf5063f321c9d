"""Train an EAGLE3 draft from a checkout: python train.py [model=...] [draft.use_aux_norm=true] [trainer.max_steps=...]

The same command as ``specforge-lite train`` (specforge_lite/train.py wires the stages; the Hydra groups are in
specforge_lite/conf/). ``python train.py --help`` lists the groups, ``--cfg job`` prints the composed configuration.
Launchers (torchrun, deepspeed) take this file as their script.
"""

from specforge_lite.train import cli

if __name__ == "__main__":
    cli()
