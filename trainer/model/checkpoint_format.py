"""A checkpoint on disk: ``<output-dir>/step-<8 digits>/``, its files, its atomic commit, keep-K
retention, stale temp dirs, and the load of a step dir. What goes into the files is the callers':
the job's protocol (trainer/engine/checkpoint.py) and the train state (trainer/engine/train_state.py).

A checkpoint is written into ``<output-dir>/.tmp-step-<8 digits>-<pid>/``, every file and the
directory are fsynced, then the directory is renamed; so a directory named ``step-*`` is complete
by construction. Files (docs/contracts.md "Checkpoints"):

* ``model.safetensors``  the consolidated drafter weights (the trainer's are fp32: checkpoint.consolidated_state;
                         this module writes the dtypes it is handed)
* ``config.json``        drafter config an inference engine can read
* ``dcp/``               torch.distributed.checkpoint: every drafter rank's shard of the model and the
                         AdamW state (resumable onto another number of drafter ranks); written by the
                         drafter ranks into the temp dir between :meth:`CheckpointManager.begin` and
                         :meth:`CheckpointManager.commit` (train_state.DrafterState is its layout)
* ``training_state.pt``  the train state's flat dict (train_state.TrainState.state_dict: step, data
                         position, tokens seen, NaN skips, warmup length, micro-batches per step, drafter
                         rank count, run config, run id, every drafter rank's RNG state)
* ``meta.json``          the manifest: step, epoch, reason, created_at, trainer version, ``files`` (the
                         sizes a complete checkpoint has), ``target``: the target's identity
                         (trainer/model/identity.py), ``resume_keeps``: the run config's block size, arch
                         and loss (what a resume must keep, read without unpickling the train state)

Keep-K pruning happens only after a successful save. A failed save (e.g. a full disk) removes its
temp dir, leaves earlier checkpoints untouched and raises :class:`CheckpointError`.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from trainer.fsutil import fsync_dir, fsync_path
from trainer.model.architectures import for_config
from trainer.model.identity import RECORD_KEY
from trainer.model.identity import for_checkpoint as identity_for_checkpoint
from trainer.procs import pid_alive

# torch and safetensors load where tensors are read or written: a --check-config reads only names and
# meta.json, and starts no torch (about 1.4 CPU-s a check).
if TYPE_CHECKING:
    import torch

# the name the journal has always shown for these lines (docs/reliability.md quotes one)
log = logging.getLogger("trainer.checkpoint")

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
STATE_FILE = "training_state.pt"
META_FILE = "meta.json"
REQUIRED_FILES = (MODEL_FILE, CONFIG_FILE, STATE_FILE, META_FILE)

STEP_DIR_RE = re.compile(r"^step-(\d{8,})$")
TMP_DIR_RE = re.compile(r"^\.tmp-step-(\d{8,})-(\d+)(?:-(old|del))?$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the path and the cause."""


def step_dir_name(step: int) -> str:
    return f"step-{int(step):08d}"


def _trainer_version() -> str:
    try:
        from trainer import __version__
        return str(__version__)
    except Exception:  # noqa: BLE001
        return "unknown"


# ------------------------------------------------------------------------------- fs helpers


def _fsync_tree(path: Path) -> None:
    """fsync every file below `path` (other writers' files included) and every directory."""
    for d, _, files in os.walk(path):
        for fn in files:
            fsync_path(Path(d) / fn)
        fsync_dir(Path(d))


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_renameat2 = None


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE). False when unsupported."""
    global _renameat2
    if _renameat2 is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                           ctypes.c_uint]
            fn.restype = ctypes.c_int
            _renameat2 = fn
        except (OSError, AttributeError):
            _renameat2 = False
    if not _renameat2:
        return False
    rc = _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _describe(exc: BaseException) -> str:
    """The most useful reason text: the OS error anywhere in the chain (e.g. ENOSPC from a
    write callback surfaced by torch as a RuntimeError), else the exception itself."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and (e.strerror or e.errno):
            reason = e.strerror or os.strerror(e.errno)
            if e.filename:
                reason += f" ({e.filename})"
            return reason
        e = e.__cause__ or e.__context__
    text = str(exc) or type(exc).__name__
    # safetensors reports IO errors as text, e.g. "... No space left on device (os error 28)"
    return text


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------- tensors


def _cpu_tensors(model_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors; shared storage (tied weights) cloned apart, since
    safetensors refuses tensors that share memory."""
    import torch
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, t in model_state.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"model_state[{name!r}] is {type(t).__name__}, not a tensor")
        t = t.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if t.numel() and key in seen:
            t = t.clone()
        elif t.numel():
            seen.add(key)
        out[str(name)] = t
    return out


# ------------------------------------------------------------------------------- load


def load(path: str | os.PathLike, map_location: Any = "cpu"
         ) -> tuple[dict[str, torch.Tensor], dict, dict, dict]:
    """Read a checkpoint dir: (model_state, model_config, train_state, meta)."""
    import safetensors.torch
    import torch
    path = Path(path)
    try:
        missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
        if missing:
            raise CheckpointError(f"checkpoint {path} is incomplete: missing {', '.join(missing)}")
        device = str(map_location) if map_location is not None else "cpu"
        if isinstance(map_location, (str, torch.device)):
            model_state = safetensors.torch.load_file(str(path / MODEL_FILE), device=device)
        else:  # a callable/dict map_location: load on CPU for the weights
            model_state = safetensors.torch.load_file(str(path / MODEL_FILE), device="cpu")
        with open(path / CONFIG_FILE, encoding="utf-8") as f:
            model_config = json.load(f)
        with open(path / META_FILE, encoding="utf-8") as f:
            meta = json.load(f)
        # our own file: contains numpy/python RNG states, so not weights_only
        train_state = torch.load(path / STATE_FILE, map_location=map_location,
                                 weights_only=False)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"cannot load checkpoint {path}: {_describe(e)}") from e
    return model_state, model_config, train_state, meta


def load_train_state(path: str | os.PathLike, map_location: Any = "cpu") -> dict:
    """The ``training_state.pt`` of a step dir alone (what a resume reads before the sharded state):
    the train state's flat dict (train_state.TrainState.load_state_dict takes it). Errors are torch's."""
    import torch
    # our own file: contains numpy/python RNG states, so not weights_only
    return torch.load(Path(path) / STATE_FILE, map_location=map_location, weights_only=False)


# ------------------------------------------------------------------------------- the resume contract

# what a resumed run must keep: the flag, and the TrainConfig field the checkpoint's run config records
# (train_state.RunInfo); a changed block size, architecture or loss trains another drafter than the
# checkpoint's, silently
RESUME_KEEPS = (("--block-size", "block_size"), ("--arch", "arch"), ("--loss", "loss"))
# meta.json's copy of those fields of the run config (the training state's "config" holds them all)
RESUME_META_KEY = "resume_keeps"


class ResumeChanged(ValueError):
    """A resume that changes what the checkpoint's drafter was trained as; one line naming the flag."""


def check_resume_keeps(cfg, checkpoint_dir: str | os.PathLike) -> None:
    """The run config a checkpoint recorded (training_state.pt's "config"; config.json's block size and
    architecture for a checkpoint without it) against this run's `cfg` (a TrainConfig): ResumeChanged
    naming the first flag that differs, this run's value and the checkpoint's. A value the checkpoint does
    not record (an older one: no --loss) is not compared. Reads only."""
    d = Path(checkpoint_dir)
    try:   # meta.json's copy (written since 2026-12): read without unpickling, so a --check-config starts no torch
        saved = dict(json.loads((d / META_FILE).read_text(encoding="utf-8"))[RESUME_META_KEY])
    except (OSError, ValueError, KeyError, TypeError):
        try:
            saved = dict(load_train_state(d).get("config") or {})
        except Exception:  # noqa: BLE001 - an unreadable state file is the resume's own error to report
            saved = {}
    try:
        drafter = json.loads((d / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        drafter = {}
    if saved.get("block_size") is None:
        saved["block_size"] = drafter.get("block_size")
    if saved.get("arch") is None and drafter.get("architectures"):
        saved["arch"] = for_config(drafter).name
    for flag, name in RESUME_KEEPS:
        theirs, ours = saved.get(name), getattr(cfg, name)
        if theirs is not None and theirs != ours:
            raise ResumeChanged(f"{flag}: this run's {ours}, the checkpoint's {theirs} (resuming {d}; give "
                                f"{flag} {theirs}, or another --output-dir to train a new drafter)")


# ------------------------------------------------------------------------------- manager


class CheckpointManager:
    """Saves, lists, loads and prunes checkpoints under ``output_dir``.

    ``keep``: number of newest checkpoints to keep after each successful save (<= 0: keep all).
    """

    def __init__(self, output_dir: str | os.PathLike, keep: int = 0):
        self.output_dir = Path(output_dir)
        self.keep = int(keep)
        self.before_publish = None  # callable(tmp_dir) run after the files are written, before the rename
        self._warned: set[str] = set()

    # -------------------------------------------------------------- save

    def save(self, step: int, model_state: Mapping[str, torch.Tensor], model_config: Mapping,
             train_state: Mapping, meta: Mapping | None = None) -> Path:
        """Write and publish a checkpoint in one call (single writer)."""
        return self.commit(self.begin(step), step, model_state, model_config, train_state, meta)

    def tmp_dir(self, step: int) -> Path:
        return self.output_dir / f".tmp-{step_dir_name(step)}-{os.getpid()}"

    def begin(self, step: int) -> Path:
        """Create the (empty) temp dir of a checkpoint; other writers (the drafter ranks' sharded state,
        torch.distributed.checkpoint) may fill it before `commit`."""
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        tmp = self.tmp_dir(step)
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                _rmtree(tmp)
            tmp.mkdir()
        except OSError as e:
            _rmtree(tmp)
            raise CheckpointError(f"checkpoint step {step} not saved to {self.output_dir / step_dir_name(step)}: "
                                  f"{_describe(e)} (earlier checkpoints left intact)") from e
        return tmp

    def abort(self, tmp: Path) -> None:
        _rmtree(tmp)

    def commit(self, tmp: Path, step: int, model_state: Mapping[str, torch.Tensor], model_config: Mapping,
               train_state: Mapping, meta: Mapping | None = None) -> Path:
        """Add the model, config, training state and meta files to `tmp`, fsync, rename it to
        step-XXXXXXXX atomically, then prune. On failure the temp dir goes and earlier checkpoints stay."""
        step = int(step)
        name = step_dir_name(step)
        final = self.output_dir / name
        t0 = time.monotonic()
        try:
            self._write_files(tmp, step, model_state, model_config, train_state, meta)
            _fsync_tree(tmp)
            if self.before_publish is not None:  # test hook: the fault suite kills the trainer here
                self.before_publish(tmp)
            self._publish(tmp, final, step)
            fsync_dir(self.output_dir)
        except BaseException as e:
            _rmtree(tmp)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise CheckpointError(
                f"checkpoint step {step} not saved to {final}: {_describe(e)}"
                f" (earlier checkpoints left intact)") from e
        log.info("checkpoint saved: %s (%.1f s)", final, time.monotonic() - t0)
        try:
            self.prune(protect=final)
        except OSError as e:  # pruning trouble must not lose the new checkpoint
            log.warning("could not prune old checkpoints in %s: %s", self.output_dir, e)
        return final

    def _write_files(self, tmp: Path, step: int, model_state, model_config, train_state,
                     meta) -> None:
        import safetensors.torch
        import torch
        tensors = _cpu_tensors(model_state)
        safetensors.torch.save_file(tensors, str(tmp / MODEL_FILE), metadata={"format": "pt"})
        fsync_path(tmp / MODEL_FILE)
        _write_json(tmp / CONFIG_FILE, dict(model_config))
        with open(tmp / STATE_FILE, "wb") as f:
            torch.save(dict(train_state), f)
            f.flush()
            os.fsync(f.fileno())
        m: dict[str, Any] = {"epoch": None}
        m.update(dict(meta or {}))
        if RECORD_KEY not in m:   # the target this drafter was trained on (trainer/model/identity.py)
            m[RECORD_KEY] = identity_for_checkpoint(dict(model_config), dict(train_state))
        run = train_state.get("config")
        if isinstance(run, Mapping):
            m.setdefault(RESUME_META_KEY, {name: run.get(name) for _, name in RESUME_KEEPS})
        m.update(step=step, created_at=time.time(), trainer_version=_trainer_version(),
                 files={fn: (tmp / fn).stat().st_size
                        for fn in (MODEL_FILE, CONFIG_FILE, STATE_FILE)})
        _write_json(tmp / META_FILE, m)

    def _publish(self, tmp: Path, final: Path, step: int) -> None:
        """Rename the finished temp dir to its final name. If that name exists (a re-save of
        the same step), swap the two so a complete checkpoint is always at ``final``."""
        try:
            os.rename(tmp, final)
            return
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not final.is_dir():
                raise
        # atomic exchange: tmp now holds the old checkpoint, deleted afterwards
        if _exchange(tmp, final):
            fsync_dir(self.output_dir)
            _rmtree(tmp)
            return
        # fallback: move the old one aside (still a complete copy, recovered by
        # cleanup_stale_tmp if we die between the two renames), then rename the new one in
        aside = self.output_dir / f".tmp-{step_dir_name(step)}-{os.getpid()}-old"
        if aside.exists():
            _rmtree(aside)
        os.rename(final, aside)
        try:
            os.rename(tmp, final)
        except BaseException:
            os.rename(aside, final)
            raise
        fsync_dir(self.output_dir)
        _rmtree(aside)

    # -------------------------------------------------------------- list / latest

    def _warn_once(self, path: Path, why: str) -> None:
        key = f"{path}:{why}"
        if key not in self._warned:
            self._warned.add(key)
            log.warning("ignoring checkpoint dir %s: %s", path, why)

    def _validate(self, path: Path, step: int) -> bool:
        missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
        if missing:
            self._warn_once(path, f"missing {', '.join(missing)}")
            return False
        try:
            with open(path / META_FILE, encoding="utf-8") as f:
                meta = json.load(f)
            if not isinstance(meta, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            self._warn_once(path, f"unreadable {META_FILE}: {e}")
            return False
        if meta.get("step") is not None and int(meta["step"]) != step:
            self._warn_once(path, f"{META_FILE} says step {meta['step']}")
            return False
        files = meta.get("files")
        if isinstance(files, dict):
            for fn, size in files.items():
                try:
                    actual = (path / fn).stat().st_size
                except OSError:
                    actual = None
                if actual != size:
                    self._warn_once(path, f"{fn} is {actual} bytes, {META_FILE} says {size}")
                    return False
        return True

    def list(self) -> list[Path]:
        """Complete checkpoints, oldest step first."""
        if not self.output_dir.is_dir():
            return []
        found: list[tuple[int, Path]] = []
        for p in self.output_dir.iterdir():
            m = STEP_DIR_RE.match(p.name)
            if not m or not p.is_dir():
                continue
            step = int(m.group(1))
            if self._validate(p, step):
                found.append((step, p))
        found.sort()
        return [p for _, p in found]

    def latest(self) -> Path | None:
        """The newest complete checkpoint (highest step), or None."""
        ckpts = self.list()
        return ckpts[-1] if ckpts else None

    @staticmethod
    def step_of(path: str | os.PathLike) -> int:
        m = STEP_DIR_RE.match(Path(path).name)
        if not m:
            raise ValueError(f"{path} is not a step-XXXXXXXX checkpoint dir")
        return int(m.group(1))

    load = staticmethod(load)

    # -------------------------------------------------------------- prune / cleanup

    def prune(self, protect: Path | None = None) -> list[Path]:
        """Remove all but the newest ``keep`` complete checkpoints (never ``protect``)."""
        if self.keep <= 0:
            return []
        ckpts = self.list()
        doomed = [p for p in ckpts[:-self.keep] if protect is None or p != protect]
        removed = []
        for p in doomed:
            # rename first so a half-deleted dir never carries a step-* name
            trash = self.output_dir / f".tmp-{p.name}-{os.getpid()}-del"
            if trash.exists():
                _rmtree(trash)
            os.rename(p, trash)
            _rmtree(trash)
            removed.append(p)
            log.info("pruned old checkpoint %s (keep %d)", p, self.keep)
        if removed:
            fsync_dir(self.output_dir)
        return removed

    def cleanup_stale_tmp(self) -> list[Path]:
        """Remove ``.tmp-step-*`` leftovers of dead processes (and of this pid: at startup any
        such dir is a leftover of an earlier process that had the same pid). A complete old
        checkpoint moved aside during a re-save whose final dir vanished is renamed back."""
        if not self.output_dir.is_dir():
            return []
        removed = []
        me = os.getpid()
        for p in sorted(self.output_dir.iterdir()):
            m = TMP_DIR_RE.match(p.name)
            if not m or not p.is_dir():
                continue
            pid = int(m.group(2))
            if pid != me and pid_alive(pid):
                continue
            step = int(m.group(1))
            final = self.output_dir / step_dir_name(step)
            if m.group(3) == "old" and not final.exists() and self._validate(p, step):
                os.rename(p, final)
                log.warning("restored checkpoint %s from interrupted re-save %s", final, p.name)
                continue
            _rmtree(p)
            removed.append(p)
            log.info("removed stale checkpoint temp dir %s", p)
        if removed:
            fsync_dir(self.output_dir)
        return removed
