"""The trainer's processes: the device, the process group torchrun sets up, DDP and FSDP2.

Without --parallel a run is rank 0 of 1 and nothing here talks to other processes. Under
torchrun (docs/DISTRIBUTED.md) every rank joins the group, wraps the model, and agrees with
the others on when to stop.
"""
from __future__ import annotations

import dataclasses
import os

import torch


def distributed_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def launched_world_size() -> int:
    """The number of processes of this run: a process group's, torchrun's WORLD_SIZE, or 1."""
    if distributed_ready():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    """This process's rank: the process group's, torchrun's RANK, or 0."""
    if distributed_ready():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def resolve_device(name: str, deterministic: bool, parallel: str = "none") -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if parallel != "none" and name == "cuda":  # one GPU per rank
        name = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(name)
    if name.startswith("cuda") and deterministic:
        # Atomics (embedding backward) and cuBLAS's split reductions otherwise vary run to run.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    return torch.device(name)


@dataclasses.dataclass
class Ranks:
    """This process's place in the run; rank 0 of 1 without --parallel."""

    parallel: str = "none"
    rank: int = 0
    world_size: int = 1
    owns_group: bool = False  # the trainer created the process group (and destroys it at the end)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.parallel != "none"

    def barrier(self) -> None:
        if self.distributed:
            torch.distributed.barrier()

    def agree(self, value: int, device: torch.device) -> int:
        """The largest of every rank's `value` (a signal seen by one rank stops them all)."""
        if not self.distributed:
            return value
        t = torch.tensor([value], device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())

    def close(self) -> None:
        if self.owns_group and distributed_ready():
            torch.distributed.destroy_process_group()


def start_ranks(parallel: str, device: torch.device) -> Ranks:
    """Join the process group torchrun set up (NCCL on CUDA, gloo on CPU), or use one that exists."""
    if parallel == "none":
        return Ranks()
    owns = not distributed_ready()
    if owns:
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    return Ranks(parallel, torch.distributed.get_rank(), torch.distributed.get_world_size(), owns)


def wrap_model(model: torch.nn.Module, ranks: Ranks, device: torch.device) -> torch.nn.Module:
    """DDP around the model, or FSDP2: each block, then the root (embeddings, tied head, final LayerNorm)."""
    if ranks.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if ranks.parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(device.type, (ranks.world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor: a DTensor gathered (collective), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def ddp_rebuild_buckets(model, batch_size: int, context: int, device: torch.device) -> None:
    """One forward and backward whose gradients are dropped, before the session's first step.

    DDP all-reduces its first backward in buckets laid out by parameter order and then
    rebuilds them in the order the gradients became ready. A resumed session's first step
    would otherwise be reduced in other buckets than the same step of the uninterrupted
    run; with more than two ranks the order of the sums (and on NCCL the algorithm, chosen
    by message size) can then differ, and so could the bits. After this call every step of
    every session uses the rebuilt buckets. Parameters, optimizer state, tape cursor and
    RNG are untouched (the model has no dropout).
    """
    tokens = torch.zeros((batch_size, context), dtype=torch.long, device=device)
    model(tokens, tokens)[1].backward()
    model.zero_grad(set_to_none=True)
