"""Filters for the dflash_service role: one mapping of trainer flags -> the trainer's argv.

A plain function, so tests can check it without Ansible.
"""

from __future__ import annotations

import shlex


def dflash_service_argv(flags: dict) -> list:
    """{flag: value} -> ["--flag", "value", ...] in the mapping's order. Keys are flag names with
    underscores (block_size -> --block-size); true/false -> --flag / --no-flag (every trainer switch
    has both); a list -> comma-joined (GPU indices, --target-layers); None or "" -> left out (the
    trainer's default applies)."""
    argv = []
    for key, value in flags.items():
        flag = "--" + str(key).replace("_", "-")
        if value is None or value == "":
            continue
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):
            argv += [flag, ",".join(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


def dflash_service_flag_lines(flags: dict) -> list:
    """The same, one shell-quoted line per flag ("--block-size 32"), for run.sh."""
    lines, argv = [], dflash_service_argv(flags)
    for arg in argv:
        if arg.startswith("--") or not lines:
            lines.append(shlex.quote(arg))
        else:
            lines[-1] += " " + shlex.quote(arg)
    return lines


def dflash_service_env_quote(value) -> str:
    """A value for a systemd EnvironmentFile line, double-quoted: systemd would otherwise cut it at
    whitespace or take a '#' for a comment. Newlines cannot be carried and are refused."""
    text = str(value)
    if "\n" in text or "\r" in text:
        raise ValueError("an EnvironmentFile value cannot hold a newline")
    for ch in ("\\", '"', "$", "`"):
        text = text.replace(ch, "\\" + ch)
    return '"' + text + '"'


_UNITS = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3, "T": 1024 ** 4}


def dflash_service_memlock(limits_text: str, wanted) -> dict:
    """/proc/<pid>/limits text and the unit's LimitMEMLOCK= value (infinity, bytes, or 64M / 8G as
    systemd reads them, base 1024) -> {"ok", "soft", "hard", "wanted", "wanted_bytes"}. ok: the soft
    and the hard limit are each at least what the unit asks for (unlimited meets everything; for
    infinity only unlimited does). A process whose limits were not found is not ok."""
    want = str(wanted).strip()
    if want.lower() in ("infinity", "unlimited"):
        want_bytes = None
    else:
        num, unit = want.rstrip("KMGTB").rstrip(), want[len(want.rstrip("KMGTB")):].rstrip("B").upper()
        if not num.isdigit() or unit not in _UNITS:
            raise ValueError(f"LimitMEMLOCK value {wanted!r}: want infinity, bytes, or a number with K/M/G/T")
        want_bytes = int(num) * _UNITS[unit]
    soft = hard = None
    for line in str(limits_text).splitlines():
        if line.startswith("Max locked memory"):
            soft, hard = line[len("Max locked memory"):].split()[:2]

    def meets(value):
        if value is None:
            return False
        if value == "unlimited":
            return True
        return want_bytes is not None and int(value) >= want_bytes

    return {"ok": meets(soft) and meets(hard), "soft": soft, "hard": hard, "wanted": want,
            "wanted_bytes": want_bytes}


class FilterModule:
    def filters(self):
        return {"dflash_service_argv": dflash_service_argv, "dflash_service_flag_lines": dflash_service_flag_lines,
                "dflash_service_env_quote": dflash_service_env_quote,
                "dflash_service_memlock": dflash_service_memlock}
