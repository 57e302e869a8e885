"""The environment for Ansible runs whose module runs share the code compiled from module_utils
(tests/standin/zipcode, its sitecustomize): the directory first on PYTHONPATH, and DFLASH_ZIPCODE_CACHE
naming the cache. Used on the controller by lane P's tests and by the fault suite's runner; the stand-in
containers get the same two settings from the node's sshd (standin.sh), the molecule scenarios from
molecule.yml."""

from __future__ import annotations

import os
from pathlib import Path

ZIPCODE = Path(__file__).resolve().parent / "zipcode"


def zipcode_env(env: dict, cache: Path) -> dict:
    """`env` with the module runs of the Ansible runs it starts sharing the code compiled in `cache`
    (made, 0700, if missing); a PYTHONPATH already in `env` stays, after the zipcode directory."""
    cache.mkdir(mode=0o700, exist_ok=True)
    path = [str(ZIPCODE)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    return {**env, "PYTHONPATH": os.pathsep.join(path), "DFLASH_ZIPCODE_CACHE": str(cache)}
