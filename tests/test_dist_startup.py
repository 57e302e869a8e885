"""The job's startup on NCCL's rules, counted with torch's own group-creation code.

With eager init (`device_id` given to init_process_group, as init_rank does on GPUs) every new process
group is an `ncclCommSplit` of the world communicator on *every* rank: members split with their color,
ranks outside the group with no color (torch's `_new_process_group_helper`, whatever the new group's
backend), and NCCL pairs the splits of all ranks by call order alone. Here each rank of a layout builds
`Groups` on PyTorch's fake process group, with the default group marked as bound to a device; torch's
code decides who splits, a backend standing for NCCL and the split source only count the calls."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.testing._internal.distributed.fake_pg import FakeStore, _create_fake_pg

from trainer.distributed.groups import Groups
from trainer.lab.opreplay import topology

COUNTED = "countednccl"       # the default backend of the count: NCCL's stand-in


class _SplitSource:
    """What torch splits the world communicator from (`_get_split_source`): counts no-color splits."""
    supports_splitting = True

    def __init__(self, calls: list):
        self.calls = calls

    def perform_nocolor_split(self, device):
        self.calls.append(None)


def _splits(topo, build) -> list:
    """The world-communicator splits `topo.rank` makes while `build()` runs: None for a no-color split,
    else the members of the group it splits for."""
    calls: list = []

    def nccl_member(common, opts):   # a member of an NCCL subgroup under eager init: a split with its color
        if c10d.is_initialized() and c10d._get_default_group().bound_device_id is not None:
            calls.append(tuple(common.global_ranks_in_group))
        return _create_fake_pg(common, opts)

    if COUNTED.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(COUNTED, nccl_member, extended_api=True, devices=["cpu", "cuda"])
    dist.Backend._plugins[COUNTED.upper()] = dist.Backend._plugins[COUNTED.upper()]._replace(creator_fn=nccl_member)
    dist.init_process_group(COUNTED, store=FakeStore(), rank=topo.rank, world_size=topo.world)
    c10d._get_default_group().bound_device_id = torch.device("cuda", 0)   # eager init, as on GPUs
    real = c10d._get_split_source
    c10d._get_split_source = lambda pg: _SplitSource(calls)
    try:
        build()
    finally:
        c10d._get_split_source = real
        dist.destroy_process_group()
    return calls


def _check_splits(per_rank: dict[int, list]) -> None:
    """NCCL's pairing: every rank makes the same number of splits, and at each one the ranks giving a
    group's color are exactly its members."""
    counts = {r: len(v) for r, v in per_rank.items()}
    assert len(set(counts.values())) == 1, f"world-communicator splits per rank differ: {counts}"
    for k in range(next(iter(counts.values()))):
        colors = {r: v[k] for r, v in per_rank.items()}
        for group in {c for c in colors.values() if c is not None}:
            givers = sorted(r for r, c in colors.items() if c == group)
            assert givers == sorted(group), f"split {k}: ranks {givers} split for group {group}"


def _groups(topo, transport="pair"):
    return lambda: Groups(topo, datetime.timedelta(seconds=60), transport, host_backend="fake")


@pytest.mark.parametrize("layout", ["1+1", "1+2", "5+3", "4+4x2"])
@pytest.mark.parametrize("transport", ["pair", "world"])
def test_every_rank_makes_the_same_world_communicator_splits(layout, transport):
    """The startup hang of issue 40: dctl (gloo, drafter ranks only) made the target ranks split once
    more than the drafters (17 against 16 at 5+3), so every later pair communicator was mismatched."""
    _check_splits({t.rank: _splits(t, _groups(t, transport)) for t in topology(layout)})


def test_the_count_sees_a_gloo_group_that_leaves_ranks_out():
    """The check itself: a plain gloo subgroup of some ranks (what dctl was) unbalances the splits."""
    def build(topo):
        return lambda: dist.new_group(topo.drafter_ranks, backend="fake")
    per_rank = {t.rank: _splits(t, build(t)) for t in topology("1+2")}
    with pytest.raises(AssertionError, match="splits per rank differ"):
        _check_splits(per_rank)


def test_roles_are_exchanged_on_the_gloo_control_group_not_the_world_group(monkeypatch, tmp_path):
    """init_rank's exchange of roles and hosts: an object collective on the NCCL world group would connect
    its ring and keep its buffers, which --transport pair never uses again."""
    from trainer.config.options import TrainConfig
    from trainer.distributed.groups import finish_single, init_single
    calls = []
    real = dist.all_gather_object

    def spy(out, obj, group=None):
        calls.append(group)
        return real(out, obj, group=group)
    monkeypatch.setattr(dist, "all_gather_object", spy)
    cfg = TrainConfig(target_model="t", data_dir="d", output_dir=str(tmp_path), target_gpus=[], drafter_gpus=[])
    try:
        topo, groups = init_single(cfg)
        assert calls and all(g is groups.control for g in calls), calls
        assert groups.control is not dist.group.WORLD
    finally:
        finish_single()


@pytest.mark.parametrize("given, cpus, nproc, want", [
    (None, 32, 8, 4),        # unset: this node's share
    ("4", 32, 8, 4),         # run.sh's value, the same share
    ("2", 32, 8, 2),         # a smaller value stays
    ("4", 8, 8, 1),          # the container has fewer cores than the inventory said: lowered
    ("0", 16, 3, 5), ("x", 16, 3, 5),   # not a positive number: the share
])
def test_the_supervisor_bounds_the_compile_workers_by_the_cores_and_ranks(given, cpus, nproc, want):
    from trainer.distributed.launch import COMPILE_THREADS_ENV, bound_compile_threads
    env = {} if given is None else {COMPILE_THREADS_ENV: given}
    assert bound_compile_threads(env, nproc, cpus) == want
    assert env[COMPILE_THREADS_ENV] == str(want)
