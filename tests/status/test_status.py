"""status.json writer, systemd notify protocol and the dflash-status command (the trainer/status package)."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from trainer import status as st
from trainer.status import Notifier, StatusWriter, sd_notify, watchdog_interval
from trainer.status import cli as status_cli
from trainer.status import notify as status_notify
from trainer.status.cli import main

REPO = Path(__file__).resolve().parents[2]


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


# ------------------------------------------------------------------ StatusWriter


def test_writer_fields_and_contract_keys(tmp_path):
    p = tmp_path / "status.json"
    w = StatusWriter(p, "run-1")
    assert w.update(phase="training", step=3, epoch=0, loss=1.5, tokens_seen=100)
    d = _read(p)
    for key in st.STATUS_FIELDS:
        assert key in d, key
    assert d["phase"] == "training" and d["step"] == 3 and d["loss"] == 1.5
    assert d["run_id"] == "run-1" and d["pid"] == os.getpid()
    assert abs(d["updated_at"] - time.time()) < 5 and d["started_at"] <= d["updated_at"]
    assert d["error"] is None and d["last_checkpoint"] is None
    # merging keeps earlier fields
    w.update(step=4)
    d = _read(p)
    assert d["step"] == 4 and d["loss"] == 1.5 and d["tokens_seen"] == 100
    # no temp files left behind
    assert sorted(x.name for x in tmp_path.iterdir()) == ["status.json"]
    assert (p.stat().st_mode & 0o777) == 0o644


def test_nonfinite_floats_become_null(tmp_path):
    p = tmp_path / "status.json"
    w = StatusWriter(p, "r", strict=False)    # `extra`: an undeclared key, written outside tests
    w.update(loss=float("nan"), tokens_per_s=float("inf"), extra={"x": [float("-inf"), 1.0]},
             last_checkpoint=tmp_path / "step-00000001")
    text = p.read_text()
    assert "NaN" not in text and "Infinity" not in text
    d = json.loads(text)
    assert d["loss"] is None and d["tokens_per_s"] is None
    assert d["extra"] == {"x": [None, 1.0]}
    assert d["last_checkpoint"] == str(tmp_path / "step-00000001")


def test_tensor_scalars_are_numbers(tmp_path):
    torch = pytest.importorskip("torch")
    p = tmp_path / "status.json"
    StatusWriter(p, "r").update(loss=torch.tensor(2.5), step=torch.tensor(7),
                                tokens_per_s=torch.tensor(float("nan")))
    d = _read(p)
    assert d["loss"] == 2.5 and d["step"] == 7 and d["tokens_per_s"] is None


def test_concurrent_reader_only_sees_valid_json(tmp_path):
    p = tmp_path / "status.json"
    w = StatusWriter(p, "r", strict=False)    # `blob`: an undeclared key, to make the file big
    w.update(phase="training", step=0)
    stop = threading.Event()
    seen = {"reads": 0, "bad": [], "steps": set()}

    def reader():
        while not stop.is_set():
            try:
                text = p.read_text()
            except FileNotFoundError:  # must never happen after the first write
                seen["bad"].append("missing")
                continue
            try:
                seen["steps"].add(json.loads(text)["step"])
            except (ValueError, KeyError) as e:
                seen["bad"].append(repr(e))
            seen["reads"] += 1

    t = threading.Thread(target=reader)
    t.start()
    # big payload so a non-atomic write would be observable half-done
    blob = "x" * 20000
    try:
        for i in range(1, 150):
            w.update(step=i, loss=i * 0.5, blob=blob)
    finally:
        stop.set()
        t.join()
    assert not seen["bad"], seen["bad"][:3]
    assert seen["reads"] > 0
    assert _read(p)["step"] == 149


def test_concurrent_writers_thread_safe(tmp_path):
    p = tmp_path / "status.json"
    w = StatusWriter(p, "r", strict=False)    # f0, f1, f2: undeclared keys, one per thread

    def work(k):
        for i in range(30):
            w.update(**{f"f{k}": i})

    ts = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    d = _read(p)
    assert [d[f"f{k}"] for k in range(3)] == [29, 29, 29]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["status.json"]


def test_min_interval_throttles_but_phase_change_and_force_write(tmp_path):
    p = tmp_path / "status.json"
    w = StatusWriter(p, "r", min_interval=60)
    assert w.update(phase="training", step=1)
    assert not w.update(step=2)  # throttled, but kept in memory
    assert _read(p)["step"] == 1 and w.snapshot()["step"] == 2
    assert w.update(step=3, force=True)
    assert _read(p)["step"] == 3
    assert w.update(phase="checkpointing")  # phase change always writes
    assert _read(p)["phase"] == "checkpointing"
    assert not w.update(step=5)
    assert w.flush() and _read(p)["step"] == 5


def test_write_failure_is_logged_not_raised(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    w = StatusWriter(blocker / "status.json", "r")  # parent is a file -> OSError
    assert w.update(step=1) is False
    assert w.update(step=2) is False
    assert sum("could not write status file" in r.message for r in caplog.records) == 1


# ------------------------------------------------------------------ sd_notify


@pytest.fixture
def notify_sock(tmp_path):
    path = tmp_path / "notify.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.settimeout(2)
    yield str(path), s
    s.close()


def test_sd_notify_unset_returns_false(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sd_notify("READY=1") is False
    n = Notifier()
    assert not n.enabled and n.ready() is False and n.watchdog() is False


def test_sd_notify_real_socket(monkeypatch, notify_sock):
    path, s = notify_sock
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert sd_notify("READY=1", "STATUS=hello") is True
    assert s.recv(4096) == b"READY=1\nSTATUS=hello"

    n = Notifier()
    assert n.ready() is True
    assert s.recv(4096) == b"READY=1"
    assert n.ready() is False  # only once
    assert n.status("training\nstep 5") is True
    assert s.recv(4096) == b"STATUS=training step 5"
    assert n.watchdog() is True
    assert s.recv(4096) == b"WATCHDOG=1"
    assert n.extend_timeout(90) is True
    assert s.recv(4096) == b"EXTEND_TIMEOUT_USEC=90000000"
    assert n.stopping() is True
    assert s.recv(4096) == b"STOPPING=1"


def test_sd_notify_abstract_namespace(monkeypatch):
    name = f"dflash-test-{uuid.uuid4().hex}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        s.bind("\0" + name)
    except OSError as e:  # pragma: no cover - platform without abstract sockets
        pytest.skip(f"abstract unix sockets unavailable: {e}")
    s.settimeout(2)
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert Notifier().watchdog() is True
        assert s.recv(4096) == b"WATCHDOG=1"
    finally:
        s.close()


def test_sd_notify_errors_never_raise(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(status_notify, "_notify_error_logged", False)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens.sock"))
    assert sd_notify("READY=1") is False
    assert sd_notify("WATCHDOG=1") is False
    assert sum("sd_notify" in r.message for r in caplog.records) == 1


def test_status_writer_sends_status_line(monkeypatch, tmp_path, notify_sock):
    path, s = notify_sock
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    w = StatusWriter(tmp_path / "status.json", "r", notifier=Notifier())
    w.update(phase="training", step=12, loss=0.25, tokens_per_s=1234.0)
    msg = s.recv(4096).decode()
    assert msg.startswith("STATUS=training, step 12") and "loss 0.2500" in msg
    w.update(phase="failed", error="boom")
    assert s.recv(4096) == b"STATUS=failed: boom"


def test_watchdog_interval(monkeypatch):
    env = {"WATCHDOG_USEC": "30000000"}
    assert watchdog_interval(env) == 30.0
    assert watchdog_interval({**env, "WATCHDOG_PID": str(os.getpid())}) == 30.0
    assert watchdog_interval({**env, "WATCHDOG_PID": str(os.getpid() + 1)}) is None
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "junk"}) is None
    assert Notifier(env).watchdog_interval() == 30.0


# ------------------------------------------------------------------ dflash-status


def _write_status(path: Path, **fields):
    base = {"phase": "training", "step": 10, "epoch": 0, "tokens_seen": 5000,
            "tokens_per_s": 321.5, "loss": 2.0, "nan_skips": 1, "nan_streak": 0,
            "updated_at": time.time(), "started_at": time.time(), "pid": os.getpid(),
            "run_id": "abc", "last_checkpoint": None, "error": None, "resumed_from": None,
            "log_file": None}
    base.update(fields)
    path.write_text(json.dumps(base))


def test_cli_healthy(tmp_path, capsys):
    _write_status(tmp_path / "status.json")
    assert main(["--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "training" in out and "heartbeat age" in out and str(os.getpid()) in out and "healthy" in out


def test_cli_json(tmp_path, capsys):
    _write_status(tmp_path / "status.json", updated_at=time.time() - 10)
    assert main(["--status-file", str(tmp_path / "status.json"), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["healthy"] is True and 9 <= d["heartbeat_age_s"] < 60 and d["step"] == 10


def test_cli_failed(tmp_path, capsys):
    _write_status(tmp_path / "status.json", phase="failed", error="10 non-finite steps in a row")
    assert main(["--output-dir", str(tmp_path)]) == 1
    assert "10 non-finite steps" in capsys.readouterr().out


def test_cli_stale_and_max_age(tmp_path, capsys):
    _write_status(tmp_path / "status.json", updated_at=time.time() - 1000)
    assert main(["--output-dir", str(tmp_path)]) == 1
    assert "stale" in capsys.readouterr().out
    assert main(["--output-dir", str(tmp_path), "--max-age", "5000"]) == 0
    capsys.readouterr()
    assert main(["--output-dir", str(tmp_path), "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["healthy"] is False and d["heartbeat_age_s"] >= 999


def test_cli_done_is_healthy_regardless_of_age(tmp_path):
    _write_status(tmp_path / "status.json", phase="done", updated_at=time.time() - 1e6)
    assert main(["--output-dir", str(tmp_path)]) == 0


def test_cli_missing_updated_at_is_stale(tmp_path):
    _write_status(tmp_path / "status.json", updated_at=None)
    assert main(["--output-dir", str(tmp_path)]) == 1


def test_cli_missing(tmp_path, capsys):
    f = tmp_path / "nope" / "status.json"
    assert main(["--status-file", str(f)]) == 2
    assert str(f) in capsys.readouterr().err


@pytest.mark.parametrize("content", ["{not json", "", "[1, 2]"])
def test_cli_malformed(tmp_path, capsys, content):
    f = tmp_path / "status.json"
    f.write_text(content)
    assert main(["--status-file", str(f)]) == 2
    assert str(f) in capsys.readouterr().err


def test_cli_subprocess_exit_codes(tmp_path):
    ok = tmp_path / "ok"
    ok.mkdir()
    _write_status(ok / "status.json")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "status.json").write_text("{")
    stale = tmp_path / "stale"
    stale.mkdir()
    _write_status(stale / "status.json", updated_at=time.time() - 301)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    codes = {}
    for name, d in [("ok", ok), ("bad", bad), ("stale", stale), ("missing", tmp_path / "x")]:
        r = subprocess.run([sys.executable, "-m", "trainer.status", "--output-dir", str(d)],
                           capture_output=True, text=True, env=env, cwd=str(REPO), timeout=60)
        codes[name] = r.returncode
        if name in ("bad", "missing"):
            assert str(d / "status.json") in r.stderr
    assert codes == {"ok": 0, "bad": 2, "stale": 1, "missing": 2}


def test_writer_output_passes_cli(tmp_path, capsys):
    w = StatusWriter(tmp_path / "status.json", "run-x")
    w.update(phase="training", step=1, loss=math.nan)
    assert main(["--output-dir", str(tmp_path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["run_id"] == "run-x" and d["loss"] is None


# ------------------------------------------------------------------ bug 5: a killed trainer is dead at once


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_killed_trainer_is_dead_not_healthy(tmp_path, capsys):
    """kill -9 leaves status.json saying `training` with a fresh heartbeat; where the pid lives,
    dflash-status must say dead (exit 1) at once instead of healthy for --max-age seconds."""
    _write_status(tmp_path / "status.json", pid=_dead_pid())
    assert main(["--output-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "UNHEALTHY (dead: pid" in out
    assert main(["--output-dir", str(tmp_path), "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["healthy"] is False and d["pid_alive"] is False and d["reason"].startswith("dead")
    # where the pid does not live (the node reading a container's file) the check can be left out
    assert main(["--output-dir", str(tmp_path), "--no-pid-check"]) == 0


def test_reused_pid_and_finished_runs(tmp_path):
    # our own pid, but a process that started long after the trainer wrote started_at: pid reused
    _write_status(tmp_path / "status.json", started_at=time.time() - 10 * 86400)
    assert main(["--output-dir", str(tmp_path)]) == 1
    # done/failed runs have exited: their pid is not checked
    _write_status(tmp_path / "status.json", phase="done", pid=_dead_pid())
    assert main(["--output-dir", str(tmp_path)]) == 0


# ------------------------------------------------------------------ the handler's verdict (--unit, --training, --after-step)

ACTIVE = {"ActiveState": "active", "SubState": "running", "NRestarts": 0, "Result": "success", "ExecMainStatus": "0"}


def _verdict(tmp_path, capsys, monkeypatch, unit: dict, status: dict | None, *extra: str) -> tuple[int, dict]:
    monkeypatch.setattr(status_cli, "unit_state", lambda name: dict(unit))
    f = tmp_path / "status.json"
    if status is None:
        f.unlink(missing_ok=True)
    else:
        _write_status(f, **status)
    rc = main(["--status-file", str(f), "--max-age", "60", "--unit", "dflash.service", "--training", "--json",
               *extra])
    return rc, json.loads(capsys.readouterr().out)


def test_handler_verdict_healthy_and_step_advance(tmp_path, capsys, monkeypatch):
    unit = dict(ACTIVE, MainPID=os.getpid())
    rc, v = _verdict(tmp_path, capsys, monkeypatch, unit, {"step": 12})
    assert rc == 0 and v["healthy"] and not v["final"] and v["problems"] == [] and v["unit"]["MainPID"] == os.getpid()
    assert _verdict(tmp_path, capsys, monkeypatch, unit, {"step": 12}, "--after-step", "12")[0] == 1
    assert _verdict(tmp_path, capsys, monkeypatch, unit, {"step": 12}, "--after-step", "11")[0] == 0


@pytest.mark.parametrize("unit,status,problem", [
    ({"ActiveState": "activating", "SubState": "auto-restart", "NRestarts": 1}, {}, "auto-restart"),
    ({}, {"pid": 1}, "status.json is from pid 1"),
    ({}, {"loss": None}, "loss is not finite"),
    ({}, {"phase": "loading"}, "phase is loading, not yet training"),
    ({}, {"updated_at": time.time() - 600}, "stale"),
    ({}, None, "no readable status"),
])
def test_handler_verdict_not_yet_healthy_but_worth_waiting(tmp_path, capsys, monkeypatch, unit, status, problem):
    rc, v = _verdict(tmp_path, capsys, monkeypatch, dict(ACTIVE, MainPID=os.getpid(), **unit), status)
    assert rc in (1, 2) and not v["healthy"] and not v["final"]
    assert any(problem in p for p in v["problems"]), v["problems"]


def test_handler_verdict_unit_systemd_gave_up_on_is_final(tmp_path, capsys, monkeypatch):
    failed = dict(ACTIVE, ActiveState="failed", SubState="failed", MainPID=0, NRestarts=3, Result="exit-code")
    rc, v = _verdict(tmp_path, capsys, monkeypatch, failed,
                     {"phase": "failed", "error": "RuntimeError: size mismatch"})
    assert rc == 1 and not v["healthy"] and v["final"]
    assert any("will not restart it by itself" in p for p in v["problems"])
    assert any("failed: RuntimeError: size mismatch" in p for p in v["problems"])



# record_failure: status.json's one writer outside a running job (bad input, a bad shard, a failed rank).

def test_record_failure_writes_a_fresh_failed_record_when_there_is_none(tmp_path):
    from trainer.status import record_failure
    path = tmp_path / "status.json"
    assert record_failure(path, "--lr: must be > 0") is True
    st = json.loads(path.read_text())
    assert (st["phase"], st["error"], st["pid"]) == ("failed", "--lr: must be > 0", os.getpid())
    assert time.time() - st["updated_at"] < 60


def test_record_failure_keeps_the_records_other_fields(tmp_path):
    from trainer.status import record_failure
    path = tmp_path / "status.json"
    path.write_text(json.dumps({"phase": "training", "step": 41, "run_id": "r1", "error": None}))
    record_failure(path, "shard 3 is truncated")
    st = json.loads(path.read_text())
    assert (st["phase"], st["step"], st["run_id"], st["error"]) == ("failed", 41, "r1", "shard 3 is truncated")


def test_record_failure_keeps_a_ranks_own_reason_unless_the_line_quotes_it(tmp_path):
    from trainer.status import record_failure
    path = tmp_path / "status.json"
    path.write_text(json.dumps({"phase": "failed", "error": "rank 1: CUDA out of memory"}))
    record_failure(path, "rank 1 failed (exit 1)", merge_rank_error=True)
    assert json.loads(path.read_text())["error"] == "rank 1 failed (exit 1); rank 1: CUDA out of memory"
    path.write_text(json.dumps({"phase": "failed", "error": "rank 1: CUDA out of memory"}))
    record_failure(path, "rank 1 failed (exit 1): CUDA out of memory", merge_rank_error=True)
    assert json.loads(path.read_text())["error"] == "rank 1 failed (exit 1): CUDA out of memory"


def test_record_failure_creates_nothing_under_a_mistyped_path_and_never_raises(tmp_path):
    from trainer.status import record_failure
    assert record_failure(tmp_path / "no-such-dir" / "status.json", "x", only_into_existing_dir=True) is False
    assert not (tmp_path / "no-such-dir").exists()
    (tmp_path / "a-file").write_text("")
    assert record_failure(tmp_path / "a-file" / "status.json", "x") is False           # unwritable: False



# What status.json reports, in one place: the keys status.py declares (STATUS_SCHEMA) are the ones every writer
# writes; docs/contracts.md's table is rendered from them (tests/lab/test_contracts_tables.py).

def _status_writes(tree) -> list[tuple[int, set[str]]]:
    """(line, keys) of every write to status.json in one module's AST: `<...>status.update(...)` (the receiver a
    name or attribute called status, e.g. `self.report.status`, `status`), `beating(<writer>, ...)`."""
    import ast
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        recv = f.value if isinstance(f, ast.Attribute) else None
        is_update = f.attr == "update" if isinstance(f, ast.Attribute) else False
        is_update = is_update and ((isinstance(recv, ast.Attribute) and recv.attr == "status")
                                   or (isinstance(recv, ast.Name) and recv.id == "status"))
        is_beating = (isinstance(f, ast.Name) and f.id == "beating") or (isinstance(f, ast.Attribute) and f.attr == "beating")
        if is_update or is_beating:
            out.append((node.lineno, {k.arg for k in node.keywords if k.arg not in (None, "force", "interval")}))
    return out


def _written_status_keys(root: Path | None = None) -> dict[str, set[str]]:
    """Every keyword given to a status writer in trainer/ (its subpackages too), per file."""
    import ast
    root = root or REPO / "trainer"
    out: dict[str, set[str]] = {}
    for src in sorted(root.rglob("*.py")):
        for _, keys in _status_writes(ast.parse(src.read_text())):
            out.setdefault(str(src.relative_to(root.parent)), set()).update(keys)
    return out


def test_every_key_a_writer_puts_in_status_json_is_declared():
    from trainer.status import STATUS_KEYS
    written = _written_status_keys()
    assert {"trainer/engine/train.py", "trainer/engine/report.py"} <= set(written), f"a status writer not found: the scan is broken ({sorted(written)})"
    assert {"phase", "error", "nan_streak", "world_size", "ranks", "eval"} <= set().union(*written.values())
    undeclared = {f: sorted(k - STATUS_KEYS) for f, k in written.items() if k - STATUS_KEYS}
    assert not undeclared, (f"status.json keys written but not declared in trainer/status/schema.py STATUS_SCHEMA: "
                            f"{undeclared}; declare them, then .venv/bin/python trainer/lab/contracts_tables.py --write")


def test_the_scan_finds_an_undeclared_key_in_every_writer_form(tmp_path):
    """A key written but not declared, in each form a writer takes, is found (the scan cannot pass on anything)."""
    from trainer.status import STATUS_KEYS
    pkg = tmp_path / "trainer" / "wing"
    pkg.mkdir(parents=True)
    (pkg / "w.py").write_text("def f(self, status, w):\n"
                              "    self.report.status.update(phase='x', gpu_temp=1, force=True)\n"
                              "    status.update(disk_free=2)\n"
                              "    with beating(w, interval=1, phase='eval', eval_owner=3):\n"
                              "        pass\n")
    written = _written_status_keys(tmp_path / "trainer")
    assert written["trainer/wing/w.py"] - STATUS_KEYS == {"gpu_temp", "disk_free", "eval_owner"}


def test_schema_is_one_declaration_the_contract_tuples_come_from():
    from trainer.status import PHASES, STATUS_FIELDS, STATUS_KEYS, STATUS_LATER_FIELDS, STATUS_SCHEMA
    names = [f.name for f in STATUS_SCHEMA]
    assert len(names) == len(set(names)) and set(names) == STATUS_KEYS
    assert set(STATUS_FIELDS) | set(STATUS_LATER_FIELDS) == STATUS_KEYS and not set(STATUS_FIELDS) & set(STATUS_LATER_FIELDS)
    for f in STATUS_SCHEMA:
        assert f.meaning and f.phases and set(f.phases) <= set(PHASES), f


def test_the_writer_refuses_an_undeclared_key_under_the_tests(tmp_path):
    from trainer.status import UndeclaredStatusField, beating
    p = tmp_path / "status.json"
    w = StatusWriter(p, "r")                           # strict by default under pytest
    assert w.strict
    with pytest.raises(UndeclaredStatusField, match=r"gpu_temp not declared in trainer/status/schema.py STATUS_SCHEMA.*"
                                                    r"trainer/lab/contracts_tables.py --write"):
        w.update(phase="training", gpu_temp=71)
    assert not p.exists() and "gpu_temp" not in w.snapshot()   # nothing merged, nothing written
    with pytest.raises(UndeclaredStatusField):
        with beating(w, interval=10, phase="eval", eval_owner=3):
            pass


def test_outside_the_tests_an_undeclared_key_is_written_and_logged_once(tmp_path, caplog):
    p = tmp_path / "status.json"
    w = StatusWriter(p, "r", strict=False)
    assert w.update(gpu_temp=71) and w.update(gpu_temp=72)
    assert _read(p)["gpu_temp"] == 72
    assert sum("gpu_temp not declared" in r.message for r in caplog.records) == 1


def test_strictness_follows_the_environment():
    assert st.strict_default({"PYTEST_CURRENT_TEST": "t"}) is True
    assert st.strict_default({}) is False                             # a deployed trainer: never raises
    assert st.strict_default({"DFLASH_STATUS_STRICT": "1"}) is True
    assert st.strict_default({"DFLASH_STATUS_STRICT": "0", "PYTEST_CURRENT_TEST": "t"}) is False


def test_contracts_status_section_holds_the_generated_table():
    from trainer.status import PHASES, STATUS_SCHEMA
    doc = (REPO / "docs" / "contracts.md").read_text()
    section = doc.split("## status.json", 1)[1].split("\n## ", 1)[0]
    assert "<!-- generated: status fields" in section
    for f in STATUS_SCHEMA:
        assert f"| `{f.name}` |" in section, f.name
    assert "\\|".join(PHASES) in section
