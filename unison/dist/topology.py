"""Where this process sits among the run's processes: one ``Topology``, built once at startup and passed explicitly
to the engine, the trainer's step and the optimizer factory (torchtitan's ``ParallelDims`` is the model).

``torchrun --nproc-per-node N -m unison train --dist.tp=T`` starts N processes: N / T data-parallel replicas, each
a tensor-parallel group of T consecutive ranks that hold one model between them, on a (``dp``, ``tp``) DeviceMesh.
Each axis this process takes part in is a ``Ranks`` (its rank along the axis, the axis's size and process group);
an axis of size 1 is None, so "no tensor parallelism" is ``topology.tp is None``, never a default read back from an
attribute. Nothing about parallelism is hung on the model or its modules.

>>> t = Topology.alone("cpu")
>>> t.world, t.dp, t.tp, t.tp_size, t.is_main, t.scaled_out
(1, None, None, 1, True, False)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class Ranks:
    """This process's place along one axis of the topology: ``rank`` of ``world`` processes in ``group``."""
    rank: int
    world: int
    device: torch.device
    group: object

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class Topology:
    device: torch.device
    rank: int = 0
    """In the whole run (names this process's trainer state); rank 0 writes the metrics and the checkpoint."""
    world: int = 1
    dp: Ranks | None = None
    """The data-parallel replicas (each rolls out its own prompts and trains its share); None: one replica."""
    tp: Ranks | None = None
    """This replica's tensor-parallel group (one model sharded between them); None: the model is whole here."""
    mesh: DeviceMesh | None = None
    """The (``dp``, ``tp``) mesh the model is sharded on, with tensor parallelism."""

    @classmethod
    def alone(cls, device: str | torch.device) -> Topology:
        return cls(torch.device(device))

    @property
    def tp_size(self) -> int:
        return self.tp.world if self.tp is not None else 1

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self.mesh["tp"] if self.mesh is not None else None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def scaled_out(self) -> bool:
        """More than one process: the collectives of the data- or tensor-parallel step are in play."""
        return self.world > 1


def init_topology(tp: int, timeout_s: float, device: str | torch.device) -> Topology:
    """The run's topology from torchrun's environment (RANK, WORLD_SIZE, ...): ``Topology.alone(device)`` without
    torchrun; otherwise join its process group (NCCL on GPUs, gloo on the CPU) with every collective timing out
    after ``timeout_s``, and with ``tp`` > 1 lay the processes out on a (``dp``, ``tp``) mesh."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % tp:
        raise ValueError(f"dist.tp={tp} does not divide the {world} processes torchrun started")
    if world == 1:
        return Topology.alone(device)
    device_type = torch.device(device).type
    device = join_torchrun(device_type, timeout_s)
    rank = dist.get_rank()
    if tp == 1:
        return Topology(device, rank, world, dp=Ranks(rank, world, device, dist.group.WORLD))
    mesh = init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    dp = Ranks(dp_mesh.get_local_rank(), world // tp, device, dp_mesh.get_group()) if world > tp else None
    return Topology(device, rank, world, dp=dp, tp=Ranks(tp_mesh.get_local_rank(), tp, device, tp_mesh.get_group()),
                    mesh=mesh)


def join_torchrun(device_type: str, timeout_s: float) -> torch.device:
    """Join the process group torchrun describes (NCCL on GPUs, gloo on the CPU); returns this process's device."""
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s))
    return device
