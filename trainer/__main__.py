"""`python -m trainer` / `dflash-train`: parse, validate cheaply (exit 2 on bad input), then train.

Started by hand or by run.sh, this process is the supervisor: it launches this node's ranks (one per
GPU) through PyTorch's launcher and waits (trainer/distributed/launch.py). Started by the launcher (or by torchrun),
it is one rank.
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    from trainer.optional import defer
    defer()   # a program: torchao loads only when --fp8 asks for it (trainer/optional.py)
    from trainer.config.options import ConfigError, parse_args
    from trainer.config.preflight import main_check, validate
    from trainer.distributed.topology import in_launched_rank

    prog = "dflash-train"
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = None
    try:
        cfg = parse_args(argv, prog=prog)
        if cfg.check_config:
            return main_check(cfg)
        if not in_launched_rank():
            validate(cfg)  # before anything heavy loads; ranks validate again in setup
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        if cfg is not None and not cfg.check_config and not e.leave_output:
            record_bad_input(cfg.status_file, f"{e}")
        return 2
    from trainer.optional import loading
    if in_launched_rank():
        with loading():   # torch, transformers and the engine: frozen for the collector (trainer/optional.py)
            from trainer.engine.rank import train_rank
        return train_rank(cfg)
    with loading():
        import torch.distributed.launcher.api  # noqa: F401  (launch() imports the launcher: torch, loaded here)

        from trainer.distributed.launch import launch
        from trainer.engine.compile_warmup import startup_bounds
    return launch(argv, cfg, startup_bounds(cfg))


def record_bad_input(status_file: str, error: str) -> None:
    """A start refused as bad input says why in status.json too, as a rank's refusal does, so the operator's
    view (dflash-status, the role's health check) names it instead of showing the previous run's phase.
    Only into an output dir that exists (a job's): a mistyped path creates nothing; silent on failure."""
    from trainer.status import record_failure
    record_failure(status_file, error, only_into_existing_dir=True)


if __name__ == "__main__":
    from trainer.optional import end, program
    program()   # a process of its own (by hand, run.sh, the launcher's ranks): trainer/optional.py
    end(main())   # no interpreter teardown (trainer/optional.py)
