"""`python -m trainer` / `dflash-train`: parse, validate cheaply (exit 2 on bad input), then train."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    from .config import ConfigError, main_check, parse_args, validate

    prog = "dflash-train"
    try:
        cfg = parse_args(argv, prog=prog)
        if cfg.check_config:
            return main_check(cfg)
        validate(cfg)  # before anything heavy loads
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    from .train import train
    return train(cfg)


if __name__ == "__main__":
    sys.exit(main())
