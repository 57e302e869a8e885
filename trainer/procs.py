"""What this process can tell of another: whether a pid that status.json or a checkpoint's lock names is
alive here. The checkpoint format, the supervisor's orphan check and dflash-status ask it. Standard library
only.
"""

from __future__ import annotations

import os
from typing import Any


def pid_alive(pid: Any, started_at: Any = None) -> bool | None:
    """Whether ``pid`` (from status.json) is a live process *here*: None when status.json names no
    usable pid. A zombie counts as dead, and so does a process that started after the trainer wrote
    ``started_at`` (the pid was reused after the trainer died). Meaningful only in the trainer's own
    pid namespace (the container)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    except OSError:
        return None
    stat = _proc_stat(pid)
    if stat is None:
        return True
    state, start = stat
    if state == "Z":
        return False
    if start is not None and isinstance(started_at, (int, float)) and start > float(started_at) + 5.0:
        return False
    return True


def _proc_stat(pid: int) -> tuple[str, float | None] | None:
    """(state letter, start time in unix seconds) from /proc, or None where /proc is not there."""
    try:
        with open(f"/proc/{pid}/stat", "r") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat", "r") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        start = btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return fields[0], start
    except (OSError, ValueError, IndexError, StopIteration):
        return None
