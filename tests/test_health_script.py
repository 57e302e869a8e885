"""dflash-health (the verdict Ansible's health handler polls), run against stand-in `systemctl` and
`dflash-status` executables on PATH: healthy, still starting, and given up (`final`)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "roles" / "dflash_service" / "files" / "dflash-health"


def _exe(path: Path, body: str) -> Path:
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def verdict(tmp_path: Path, unit: dict, status: dict | None, after_step: int | None = None) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    lines = "\n".join(f"{k}={v}" for k, v in unit.items())
    _exe(bin_dir / "systemctl", f"#!/bin/sh\ncat <<'EOF'\n{lines}\nEOF\n")
    if status is None:
        st = _exe(tmp_path / "dflash-status", "#!/bin/sh\necho 'no status file' >&2\nexit 2\n")
    else:
        st = _exe(tmp_path / "dflash-status", f"#!/bin/sh\ncat <<'EOF'\n{json.dumps(status)}\nEOF\n")
    argv = [sys.executable, str(SCRIPT), "--unit", "dflash.service", "--dflash-status", str(st),
            "--status-file", str(tmp_path / "status.json"), "--max-age", "60"]
    if after_step is not None:
        argv += ["--after-step", str(after_step)]
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    out = subprocess.run(argv, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out)


ACTIVE = {"ActiveState": "active", "SubState": "running", "MainPID": 4242, "NRestarts": 0, "Result": "success",
          "ExecMainStatus": 0}
TRAINING = {"phase": "training", "pid": 4242, "step": 12, "heartbeat_age_s": 3.0, "loss": 4.2}


def test_healthy_training_job(tmp_path):
    v = verdict(tmp_path, ACTIVE, TRAINING)
    assert v["ok"] and not v["final"] and v["problems"] == []
    assert not verdict(tmp_path, ACTIVE, TRAINING, after_step=12)["ok"]  # step must advance
    assert verdict(tmp_path, ACTIVE, TRAINING, after_step=11)["ok"]


@pytest.mark.parametrize("unit,status,problem", [
    (dict(ACTIVE, ActiveState="activating", SubState="auto-restart", NRestarts=1), TRAINING, "auto-restart"),
    (ACTIVE, dict(TRAINING, pid=999), "status.json is from pid 999"),
    (ACTIVE, dict(TRAINING, loss=None), "loss is not finite"),
    (ACTIVE, dict(TRAINING, heartbeat_age_s=600.0), "heartbeat is stale"),
    (ACTIVE, None, "no readable status"),
])
def test_not_yet_healthy_but_worth_waiting(tmp_path, unit, status, problem):
    v = verdict(tmp_path, unit, status)
    assert not v["ok"] and not v["final"]
    assert any(problem in p for p in v["problems"]), v["problems"]


def test_unit_systemd_gave_up_on_is_final(tmp_path):
    failed = dict(ACTIVE, ActiveState="failed", SubState="failed", MainPID=0, NRestarts=3, Result="exit-code",
                  ExecMainStatus=1)
    v = verdict(tmp_path, failed, dict(TRAINING, phase="failed", error="RuntimeError: size mismatch"))
    assert not v["ok"] and v["final"]
    assert any("will not restart it by itself" in p for p in v["problems"])
    assert any("phase is failed: RuntimeError: size mismatch" in p for p in v["problems"])
