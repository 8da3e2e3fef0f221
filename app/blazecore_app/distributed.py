"""Data + expert parallelism for ``train`` under torchrun (``--ep N``).

``torchrun --nproc_per_node P -m blazecore train --ep N`` starts P ranks on a (P / N) x N mesh (dp x ep): every
MoE layer keeps E / N experts per rank (``blazecore_torch.parallel.ExpertParallelMoELayer``, the tokens exchanged
by all-to-all inside each ep group), every rank trains on its own batches, the gradients are averaged as DDP would
(``all_reduce_gradients``) and clipped by their global norm. Rank 0 prints; its progress bar shows the tokens/s of
all ranks together. Without torchrun (no WORLD_SIZE) and with ``--ep 1`` nothing here runs.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from blazecore_torch import parallel

__all__ = ["Distributed", "setup"]


class Distributed:
    """The run's ranks: ``rank``, ``world``, ``ep``, the (dp, ep) ``mesh``."""

    def __init__(self, ep: int, device_type: str):
        self.rank, self.world, self.ep = dist.get_rank(), dist.get_world_size(), ep
        self.mesh = parallel.expert_parallel_mesh(ep, device_type)

    @property
    def describe(self) -> str:
        return f"{self.world} ranks: {self.world // self.ep} data-parallel x {self.ep} expert-parallel"

    def convert(self, model: torch.nn.Module) -> torch.nn.Module:
        """Every MoELayer of ``model`` (the same weights on every rank) split over the ep group."""
        return parallel.to_expert_parallel(model, self.mesh)

    def batch_step(self, step: int) -> int:
        """The index of this rank's batch at ``step``: every rank its own, a function of (seed, step, rank)."""
        return (step - 1) * self.world + self.rank + 1

    def reduce_and_clip(self, model: torch.nn.Module, clip: float) -> None:
        parallel.all_reduce_gradients(model, self.mesh)
        if clip > 0:
            parallel.clip_grad_norm_(model, clip, self.mesh)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def setup(ep: int, device: str, error) -> Distributed | None:
    """Start torch.distributed when launched by torchrun (WORLD_SIZE set) or asked for ``ep`` > 1; None otherwise.
    NCCL on this rank's GPU (LOCAL_RANK) unless ``device`` is "cpu" or there is no GPU (then gloo).
    ``error(message)`` is raised for a bad combination before anything starts."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise error(f"--ep {ep!r} must be an int >= 1")
    if world == 1 and ep == 1:
        return None
    if "LOCAL_RANK" not in os.environ:
        raise error(f"--ep {ep} needs torchrun: torchrun --nproc_per_node N -m blazecore train --ep {ep} "
                    "(N a multiple of the ep size)")
    if world % ep:
        raise error(f"--ep {ep} does not divide the {world} ranks torchrun started")
    local = int(os.environ["LOCAL_RANK"])
    if device != "cpu" and torch.cuda.is_available():
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        return Distributed(ep, "cuda")
    dist.init_process_group("gloo")
    return Distributed(ep, "cpu")
