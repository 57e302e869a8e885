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


class FilterModule:
    def filters(self):
        return {"dflash_service_argv": dflash_service_argv, "dflash_service_flag_lines": dflash_service_flag_lines,
                "dflash_service_env_quote": dflash_service_env_quote}
