"""A frozen target partitioned across ranks with DeepSpeed ZeRO-3 (``target.shard=zero3``).

For targets larger than one device: each rank keeps 1/world of every parameter and DeepSpeed's hooks
gather a module's parameters just before it runs and free them after. Weights read outside a forward
(the draft's embedding, the teacher's lm_head rows) go through ``gathered``.
"""

from __future__ import annotations

import torch


def shard_target_zero3(model: torch.nn.Module, world_size: int) -> torch.nn.Module:
    """Partition a frozen target's parameters across ranks with ZeRO-3 (inference engine, no optimizer).

    Each rank keeps 1/world of every parameter; DeepSpeed's hooks gather a module's parameters just
    before it runs and release them after, so capture hooks on the layers see the same tensors as on a
    whole target. Whoever reads a weight outside the forward (the draft's embedding, the teacher's
    lm_head rows) gathers it first: ``gathered(param)``.
    """
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": world_size,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "bf16": {"enabled": next(model.parameters()).dtype == torch.bfloat16}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    return engine.module


def is_partitioned(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id")


def gathered(param: torch.Tensor) -> torch.Tensor:
    """The full value of a (possibly ZeRO-3 partitioned) parameter, identical on every rank; a copy
    when it was partitioned (the partitioned parameter itself is released again)."""
    if not is_partitioned(param):
        return param
    import deepspeed

    with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
        return param.detach().clone()
