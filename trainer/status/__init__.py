"""The run's status: status.json, systemd's notify protocol and the `dflash-status` command, one job per module.

* trainer/status/schema.py: :data:`STATUS_SCHEMA` declares every key status.json can hold, once.
* trainer/status/writer.py: :class:`StatusWriter` writes status.json atomically; :func:`read_status` reads it.
* trainer/status/notify.py: :func:`sd_notify` / :class:`Notifier` speak the systemd notify protocol.
* trainer/status/health.py: :func:`verdict`, the one health verdict.
* trainer/status/cli.py: ``dflash-status``.

Standard library only (importable without torch), so `dflash-status` starts fast. The names below are the
package's public face: the other wings import them from here.
"""

from trainer.status.health import DEFAULT_MAX_AGE, evaluate_health, unit_state, verdict
from trainer.status.notify import Notifier, sd_notify, watchdog_interval
from trainer.status.schema import (
    PHASES,
    STATUS_FIELDS,
    STATUS_KEYS,
    STATUS_LATER_FIELDS,
    STATUS_SCHEMA,
    StatusField,
    UndeclaredStatusField,
    strict_default,
)
from trainer.status.writer import (
    StatusFileError,
    StatusWriter,
    atomic_write_json,
    beating,
    format_status_line,
    read_status,
    record_failure,
    to_jsonable,
)

__all__ = [
    "DEFAULT_MAX_AGE", "PHASES", "STATUS_FIELDS", "STATUS_KEYS", "STATUS_LATER_FIELDS", "STATUS_SCHEMA",
    "Notifier", "StatusField", "StatusFileError", "StatusWriter", "UndeclaredStatusField", "atomic_write_json",
    "beating", "evaluate_health", "format_status_line", "read_status", "record_failure", "sd_notify",
    "strict_default", "to_jsonable", "unit_state", "verdict", "watchdog_interval",
]
