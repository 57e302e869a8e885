"""One rank's life around the loop (trainer/engine/train.py): started by the launcher (or in-process at world
size 1), the stop signals it answers, the exit code and status each kind of failure maps to, and the
teardown (destroy the groups after a clean run, abort them after a failure)."""

from __future__ import annotations

import logging
import os
import signal
import sys

from trainer.config.options import TrainConfig
from trainer.distributed.groups import abort_groups, init_rank
from trainer.distributed.heartbeat import annotate
from trainer.engine.runlog import setup_console
from trainer.engine.train import Trainer
from trainer.errors import BadInput, TrainingFailed, die_with_supervisor, is_checkpoint_error, record
from trainer.model.checkpoint_format import CheckpointError

log = logging.getLogger("trainer")


def install_startup_handlers() -> None:
    """First thing in a rank, before init: SIGUSR1 writes every thread's stack into this rank's stderr (the
    journal) and the rank runs on (the supervisor sends it before it ends a stalled start-up, the first-run
    script before it stops a job); SIGTERM writes them too, then ends the rank as it would have ended
    (faulthandler chains to the default action). Both act at C level: a rank stuck in a C++ wait (a
    rendezvous, a communicator split, a first connect) never runs a Python handler. install_signal_handlers
    replaces the SIGTERM one once there is a trainer to stop after an agreed step."""
    import faulthandler
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)


def install_signal_handlers(trainer: Trainer):
    import faulthandler
    faulthandler.unregister(signal.SIGTERM)

    def handler(signum, frame):
        log.info("received %s: the job stops after an agreed step, with a checkpoint", signal.Signals(signum).name)
        trainer.stop_requested.set()
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def train_rank(cfg: TrainConfig, target_factory=None, dataset=None, on_done=None) -> int:
    """Entry point of one rank (started by the launcher, or in-process at world size 1). on_done(trainer)
    runs on every rank after a successful run, before shutdown (the benchmark reads its figures there)."""
    import torch.distributed as dist
    install_startup_handlers()
    die_with_supervisor()
    # the console before init_rank: its lines (the P2P mode, the heartbeat's bound) reach the journal;
    # Trainer.setup's setup_logging replaces it and adds the run's file
    setup_console()
    try:
        topo, groups = init_rank(cfg)
    except ValueError as e:
        record(e)
        if not os.environ.get("DFLASH_SUPERVISED"):
            print(f"dflash-train: error: {e}", file=sys.stderr, flush=True)
        return 2
    trainer = Trainer(cfg, topo, groups, target_factory, dataset)
    install_signal_handlers(trainer)
    status = trainer.report.status
    rc = 1
    try:
        trainer.setup()
        rc = trainer.run()
        if on_done is not None and rc == 0:
            on_done(trainer)
        return rc
    except BadInput as e:
        record(e)
        log.error("bad input: %s", e, extra={"console": False})
        status.update(phase="failed", error=str(e), step=trainer.loop.step, force=True)
        if not os.environ.get("DFLASH_SUPERVISED"):
            print(f"dflash-train: error: {e}", file=sys.stderr, flush=True)
        rc = 2
        return rc
    except (TrainingFailed, CheckpointError) as e:
        record(e)
        log.error("training failed: rank %d: %s", topo.rank, e)
        status.update(phase="failed", error=f"rank {topo.rank}: {e}", step=trainer.loop.step,
                      nan_skips=trainer.report.nan_skips, nan_streak=trainer.report.nan_streak, force=True)
        return 1
    except BaseException as e:   # any Exception, and DCP's CheckpointException (a BaseException)
        if not isinstance(e, Exception) and not is_checkpoint_error(e):
            raise
        # several nodes: a timeout names no peer, the heartbeat knows which went quiet
        quiet = groups.heartbeat.quiet() if groups.heartbeat is not None else None
        e = annotate(e, quiet)
        record(e)
        log.exception("training failed on rank %d%s", topo.rank, f" (heartbeat: {quiet})" if quiet else "")
        status.update(phase="failed", error=f"rank {topo.rank}: {type(e).__name__}: {e}", force=True)
        return 1
    finally:
        trainer.shutdown()
        if rc == 0:
            try:
                trainer.vote.drain()
                dist.barrier(group=groups.control)
            except Exception:  # noqa: BLE001
                pass
            dist.destroy_process_group()
        else:
            abort_groups()   # not destroy: NCCL's would wait for the ops a dead peer never completes

