"""Where the per-step training metrics go besides metrics.jsonl: W&B and TensorBoard event files.

Many GPU hosts cannot reach W&B; TensorBoard files are plain files in ``--tensorboard-dir`` that an
operator copies or tunnels to (README "Plots"). Both are sinks with one interface, ``write(step,
scalars)`` and ``close()``: the training loop hands one dict of scalars per optimizer step; nested
dicts and lists become tag paths (``acc/pos_01``) by :func:`flatten_scalars`, the same tags in both,
None and non-numbers are skipped. A TensorBoard sink never fails the run: after the first write
error it logs a warning and goes quiet, like the status file.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from typing import Any, Iterator, Mapping

log = logging.getLogger("trainer.metrics_sinks")   # the name it has always logged under


def flatten_scalars(scalars: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """(tag, value) for every finite-or-not number in ``scalars``; mappings nest with '/', lists and
    tuples become ``<key>/pos_<i>`` (1-based: the per-position accuracy starts at block slot 1)."""
    for key, value in scalars.items():
        tag = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from flatten_scalars(value, tag + "/")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value, start=1):
                if isinstance(v, numbers.Real) and not isinstance(v, bool):
                    yield f"{tag}/pos_{i:02d}", float(v)
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            yield tag, float(value)
        elif hasattr(value, "item") and callable(value.item):  # tensor / numpy scalars
            try:
                v = value.item()
            except (ValueError, RuntimeError):
                continue
            if isinstance(v, numbers.Real) and not isinstance(v, bool):
                yield tag, float(v)


class TensorBoardSink:
    """``torch.utils.tensorboard.SummaryWriter`` into ``log_dir/<run_id>`` (one subdirectory per run,
    so TensorBoard shows a resumed job's runs side by side and the step axis continues)."""

    def __init__(self, log_dir: str | os.PathLike, run_id: str = "", *, flush_secs: float = 30.0):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.path = os.path.join(os.fspath(log_dir), run_id) if run_id else os.fspath(log_dir)
        self._writer = SummaryWriter(log_dir=self.path, flush_secs=int(max(1, flush_secs)))
        self._failed = False

    def write(self, step: int, scalars: Mapping[str, Any]) -> None:
        """One optimizer step's metrics, e.g. {"loss": 2.1, "lr": 6e-4, "grad_norm": 0.8,
        "tokens_per_s": 4.2e4, "acc": [0.9, 0.7, ...], "stage_s": {"target": 0.3, "drafter": 0.5}}."""
        if self._failed:
            return
        try:
            for tag, value in flatten_scalars(scalars):
                if math.isfinite(value):  # TensorBoard plots NaN as a gap anyway; keep the files clean
                    self._writer.add_scalar(tag, value, global_step=int(step))
        except Exception as e:  # noqa: BLE001 - plots must never stop training
            self._failed = True
            log.warning("TensorBoard writes to %s stopped: %s", self.path, e)

    def flush(self) -> None:
        try:
            self._writer.flush()
        except Exception as e:  # noqa: BLE001
            log.warning("TensorBoard flush to %s failed: %s", self.path, e)

    def close(self) -> None:
        try:
            self._writer.close()
        except Exception as e:  # noqa: BLE001
            log.warning("TensorBoard close of %s failed: %s", self.path, e)

    def __enter__(self) -> "TensorBoardSink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_tensorboard(log_dir: str, run_id: str = "") -> TensorBoardSink | None:
    """The sink for ``--tensorboard-dir`` (None when it is empty). preflight.validate has already
    checked that tensorboard is installed and the directory can be created."""
    if not log_dir:
        return None
    sink = TensorBoardSink(log_dir, run_id)
    log.info("TensorBoard events in %s", sink.path)
    return sink


class WandbSink:
    """A W&B run, with the tags TensorBoard gets (flatten_scalars)."""

    def __init__(self, run):
        self.run = run

    def write(self, step: int, scalars: Mapping[str, Any]) -> None:
        self.run.log(dict(flatten_scalars(scalars)), step=int(step))

    def close(self) -> None:
        self.run.finish()


def open_wandb(mode: str, project: str, config: dict, run_id: str, out_dir: str) -> WandbSink | None:
    """The sink for ``--wandb-mode`` (None when disabled)."""
    if mode == "disabled":
        return None
    try:
        import wandb
    except ImportError:
        from trainer.errors import TrainingFailed
        raise TrainingFailed(f"--wandb-mode {mode}: the wandb package is not installed")
    return WandbSink(wandb.init(project=project, mode=mode, config=config, id=run_id, dir=out_dir))
