"""Ranks and their roles, from the flags alone, and the job's topology as every rank sees it.

One process per GPU. Roles follow the flags of each node: local ranks 0..D-1 are this node's drafter GPUs,
D..D+T-1 its target GPUs, so the first node's first drafter is global rank 0 (it writes status.json,
metrics and the consolidated checkpoint files). One GPU named in both lists (or a CPU run on one node with one
target worker and one drafter replica) is world size 1: one rank holds both roles and nothing is sent. On several
nodes, where a rank holding both roles is refused, a CPU node's one target worker and one drafter replica are two
ranks.
Pure Python: no torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class LocalRole:
    """What one local rank of this node does, from the flags alone."""
    target: bool
    drafter: bool
    device: str            # "cpu" or "cuda:<index>"


def local_roles(cfg) -> list[LocalRole]:
    """This node's ranks in local-rank order: drafters first, then targets; a shared device is one rank (a CPU run's
    one target worker and one drafter replica: on one node only, world size 1)."""
    if cfg.on_cpu:
        nt, nd = max(1, cfg.cpu_target_workers), max(1, cfg.cpu_drafter_replicas)
        if nt == 1 and nd == 1 and cfg.nnodes == 1:
            return [LocalRole(True, True, "cpu")]
        return [LocalRole(False, True, "cpu")] * nd + [LocalRole(True, False, "cpu")] * nt
    if cfg.target_gpus == cfg.drafter_gpus and len(cfg.target_gpus) == 1:
        return [LocalRole(True, True, f"cuda:{cfg.target_gpus[0]}")]
    return ([LocalRole(False, True, f"cuda:{g}") for g in cfg.drafter_gpus]
            + [LocalRole(True, False, f"cuda:{g}") for g in cfg.target_gpus])


@dataclass
class Topology:
    """The whole job as every rank sees it (identical on all ranks after init)."""
    rank: int
    world: int
    local_rank: int
    role: LocalRole
    host: str
    roles: list[LocalRole] = field(default_factory=list)      # by global rank
    hosts: list[str] = field(default_factory=list)

    @property
    def target_ranks(self) -> list[int]:
        return [r for r, x in enumerate(self.roles) if x.target]

    @property
    def drafter_ranks(self) -> list[int]:
        return [r for r, x in enumerate(self.roles) if x.drafter]

    @property
    def is_target(self) -> bool:
        return self.role.target

    @property
    def is_drafter(self) -> bool:
        return self.role.drafter

    @property
    def leader(self) -> bool:
        """Global rank 0: a drafter by construction (status.json, metrics, checkpoint files)."""
        return self.rank == 0

    @property
    def target_index(self) -> int:
        return self.target_ranks.index(self.rank)

    @property
    def drafter_index(self) -> int:
        return self.drafter_ranks.index(self.rank)

    @property
    def role_name(self) -> str:
        return role_name(self.role)

    def describe(self) -> str:
        return "; ".join(f"rank {r} {role_name(x)} {h}/{x.device}" for r, (x, h) in enumerate(zip(self.roles,
                                                                                                   self.hosts)))


def role_name(x) -> str:
    return "target+drafter" if x.target and x.drafter else ("target" if x.target else "drafter")


def in_launched_rank() -> bool:
    """True inside a process started by torchrun / elastic_launch (it sets RANK etc.)."""
    return all(k in os.environ for k in RANK_ENV)
