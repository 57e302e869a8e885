"""Atomic checkpoints: ``<output-dir>/step-<8 digits>/``.

A checkpoint is written into ``<output-dir>/.tmp-step-<8 digits>-<pid>/``, every file and the
directory are fsynced, then the directory is renamed; so a directory named ``step-*`` is complete
by construction. Files (docs/contracts.md "Checkpoints"):

* ``model.safetensors``  the consolidated drafter weights (dtype as trained)
* ``config.json``        drafter config an inference engine can read
* ``dcp/``               torch.distributed.checkpoint: every drafter rank's shard of the model and the
                         AdamW state (resumable onto another number of drafter ranks)
* ``training_state.pt``  step, data position, tokens seen, NaN skips, warmup length, micro-batches per
                         step, drafter rank count, every drafter rank's RNG state, run config, run id
                         (the learning-rate schedule is a function of the step: no state of its own)
* ``meta.json``          step, epoch, reason, created_at, trainer version (+ file sizes), ``target``:
                         the target's identity (trainer/identity.py)

Keep-K pruning happens only after a successful save. A failed save (e.g. a full disk) removes its
temp dir, leaves earlier checkpoints untouched and raises :class:`CheckpointError`.

The job's side (:class:`Checkpointer`): rank 0 finds, begins and publishes a checkpoint, the drafter
ranks write and load their shards of model and optimizer with DCP together; each decision of rank 0
reaches every rank through :func:`leader_decides`, so all raise or none does.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

import torch
import safetensors.torch

from .fsutil import fsync_dir, fsync_path
from .status import pid_alive
from .identity import RECORD_KEY, for_checkpoint as identity_for_checkpoint

log = logging.getLogger(__name__)

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


# ------------------------------------------------------------------------------- RNG


def capture_rng_state() -> dict[str, Any]:
    """RNG states of python `random`, numpy (if importable), torch CPU and every CUDA device."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        try:
            state["cuda"] = torch.cuda.get_rng_state_all()
        except Exception as e:  # noqa: BLE001 - e.g. driver trouble; CPU state still useful
            log.warning("could not capture CUDA RNG state: %s", e)
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state` (missing parts are left as they are)."""
    if not state:
        return
    if "python" in state:
        py = state["python"]
        # a round trip through some serializers turns the inner tuple into a list
        if isinstance(py, list):
            py = (py[0], tuple(py[1]), py[2])
        random.setstate(py)
    if "numpy" in state:
        try:
            import numpy as np
            np.random.set_state(state["numpy"])
        except ImportError:  # pragma: no cover
            log.warning("checkpoint has a numpy RNG state but numpy is not installed")
    if "torch" in state:
        torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8).cpu())
    cuda = state.get("cuda")
    if cuda:
        if not torch.cuda.is_available():
            log.warning("checkpoint has CUDA RNG states but CUDA is not available; skipped")
            return
        n = torch.cuda.device_count()
        if n != len(cuda):
            log.warning("checkpoint has %d CUDA RNG states, this machine %d devices; "
                        "restoring the first %d", len(cuda), n, min(n, len(cuda)))
        for i, s in enumerate(list(cuda)[:n]):
            torch.cuda.set_rng_state(torch.as_tensor(s, dtype=torch.uint8).cpu(), i)


# ------------------------------------------------------------------------------- load


def load(path: str | os.PathLike, map_location: Any = "cpu"
         ) -> tuple[dict[str, torch.Tensor], dict, dict, dict]:
    """Read a checkpoint dir: (model_state, model_config, train_state, meta)."""
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
        if RECORD_KEY not in m:   # the target this drafter was trained on (trainer/identity.py)
            m[RECORD_KEY] = identity_for_checkpoint(dict(model_config), dict(train_state))
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


# ------------------------------------------------------------------------------ the job's protocol

def leader_decides(leader: bool, group, decide, error: type[Exception] = CheckpointError) -> Any:
    """Rank 0 decides, every rank of `group` learns the answer: the leader runs `decide()`, its result
    (or the text of the `error` it raised) is broadcast, and an error is raised on every rank alike, so
    no rank goes on to a collective the others have left."""
    import torch.distributed as dist
    box: list = [None]
    if leader:
        try:
            box[0] = {"value": decide()}
        except error as e:
            box[0] = {"error": str(e)}
    dist.broadcast_object_list(box, src=0, group=group)
    if "error" in box[0]:
        raise error(box[0]["error"])
    return box[0]["value"]


def consolidated_state(model: torch.nn.Module, device: torch.device, leader: bool) -> dict[str, torch.Tensor]:
    """The whole fp32 drafter, on the leader's CPU (empty elsewhere): every drafter rank together
    (FSDP all-gathers each parameter). What model.safetensors holds and what the tau eval loads."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    full = {}
    for n, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        if leader:
            full[n] = t.detach().float().cpu()
        del t
    return full


class Checkpointer:
    """A rank's side of the job's checkpoints. Rank 0 finds, writes and publishes them (CheckpointManager);
    drafter ranks write and load their shards of model and optimizer with DCP, together."""

    def __init__(self, output_dir: Path, keep: int, topo, groups):
        self.out = Path(output_dir)
        self.topo, self.groups = topo, groups
        self.manager = CheckpointManager(self.out, keep)
        self.last: str | None = None           # the newest checkpoint of this run (saved or resumed from)
        self.resumed_from: str | None = None

    def resume(self, allowed: bool, model, opt, batches_per_step: int) -> dict | None:
        """Rank 0 finds the newest checkpoint and tells every rank where the run stands; drafter ranks
        (model given) load the sharded model and optimizer state with DCP (any number of drafter ranks).
        Returns the training state to continue from (None: a fresh start)."""
        from .errors import TrainingFailed

        def find():
            latest = self.manager.latest()
            if latest is not None and not allowed:
                raise TrainingFailed(f"--no-resume: {self.out} holds {latest.name}; refusing to overwrite")
            if latest is None:
                return None
            tstate = torch.load(latest / STATE_FILE, map_location="cpu", weights_only=False)
            return {"path": str(latest), "step": int(tstate["step"]), "tokens_seen": tstate.get("tokens_seen", 0),
                    "nan_skips": tstate.get("nan_skips", 0), "warmup_steps": tstate.get("warmup_steps"),
                    "rng": tstate.get("rng_by_rank") or [tstate.get("rng")],
                    "batches_per_step": tstate.get("batches_per_step"), "seq_next": tstate.get("seq_next")}
        r = leader_decides(self.topo.leader, self.groups.control, find, TrainingFailed)
        if r is None:
            return None
        path = Path(r["path"])
        if r["seq_next"] is not None and r["seq_next"] != r["step"] * batches_per_step:
            log.warning("resuming from %s with %d micro-batches per step (it was trained with %d): the data "
                        "position is step x the new size, so some batches are skipped or repeated",
                        path, batches_per_step, r.get("batches_per_step"))
        if model is not None:
            self._load_drafter_state(path, model, opt)
            rngs = r["rng"] or []
            mine = self.topo.drafter_index
            if mine < len(rngs) and rngs[mine] is not None:
                restore_rng_state(rngs[mine])
        self.resumed_from = self.last = str(path)
        return r

    def _load_drafter_state(self, path: Path, model, opt):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                             set_state_dict)
        if (path / "dcp").is_dir():
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=str(path / "dcp"), process_group=self.groups.dctl)
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        else:   # a checkpoint of the single-process trainer: weights only, fresh optimizer moments
            full = safetensors.torch.load_file(str(path / MODEL_FILE))
            set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
            log.warning("%s has no sharded optimizer state (dcp/): weights resumed, AdamW moments start fresh", path)

    def save(self, step: int, reason: str, model, opt, device: torch.device, model_config: Mapping,
             train_state: dict, meta: dict) -> str:
        """Drafter ranks, together: DCP writes every rank's shard of model and optimizer into the temp dir;
        rank 0 adds the consolidated fp32 model.safetensors, config.json, training_state.pt (train_state
        plus every drafter rank's RNG state) and meta.json and publishes the directory atomically."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from .errors import root_cause
        topo, g = self.topo, self.groups.dctl
        t0 = time.perf_counter()
        full = consolidated_state(model, device, topo.leader)
        rngs = [None] * len(topo.drafter_ranks) if topo.leader else None
        dist.gather_object(capture_rng_state(), rngs, dst=0, group=g)
        tmp = Path(leader_decides(topo.leader, g, lambda: str(self.manager.begin(step))))
        try:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp / "dcp"), process_group=g)
        except (Exception, dcp.api.CheckpointException) as e:  # DCP raises on every rank when one fails
            if topo.leader:
                self.manager.abort(tmp)
            why = root_cause(e)
            free = shutil.disk_usage(self.out).free
            if "Errno" not in why and free < 2 * sum(t.numel() * 4 for t in full.values()) + (1 << 20):
                # torch.save's zip writer reports a full disk as "unexpected pos ...": say what it is
                why = f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)} ({free} bytes free; {why})"
            raise CheckpointError(f"checkpoint step {step} not saved to {self.out / step_dir_name(step)}: "
                                  f"{why} (earlier checkpoints left intact)") from e
        commit = lambda: str(self.manager.commit(tmp, step, full, model_config,  # noqa: E731
                                                 dict(train_state, rng_by_rank=rngs), meta=meta))
        self.last = leader_decides(topo.leader, g, commit)
        log.info("checkpoint %s (%s) in %.1fs", self.last, reason, time.perf_counter() - t0)
        return self.last

