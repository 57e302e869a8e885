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


@pytest.mark.parametrize("layout", ["1+1", "1+2", "5+3", "4+4x2", "13+3x2"])
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


@pytest.mark.parametrize("given, cpus, nproc, compiling, want", [
    (None, 32, 8, 8, 4),        # unset: this node's share
    ("4", 32, 8, 8, 4),         # run.sh's value, the same share
    ("2", 32, 8, 8, 2),         # a smaller value stays
    ("4", 8, 8, 8, 1),          # the container has fewer cores than the inventory said: lowered
    ("0", 16, 3, 3, 5), ("x", 16, 3, 3, 5),   # not a positive number: the share
    ("4", 32, 8, 3, 10),        # a hybrid at 5 + 3: only the drafters compile, the targets' shares are theirs
    (None, 32, 8, 3, 10),
    ("2", 32, 8, 3, 5),         # an operator's smaller share, passed on the same way
])
def test_the_supervisor_bounds_the_compile_workers_by_the_cores_and_the_ranks_that_compile(given, cpus, nproc,
                                                                                          compiling, want):
    """Issue 61, item 3: the compile workers are sized by the ranks that compile, not by every rank."""
    from trainer.distributed.launch import COMPILE_THREADS_ENV, bound_compile_threads
    env = {} if given is None else {COMPILE_THREADS_ENV: given}
    assert bound_compile_threads(env, nproc, cpus, compiling) == want
    assert env[COMPILE_THREADS_ENV] == str(want)


def test_the_ranks_that_compile_follow_compile_as_the_ranks_resolve_it():
    from trainer.config.options import parse_args
    from trainer.distributed.launch import compiling_ranks
    from trainer.distributed.startup import StartupBounds
    from trainer.distributed.topology import local_roles
    cfg = parse_args(["--target-model", "/m", "--data-dir", "/d", "--output-dir", "/o", "--target-gpus", "0,1,2,3,4",
                      "--drafter-gpus", "5,6,7"])
    roles = local_roles(cfg)
    hybrid = StartupBounds(1, 1, "", compile="drafter")     # --compile auto on a hybrid target
    assert compiling_ranks(cfg, roles, hybrid) == 3
    assert compiling_ranks(cfg, roles, StartupBounds(1, 1, "", compile="all")) == 8
    assert compiling_ranks(cfg, roles, StartupBounds(1, 1, "", compile="none")) == 1


def test_each_rank_gets_its_share_of_the_cores_for_its_intra_op_threads():
    """Issue 61, item 8: OMP_NUM_THREADS unset gave 8 ranks 32 threads each for DCP's serialization and copies."""
    from trainer.distributed.launch import OMP_THREADS_ENV, bound_omp_threads
    env: dict = {}
    assert bound_omp_threads(env, 8, 32) == 4 and env[OMP_THREADS_ENV] == "4"
    env = {OMP_THREADS_ENV: "1"}      # the CPU stand-ins' inventory: kept
    assert bound_omp_threads(env, 3, 16) == 1


def test_the_first_steps_allow_a_compile_more_before_the_timeout(tmp_path):
    """Issue 61, item 3: compiles after the warmup come in the first steps (steps 0, 8, 12 and 19 on a GPU run),
    and a peer waits on each against the steps' groups' timeout. Two real gloo drafter ranks on their group
    (--dist-timeout 2 s, 4 s more for the first steps): a rank 3 s late to the all-reduce is waited for during
    the first steps, and is a timeout after Groups.settle."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from trainer.distributed.launch import free_port
    port = free_port()
    code = f"""
import datetime, os, sys, time
import torch, torch.distributed as dist
from trainer.distributed.groups import FIRST_STEPS, Groups
from trainer.lab.opreplay import topology
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(hours=3))
g = Groups(topology("0+2")[rank], datetime.timedelta(seconds=2), "pair", first_extra=datetime.timedelta(seconds=4))
for phase in ("first", "settled"):
    if phase == "settled":
        assert g.settle(FIRST_STEPS)
    if rank == 1:
        time.sleep(3)
    try:
        dist.all_reduce(torch.ones(1), group=g.drafters)
        print(phase, "WAITED", flush=True)
    except RuntimeError as e:
        print(phase, "TIMEOUT", str(e).splitlines()[0][:80], flush=True)
        break
os._exit(0)
"""
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(Path(__file__).parents[2]))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env) for r in (0, 1)]
    out0 = procs[0].communicate(timeout=600)[0]
    procs[1].communicate(timeout=60)
    assert "first WAITED" in out0 and "settled TIMEOUT" in out0, out0


def test_the_first_steps_allow_a_compile_at_its_worst_case():
    """The longer timeout of the first steps covers a compile after the warmup at the start-up's own worst
    case for one compiled shape (the distributed wing cannot import the engine's constant, so it is tied here)."""
    from trainer.distributed.groups import FIRST_STEPS_EXTRA_S
    from trainer.engine.compile_warmup import COMPILED_SHAPE_S
    assert FIRST_STEPS_EXTRA_S >= COMPILED_SHAPE_S
