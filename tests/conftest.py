"""Shared pytest fixtures.

Data / dflash-tiny fixtures (owned by the data tests): ``tiny_small_dir`` builds one small
dflash-tiny output per test session (target model + tokenizer, 48 train / 8 held-out sequences).
"""

import pytest


@pytest.fixture(scope="session")
def tiny_small_dir(tmp_path_factory):
    """A small dflash-tiny OUTDIR (target/, data/, heldout/), built once per session."""
    from trainer.tiny import make_tiny

    out = tmp_path_factory.mktemp("dflash-tiny") / "out"
    make_tiny(out, seed=0, num_train=48, num_heldout=8, log=lambda *a, **k: None)
    return out


def run_molecule(scenario: str) -> None:
    """`molecule test -s <scenario>` from the repo root with this venv's tools first on PATH;
    skipped where the stand-in cannot exist (not root, no lxc/debootstrap, no molecule)."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    if os.geteuid() != 0 or shutil.which("lxc-start") is None or shutil.which("debootstrap") is None:
        pytest.skip("needs root, lxc and debootstrap (tests/setup-host.sh)")
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "molecule").exists():
        pytest.skip("molecule not installed")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ.get('PATH', '')}")
    r = subprocess.run([str(bin_dir / "molecule"), "test", "-s", scenario], cwd=Path(__file__).resolve().parents[1],
                       env=env, capture_output=True, text=True)
    if r.returncode != 0:
        # the failing task's own message sits before long command output (debootstrap, pip), so show
        # every line that names a failure, then the tails of both streams
        lines = (r.stdout + "\n" + r.stderr).splitlines()
        marks = [ln for ln in lines if any(k in ln for k in ("fatal:", "FAILED!", "\"msg\"", "msg:", "ERROR", "rc:"))]
        pytest.fail(f"molecule test -s {scenario} exited {r.returncode}\n--- lines naming the failure ---\n"
                    + "\n".join(marks[-60:]) + "\n--- stdout tail ---\n" + r.stdout[-4000:]
                    + "\n--- stderr tail ---\n" + r.stderr[-3000:])
