"""Where dist.py's five jobs went (issue 42): topology.py (ranks and roles), groups.py (process groups,
init, first use, the stop vote), dispatch.py (the dispatch plan) and launch.py (the supervisor).
The repo imports those; this module only re-exports them for work in flight and goes with the move
into subpackages."""

from .dispatch import Assignment, DispatchPlan, eligible_anchors  # noqa: F401
from .groups import (HOST_PHASE_TIMEOUT_S, Groups, StopVote, abort_groups, connect, finish_single,  # noqa: F401
                     hold_together, init_rank, init_single, new_group)
from .launch import free_port, launch  # noqa: F401
from .topology import RANK_ENV, LocalRole, Topology, in_launched_rank, local_roles  # noqa: F401
