"""The systemd notify protocol: :func:`sd_notify` and :class:`Notifier` speak it over ``$NOTIFY_SOCKET``
(AF_UNIX datagram; a leading ``@`` means the abstract namespace), and never raise. Standard library only.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Mapping

log = logging.getLogger("trainer.status")

_notify_error_logged = False


def sd_notify(*lines: str, env: Mapping[str, str] | None = None) -> bool:
    """Send ``lines`` (e.g. "READY=1") to ``$NOTIFY_SOCKET``.

    Returns False when NOTIFY_SOCKET is unset or sending failed; never raises (the first
    failure is logged as a warning)."""
    global _notify_error_logged
    env = os.environ if env is None else env
    addr = env.get("NOTIFY_SOCKET")
    if not addr or not lines:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    elif not addr.startswith("/"):
        if not _notify_error_logged:
            log.warning("NOTIFY_SOCKET=%r is not a unix socket path; not notifying", addr)
            _notify_error_logged = True
        return False
    payload = "\n".join(str(x) for x in lines).encode("utf-8", "replace")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(addr)
            sock.sendall(payload)
        return True
    except OSError as e:
        if not _notify_error_logged:
            log.warning("sd_notify to %s failed: %s (further failures not logged)",
                        env.get("NOTIFY_SOCKET"), e)
            _notify_error_logged = True
        return False


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """systemd's watchdog interval in seconds (WATCHDOG_USEC), or None when not set, invalid,
    or WATCHDOG_PID names another process."""
    env = os.environ if env is None else env
    usec = env.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1e6 if value > 0 else None


class Notifier:
    """Thin wrapper around :func:`sd_notify`; every method returns whether a message was sent.

    The trainer calls :meth:`watchdog` only when real progress happens (a finished step, a
    loading/checkpoint milestone), never from a timer, so a hung trainer is killed by
    WatchdogSec. :meth:`ready` sends READY=1 once.
    """

    def __init__(self, env: Mapping[str, str] | None = None):
        self._env = env
        self._ready_sent = False

    @property
    def env(self) -> Mapping[str, str]:
        return os.environ if self._env is None else self._env

    @property
    def enabled(self) -> bool:
        return bool(self.env.get("NOTIFY_SOCKET"))

    def notify(self, *lines: str) -> bool:
        return sd_notify(*lines, env=self.env)

    def ready(self, status: str | None = None) -> bool:
        if self._ready_sent:
            return False
        lines = ["READY=1"]
        if status:
            lines.append("STATUS=" + _one_line(status))
        sent = self.notify(*lines)
        self._ready_sent = sent or not self.enabled
        return sent

    def status(self, text: str) -> bool:
        text = _one_line(text)
        return self.notify("STATUS=" + text)

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        usec = max(1, int(float(seconds) * 1_000_000))
        return self.notify(f"EXTEND_TIMEOUT_USEC={usec}")

    def stopping(self, status: str | None = None) -> bool:
        lines = ["STOPPING=1"]
        if status:
            lines.append("STATUS=" + _one_line(status))
        return self.notify(*lines)

    def watchdog_interval(self) -> float | None:
        return watchdog_interval(self.env)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _one_line(text: str) -> str:
    return " ".join(str(text).split())
