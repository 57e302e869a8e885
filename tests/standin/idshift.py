#!/usr/bin/env python3
"""idshift.py ROOT [OFFSET] - shift the ownership of a container rootfs into an unprivileged id range.

What `pct create` does for an unprivileged container (PVE's default): files owned by uid/gid N in the
template are owned by N + 100000 on the node, so that with `lxc.idmap = u 0 100000 65536` (and g)
they are N again inside. Walks ROOT without crossing file systems, lchown()s every entry by OFFSET
(default 100000) and puts back the setuid/setgid bits chown() clears. Refuses a tree whose root is
not owned by 0 (already shifted, or not a rootfs), so running it twice never shifts twice.

About 0.15 s for the stand-in's 11k-file Debian rootfs, so it runs on each container's own copy.
"""

import os
import stat
import sys

DEFAULT_OFFSET = 100000


def shift(root: str, offset: int = DEFAULT_OFFSET) -> int:
    """Shift ROOT in place; returns the number of entries changed."""
    top = os.lstat(root)
    if top.st_uid != 0:
        raise SystemExit(f"idshift.py: {root} is owned by uid {top.st_uid}, not 0: already shifted?")
    dev, n = top.st_dev, 0

    def one(path: str, st: os.stat_result) -> None:
        if st.st_uid + offset > 0xFFFFFFFE or st.st_gid + offset > 0xFFFFFFFE:
            raise SystemExit(f"idshift.py: {path}: uid {st.st_uid} / gid {st.st_gid} + {offset} out of range")
        os.lchown(path, st.st_uid + offset, st.st_gid + offset)
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
            os.chmod(path, stat.S_IMODE(st.st_mode))      # chown cleared them

    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if os.lstat(os.path.join(d, x)).st_dev == dev]   # -xdev
        for name in dirs + files:
            p = os.path.join(d, name)
            one(p, os.lstat(p))
            n += 1
    one(root, top)
    return n + 1


def main(argv: list) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    n = shift(argv[0], int(argv[1]) if len(argv) == 2 else DEFAULT_OFFSET)
    print(f"idshift.py: {n} entries of {argv[0]} shifted by {argv[1] if len(argv) == 2 else DEFAULT_OFFSET}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
