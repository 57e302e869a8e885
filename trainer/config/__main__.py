"""`python -m trainer.config FLAGS`: the deploy's flag check, which the Ansible role runs on the controller.

The options themselves (:class:`~trainer.config.options.TrainConfig`, the parser generated from its fields, the
flag rules and the role's argument spec) are trainer/config/options.py's; the checks that read a run's files
(`--check-config`, and every start) are trainer/config/preflight.py's. This module is the controller's entry
point and stays torch-free, as both of those are at import.
"""

from __future__ import annotations

import sys

from trainer.config.options import ConfigError, ansible_spec_yaml, parse_args, validate_flags


def main(argv=None) -> int:
    """`python -m trainer.config FLAGS`: check the flags alone (no file is read, no GPU counted),
    with the trainer's own rules and messages. The Ansible role runs it on the controller before a
    deploy touches anything. Exit 0, or 2 with one line naming the flag.
    `python -m trainer.config --ansible-spec` prints the role's argument_specs block for the flags."""
    prog = "dflash-train"
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["--ansible-spec"]:
        sys.stdout.write(ansible_spec_yaml())
        return 0
    try:
        validate_flags(parse_args(argv, prog=prog), gpu_count=-1)
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print("flags ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())

