"""Durable file writes, in one place: status.json, the data index, checkpoints and metrics use them.

Standard library only. A reader never sees a partial file: the bytes go to a temp file in the same
directory, are fsynced, renamed over the target, and the directory is fsynced so the rename
survives a power cut.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file that is already written and closed."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str | os.PathLike) -> None:
    """fsync a directory (its entries: renames, new files). Filesystems that refuse fsync on a
    directory are tolerated; the rename itself is atomic either way."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``text`` atomically (temp file, fsync, rename, directory fsync)."""
    path = Path(path)
    directory = path.absolute().parent
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(directory)
