"""tests/standin/build-rootfs.sh with a stand-in `debootstrap` on PATH (no network, seconds): a first
build must exit 0 and print the path (a false cleanup test in its EXIT trap once made the first, uncached
build exit 1, which failed every clean CI machine's first stand-in), and a second run is a cache hit."""

import os
import stat
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "standin" / "build-rootfs.sh"

FAKE_DEBOOTSTRAP = """#!/bin/sh
# stand-in for debootstrap: the directories build-rootfs.sh touches afterwards
target="$4"
mkdir -p "$target/etc/systemd/system" "$target/var/cache/apt/archives" "$target/var/lib/apt/lists" \
         "$target/var/lib/dbus"
touch "$target/var/cache/apt/archives/x.deb"
echo "I: Base system installed successfully." >&2
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="build-rootfs.sh refuses to run as non-root")
def test_first_build_exits_zero_and_second_is_cached(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "debootstrap"
    fake.write_text(FAKE_DEBOOTSTRAP)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    dest = tmp_path / "cache" / "rootfs"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    r = subprocess.run(["bash", str(SCRIPT), str(dest)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(dest)
    assert (dest / ".dflash-rootfs-complete").is_file()
    assert os.readlink(dest / "etc/systemd/system/dbus.service") == "/dev/null"
    assert not (dest / "var/cache/apt/archives/x.deb").exists()
    assert not list((tmp_path / "cache").glob(".rootfs-build.*"))  # no half-built tree left behind
    fake.write_text("#!/bin/sh\necho 'debootstrap must not run on a cache hit' >&2\nexit 1\n")
    r2 = subprocess.run(["bash", str(SCRIPT), str(dest)], capture_output=True, text=True, env=env)
    assert r2.returncode == 0 and r2.stdout.strip() == str(dest), r2.stderr
