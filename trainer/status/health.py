"""The one health verdict on a run (:func:`verdict`): its status.json's phase and heartbeat, whether the
pid it names lives, and, where asked, its systemd unit's state (:func:`unit_state`). dflash-status prints it;
the Ansible health handler polls it. Standard library only.
"""

from __future__ import annotations

import math
import time
from typing import Any, Mapping

from trainer.procs import pid_alive

DEFAULT_MAX_AGE = 300.0


def unit_state(unit: str) -> dict[str, Any]:
    """`systemctl show UNIT` (the properties the verdict needs); MainPID/NRestarts as ints."""
    import subprocess
    props = ("ActiveState", "SubState", "MainPID", "NRestarts", "Result", "ExecMainStatus")
    try:
        out = subprocess.run(["systemctl", "show", unit, *(f"--property={p}" for p in props)],
                             capture_output=True, text=True, check=False, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return {"ActiveState": "unknown", "SubState": str(e)}
    state: dict[str, Any] = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    for key in ("MainPID", "NRestarts"):
        try:
            state[key] = int(state.get(key, 0))
        except ValueError:
            state[key] = 0
    return state


def evaluate_health(st: Mapping[str, Any], max_age: float = DEFAULT_MAX_AGE,
                    now: float | None = None, *, check_pid: bool = False) -> tuple[bool, float | None, str]:
    """(healthy, heartbeat_age_s, reason). ``check_pid``: a job whose phase says it runs but whose
    pid is not alive here is ``dead`` at once, not healthy until its heartbeat goes stale."""
    now = time.time() if now is None else now
    updated = st.get("updated_at")
    age: float | None = None
    if isinstance(updated, (int, float)) and not isinstance(updated, bool) \
            and math.isfinite(updated):
        age = max(0.0, now - float(updated))
    phase = st.get("phase")
    if phase == "failed":
        return False, age, f"failed: {st.get('error') or 'no error recorded'}"
    if phase == "done":
        return True, age, "done"
    if check_pid and pid_alive(st.get("pid"), st.get("started_at")) is False:
        return False, age, (f"dead: pid {st.get('pid')} is not running (phase was {phase}"
                            + (f", last heartbeat {age:.0f} s ago)" if age is not None else ")"))
    if age is None:
        return False, None, "stale: no valid updated_at"
    if age > max_age:
        return False, age, f"stale: no heartbeat for {age:.0f} s (max age {max_age:g} s)"
    return True, age, "ok"


def verdict(st: Mapping[str, Any] | None, *, max_age: float = DEFAULT_MAX_AGE, check_pid: bool = True,
            unit: Mapping[str, Any] | None = None, unit_name: str = "", training: bool = False,
            after_step: int | None = None, read_error: str | None = None,
            now: float | None = None) -> dict[str, Any]:
    """The one health verdict (dflash-status and the Ansible health handler): healthy, every reason
    it is not (problems), and final (waiting cannot help: systemd gave up on the unit).

    ``unit`` (systemctl show of the training unit): it must be active and status.json written by
    its main pid. ``training``: the phase must be training (done counts: the run finished) with a
    finite loss. ``after_step``: the step must have advanced past it."""
    problems: list[str] = []
    final = False
    age: float | None = None
    reason = read_error or "no status"
    if unit is not None:
        active = unit.get("ActiveState")
        final = active == "failed"
        if active != "active":
            problems.append(f"{unit_name or 'the unit'} is {active}/{unit.get('SubState')} "
                            f"(result {unit.get('Result')}, restarts {unit.get('NRestarts')})"
                            + ("; systemd gave up on it and will not restart it by itself" if final else ""))
    if st is None:
        problems.append(f"no readable status: {read_error}")
    else:
        ok, age, reason = evaluate_health(st, max_age, now, check_pid=check_pid)
        phase = st.get("phase")
        done = phase == "done"
        if not ok:
            problems.append(reason)
        if unit is not None and not done and st.get("pid") != unit.get("MainPID"):
            problems.append(f"status.json is from pid {st.get('pid')}, the unit's main pid is "
                            f"{unit.get('MainPID')} (not yet written by this run)")
        if training and not done:
            if phase not in ("training", "eval", "failed"):
                problems.append(f"phase is {phase}, not yet training")
            loss = st.get("loss")
            if not (isinstance(loss, (int, float)) and not isinstance(loss, bool) and math.isfinite(loss)):
                problems.append(f"loss is not finite ({loss})")
        step = st.get("step")
        if after_step is not None and not done and not (isinstance(step, int) and step > after_step):
            problems.append(f"step {step} has not advanced past {after_step}")
    return {"healthy": not problems, "final": final, "problems": problems,
            "reason": problems[0] if problems else reason, "heartbeat_age_s": round(age, 3) if age is not None else None}
