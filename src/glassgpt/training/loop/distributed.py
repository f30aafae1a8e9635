"""One process, or one rank of a `torchrun` job: which rank this is, and what the ranks share.

`setup_distributed` reads torchrun's RANK, WORLD_SIZE and LOCAL_RANK (the only place that
does) and starts the process group: NCCL on GPUs (rank r on cuda:LOCAL_RANK), gloo on CPUs.
Each step the ranks agree on three numbers with one all-reduce (`Distributed.agree`): the
mean loss for the log, the tokens for the x-axis, and whether any rank was asked to stop,
so that all of them stop and save at the same step. Rank 0 logs and writes; every rank
evaluates and saves in step, so that FSDP's collectives line up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...device import resolve_device


@dataclass
class Distributed:
    device: torch.device
    rank: int = 0
    world: int = 1
    owns_group: bool = False  # setup_distributed started the process group, so `close` ends it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def agree(self, loss: torch.Tensor, n_tokens: int, stop: bool) -> tuple[float, int, bool]:
        """(mean loss over ranks, tokens over ranks, whether any rank was asked to stop)."""
        stats = torch.stack([loss.float(), torch.tensor(float(n_tokens), device=self.device),
                             torch.tensor(float(stop), device=self.device)])
        if self.world > 1:
            dist.all_reduce(stats)
        loss_sum, tokens, stops = stats.tolist()
        return loss_sum / self.world, int(tokens), stops > 0

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any."""
        value = torch.tensor(float(flag), device=self.device)
        if self.world > 1:
            dist.all_reduce(value)
        return value.item() > 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def setup_distributed(device: str | None = None) -> Distributed:
    """This process's place: one process, or rank RANK of WORLD_SIZE under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dev = resolve_device(device)
    if world == 1:
        return Distributed(dev)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # (RANK and WORLD_SIZE: the process group reads them)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Distributed(dev, dist.get_rank(), dist.get_world_size(), owns)
