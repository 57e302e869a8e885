"""Run log files, latest.log symlink, progress output, tables."""

from __future__ import annotations

import io
import logging
import os
import re

import pytest

from trainer.engine.runlog import Progress, format_duration, format_table, setup_logging


@pytest.fixture
def restore_root_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
            h.close()
    root.setLevel(level)
    logging.captureWarnings(False)


def test_setup_logging_file_and_latest_symlink(tmp_path, restore_root_logging):
    out = io.StringIO()
    log_dir = tmp_path / "logs"
    p1 = setup_logging(log_dir, "run/1 x", stream=out)
    assert p1.parent == log_dir and p1.exists()
    assert re.fullmatch(r"train-\d{8}T\d{6}Z-run_1_x\.log", p1.name), p1.name
    latest = log_dir / "latest.log"
    assert latest.is_symlink() and os.readlink(latest) == p1.name  # relative target
    logging.getLogger("trainer.test").info("hello %d", 42)
    for h in logging.getLogger().handlers:
        h.flush()
    text = p1.read_text()
    assert "hello 42" in text and "trainer.test" in text
    assert re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z INFO", text)
    assert "hello 42" in out.getvalue()

    # a second run (different run id) repoints latest.log, replaces our handlers only
    p2 = setup_logging(log_dir, "run2", stream=out)
    assert os.readlink(latest) == p2.name and latest.resolve() == p2.resolve()
    logging.getLogger("trainer.test").warning("second")
    for h in logging.getLogger().handlers:
        h.flush()
    assert "second" in p2.read_text() and "second" not in p1.read_text()
    ours = [h for h in logging.getLogger().handlers if getattr(h, "_dflash_runlog", False)]
    assert len(ours) == 3  # stdout, stderr, the file
    assert not [x for x in log_dir.iterdir() if x.name.endswith(".tmp")]


def test_errors_are_one_line_on_stderr_and_tracebacks_go_to_the_file(tmp_path, restore_root_logging):
    out, err = io.StringIO(), io.StringIO()
    path = setup_logging(tmp_path / "logs", "r", stream=out, err_stream=err)
    lg = logging.getLogger("trainer.test")
    lg.info("step 1")
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError:
        lg.exception("training failed")
    for h in logging.getLogger().handlers:
        h.flush()
    assert "step 1" in out.getvalue() and "training failed" not in out.getvalue()
    lines = err.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert "ERROR" in lines[0] and "training failed: RuntimeError: boom | second line" in lines[0]
    assert f"(traceback in {path})" in lines[0] and "Traceback" not in err.getvalue()
    text = path.read_text()
    assert "Traceback (most recent call last)" in text and 'raise RuntimeError("boom' in text
    lg.error("bad input: --data-dir: x", extra={"console": False})  # the caller prints its own line
    for h in logging.getLogger().handlers:
        h.flush()
    assert len(err.getvalue().splitlines()) == 1 and "bad input: --data-dir: x" in path.read_text()


def test_each_line_is_printed_once_after_basic_config(tmp_path, restore_root_logging, capsys):
    """The benchmark configured the console with basicConfig and then each run's setup_logging added its
    own: every line came out twice, in two formats."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", force=True)
    out = io.StringIO()
    setup_logging(tmp_path / "logs", "r", stream=out)
    logging.getLogger("trainer.test").info("only once")
    assert out.getvalue().count("only once") == 1
    captured = capsys.readouterr()
    assert "only once" not in captured.err + captured.out


def test_progress_bars_are_off_in_logs_that_are_not_a_terminal(tmp_path, restore_root_logging, monkeypatch):
    hf_logging = pytest.importorskip("transformers.utils.logging")
    hf_logging.enable_progress_bar()
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    try:
        setup_logging(tmp_path / "logs", "r", stream=io.StringIO())
        assert not hf_logging.is_progress_bar_enabled()
        assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    finally:
        hf_logging.enable_progress_bar()


def _fake_clock():
    t = [1000.0]
    return t, (lambda: t[0])


def test_progress_non_tty_periodic_lines(caplog):
    t, clock = _fake_clock()
    stream = io.StringIO()  # not a TTY
    lg = logging.getLogger("trainer.progress.test")
    with caplog.at_level(logging.INFO, logger="trainer.progress.test"):
        p = Progress(100, "train", interval=30, stream=stream, logger=lg, clock=clock)
        assert not p.tty
        for step in range(1, 101):
            t[0] += 1.0  # 1 s per step
            p.update(step, loss=2.0 - step / 100, tok_s=12345.0)
        p.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "trainer.progress.test"]
    # first update, then every 30 s (steps 31, 61, 91), then close
    assert len(lines) == 5, lines
    assert stream.getvalue() == ""  # nothing raw on the stream
    assert "1/100" in lines[0]
    mid = lines[1]
    assert "31/100" in mid and "it/s" in mid and "eta" in mid and "loss=1.6900" in mid
    assert "tok_s=12,345.0" in mid
    assert "100/100 (100.0%)" in lines[-1]


def test_progress_tty_in_place(caplog):
    t, clock = _fake_clock()
    stream = io.StringIO()
    p = Progress(10, "train", stream=stream, tty=True, clock=clock, refresh=0)
    with caplog.at_level(logging.INFO):
        for step in range(5, 11):  # resumed at step 5
            t[0] += 2.0
            p.update(step, loss=0.5)
        p.close()
    out = stream.getvalue()
    assert out.startswith("\r") and out.endswith("\n") and out.count("\n") == 1
    assert "10/10" in out and "loss=0.5000" in out and "|" in out
    assert "2.00 s/it" in out  # 5 steps in 10 s since the first update (slow: s/it)
    assert not [r for r in caplog.records if r.name == "trainer.progress"]


def test_progress_unknown_total():
    t, clock = _fake_clock()
    p = Progress(None, "eval", stream=io.StringIO(), tty=False, clock=clock)
    p.update(3)
    t[0] += 4
    p.update(5)
    s = p.format()
    assert "step 5" in s and "eta" not in s and "2.00 s/it" in s


def test_format_table():
    s = format_table(["stage", "ms", "share"],
                     [["target forward", 120.5, 0.6], ["optimizer", 3.25, None], ["q", 7]])
    lines = s.splitlines()
    assert lines[0].split() == ["stage", "ms", "share"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].startswith("target forward") and lines[2].endswith("0.600")
    assert "-" in lines[3].split()[-1]
    # numbers right-aligned: all rows end at the same column for the ms column
    ms_col_end = lines[0].index("ms") + 2
    assert lines[2][:ms_col_end].endswith("120.500") and lines[3][:ms_col_end].endswith("3.250")
    assert len({len(x) for x in lines[:3]}) == 1


def test_format_duration():
    assert format_duration(59) == "00:59"
    assert format_duration(3661) == "1:01:01"
    assert format_duration(None) == "?"
    assert format_duration(2 * 86400 + 5) == "2d00:00:05"
