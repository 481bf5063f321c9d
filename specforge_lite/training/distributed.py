"""Processes, ranks and DeepSpeed: one place that knows about more than one process.

Launch with ``torchrun --nproc_per_node N train.py trainer=zero2 ...`` or ``deepspeed --num_gpus N
train.py trainer=zero2 ...`` (the launchers set RANK/WORLD_SIZE/LOCAL_RANK). A single process needs
no launcher and never initialises a process group. DeepSpeed's JSON config is built here from the
trainer config, so batch sizes, accumulation, clipping and precision are written once, in Hydra.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..config import TrainerConfig
from ..device import native_bf16, resolve_device


@dataclass(frozen=True)
class DistributedContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    # Ulysses sequence parallelism: consecutive groups of sp_size ranks share each row (sp_group: theirs)
    sp_size: int = 1
    sp_group: Any = field(default=None, compare=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_size

    @property
    def data_rank(self) -> int:
        """Which data-parallel replica this rank belongs to (the ranks of one replica read the same rows)."""
        return self.rank // self.sp_size

    @property
    def data_world_size(self) -> int:
        return self.world_size // self.sp_size

    def sequence_shard(self):
        """This rank's share of every row (draft/sequence_parallel.py), or None without sequence parallelism."""
        if self.sp_size == 1:
            return None
        from ..draft.sequence_parallel import SequenceShard

        return SequenceShard(self.sp_group, self.sp_rank, self.sp_size)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (in place; returned). The tensor moves to the backend's device and back."""
        if not self.enabled:
            return t
        work = t.to(self.comm_device)
        torch.distributed.all_reduce(work)
        t.copy_(work.to(t.device))
        return t

    def broadcast_object(self, obj: Any) -> Any:
        if not self.enabled:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    @property
    def comm_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def launcher_env() -> DistributedContext:
    """Ranks as the launcher set them (1 process when no launcher ran)."""
    return DistributedContext(rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)),
                              local_rank=int(os.environ.get("LOCAL_RANK", 0)))


def join_launched_group() -> DistributedContext:
    """The ranks a launcher started, in a plain torch process group (gloo on CPU, nccl on GPU), for work
    that needs only barriers (a store dump split across ranks); one process: no group."""
    ctx = launcher_env()
    if ctx.enabled and not torch.distributed.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(ctx.local_rank)
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return ctx


def init_distributed(cfg: TrainerConfig) -> DistributedContext:
    """Join the process group when launched with several processes (gloo on CPU, nccl on GPU)."""
    ctx = launcher_env()
    if cfg.deepspeed.sequence_parallel != 1 and not cfg.deepspeed.enabled:
        raise ValueError("trainer.deepspeed.sequence_parallel needs DeepSpeed: choose trainer=zero0|zero1|zero2|zero3 "
                         "and launch as many processes as it says (torchrun --nproc_per_node N)")
    if not ctx.enabled and not cfg.deepspeed.enabled:
        return ctx
    if not cfg.deepspeed.enabled:
        raise RuntimeError(f"launched with {ctx.world_size} processes but DeepSpeed is off: data-parallel training "
                           "runs through DeepSpeed, choose trainer=zero0|zero1|zero2|zero3|zero3_offload")
    if "MASTER_ADDR" not in os.environ:  # DeepSpeed in one process without a launcher: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if torch.cuda.is_available():
        torch.cuda.set_device(ctx.local_rank)
    clear_stale_build_locks()
    if not torch.distributed.is_initialized():
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    return with_sequence_parallel(ctx, cfg.deepspeed.sequence_parallel)


_GROUP_OF_ONE = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # what init_distributed may set


@contextmanager
def process_group(join: Callable[[], DistributedContext]) -> Iterator[DistributedContext]:
    """``join()`` (``init_distributed``, ``join_launched_group``) for the length of one job. The group it
    joined is destroyed at the end, on every rank: a group left to the interpreter's exit lets gloo's
    worker threads release their last collective while Python finalizes, and the thread forced out aborts
    the process (``std::terminate``: SIGABRT after the work is done). Gloo groups that DeepSpeed's ZeRO state
    still holds keep their threads until the process ends (torch has no way to stop them), so a collective
    right before the exit can still race it: tests/distributed_worker.py, which gathers last, ends with
    ``os._exit``. The launcher variables set for a group of one are taken back, so a later job in the same process (or a
    process it starts) does not inherit them."""
    before = {k: os.environ.get(k) for k in _GROUP_OF_ONE}
    joined = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    try:
        yield join()
    finally:
        if joined and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# A lock younger than this may belong to a build that is only starting (its compiler not yet running).
_BUILD_LOCK_GRACE_S = 30.0


def extensions_root() -> Path:
    """Where torch builds JIT extensions (DeepSpeed's ops: shm_comm on CPU, cpu_adam, ...)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory("specforge_lite_probe", False)).parent


def _someone_builds_in(folder: Path) -> bool:
    """Whether a live process works inside ``folder`` (ninja and the compilers run with it as their cwd)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if Path(os.readlink(proc / "cwd")).is_relative_to(folder):
                return True
        except OSError:  # gone, or not ours to read
            continue
    return False


def clear_stale_build_locks(log=print) -> list[Path]:
    """Remove the build locks a killed run left behind. torch takes ``<extension>/lock`` on EVERY load of a JIT
    extension, built or not, and waits for it without end: a run killed while building (or loading)
    DeepSpeed's ops made every later DeepSpeed run hang silently. A lock is stale when it is older than a
    starting build and no live process works in its folder. Returns the locks removed (each one logged)."""
    if not Path("/proc/self/cwd").exists():  # no /proc to tell a live build from a dead one: leave them
        return []
    removed = []
    for lock in sorted(extensions_root().glob("*/lock")):
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            continue
        if age > _BUILD_LOCK_GRACE_S and not _someone_builds_in(lock.parent.resolve()):
            lock.unlink(missing_ok=True)
            removed.append(lock)
            log(f"[deepspeed] removed a stale build lock left by a killed run: {lock} (no process builds there; "
                "torch would have waited on it forever)")
    return removed


def with_sequence_parallel(ctx: DistributedContext, size: int) -> DistributedContext:
    """The context with DeepSpeed's sequence-parallel groups (consecutive ranks) built, when asked for."""
    if size == 1:
        return ctx
    if size < 1 or ctx.world_size % size:
        raise ValueError(f"trainer.deepspeed.sequence_parallel={size} must divide the {ctx.world_size} launched ranks "
                         f"(launch a multiple of {size} processes, or lower it)")
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.utils import groups

    parallel_state_sp.initialize_sequence_parallel(size)
    # DeepSpeed's all-to-all reads this rank's place in the group from its registered mpu when the heads do
    # not split evenly (SmolLM2: 3 KV heads over 2 ranks); deepspeed.initialize registers the same one later.
    groups.mpu = parallel_state_sp
    return replace(ctx, sp_size=size, sp_group=parallel_state_sp.get_sequence_parallel_group())


def sequence_parallel_mpu(ctx: DistributedContext):
    """What ``deepspeed.initialize(mpu=...)`` takes so that ZeRO sums gradients within a sequence-parallel
    group and averages them across replicas (None without sequence parallelism)."""
    if ctx.sp_size == 1:
        return None
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    return parallel_state_sp


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def strip_launcher_args(argv: list[str]) -> list[str]:
    """The ``deepspeed`` launcher appends ``--local_rank=N``; Hydra would read it as an override."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg.startswith("--local_rank=") or arg.startswith("--local-rank="):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
        elif arg in ("--local_rank", "--local-rank") and i + 1 < len(argv):
            os.environ.setdefault("LOCAL_RANK", argv[i + 1])
            skip = True
        else:
            out.append(arg)
    return out


def use_bf16(precision: str, device: torch.device | None = None) -> bool:
    """trainer.precision: bf16 or fp32 as set; auto is bf16 where ``device`` (default: the run's device) runs
    it natively (device.native_bf16: CUDA with bf16, CPUs whose bf16 matmul beats fp32), else fp32."""
    if precision != "auto":
        return precision == "bf16"
    return native_bf16(device if device is not None else resolve_device("auto")).native


def deepspeed_config(cfg: TrainerConfig, world_size: int) -> dict:
    """DeepSpeed's JSON config, every value taken from the trainer config.

    The optimizer and schedule are ours (AdamW, warmup + decay: training/optim.py) and handed to
    ``deepspeed.initialize`` as objects, so they are the same with and without DeepSpeed. Under bf16 the
    draft's weights are bf16 in the forward and DeepSpeed keeps the fp32 master copy in the optimizer
    (without DeepSpeed, bf16 is autocast over fp32 weights)."""
    ds = cfg.deepspeed
    if ds.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"trainer.deepspeed.zero_stage={ds.zero_stage}: use 0, 1, 2 or 3")
    for name, value in (("offload_optimizer", ds.offload_optimizer), ("offload_param", ds.offload_param)):
        if value not in ("none", "cpu"):
            raise ValueError(f"trainer.deepspeed.{name}={value!r}: use none or cpu")
    if ds.offload_param != "none" and ds.zero_stage != 3:
        raise ValueError("trainer.deepspeed.offload_param needs zero_stage=3 (only ZeRO-3 partitions parameters)")
    if ds.offload_optimizer != "none" and ds.zero_stage == 0:
        raise ValueError("trainer.deepspeed.offload_optimizer needs zero_stage >= 1")
    zero: dict[str, Any] = {"stage": ds.zero_stage, "reduce_bucket_size": ds.reduce_bucket_size,
                            "overlap_comm": ds.overlap_comm, "contiguous_gradients": True}
    if ds.zero_stage in (1, 2):
        zero["allgather_bucket_size"] = ds.allgather_bucket_size
        # optimizer partitions saved so that a run can resume with another number of ranks
        zero["elastic_checkpoint"] = True
    if ds.zero_stage == 3:
        zero["stage3_prefetch_bucket_size"] = ds.allgather_bucket_size
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    if ds.offload_optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if ds.offload_param == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum_steps,
        "train_batch_size": cfg.micro_batch_size * cfg.grad_accum_steps * world_size,
        "gradient_clipping": cfg.grad_clip if cfg.grad_clip > 0 else 0.0,
        "bf16": {"enabled": use_bf16(cfg.precision)},
        "zero_optimization": zero,
        # our AdamW (a torch optimizer) under ZeRO and under CPU offload
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # our loop logs
        "wall_clock_breakdown": False,
    }
