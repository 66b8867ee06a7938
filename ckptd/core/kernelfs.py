"""Directories on the kernel's own filesystems (/proc, /sys, /dev, cgroups): no place
for checkpoints. A path there was refused late and with the OS's words for something
else (`out: /proc/self` said "No such file or directory" of a directory that exists),
or, under /dev, written to memory among the device nodes without a word."""
from __future__ import annotations

import os
import re
from pathlib import Path

# filesystems the kernel serves from its own state: they hold no files of ours
# (devtmpfs holds device nodes, in memory; the rest refuse new files)
KERNEL_FILESYSTEMS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "bpf",
    "configfs", "pstore", "efivarfs", "mqueue", "hugetlbfs", "fusectl", "binfmt_misc", "rpc_pipefs", "nsfs"})

_OCTAL = re.compile(r"\\([0-7]{3})")  # mountinfo writes a space in a mount point as \040


def kernel_filesystem(path: str | os.PathLike, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The kernel filesystem type `path` (or the nearest of its ancestors that exists)
    lies on, or None: on storage, or where the mount table cannot be read."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p.parent != p:
        p = p.parent
    real = os.path.realpath(p)
    try:
        lines = Path(mountinfo).read_text(errors="surrogateescape").splitlines()
    except OSError:
        return None
    best, kind = "", None
    for line in lines:  # "id parent major:minor root point options [optional...] - type source super"
        fields = line.split()
        if "-" not in fields or len(fields) < 5:
            continue
        point = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
        under = real == point or real.startswith(point.rstrip("/") + "/")
        if under and len(point) >= len(best):  # the longest; at one point the later mount is on top
            best, kind = point, fields[fields.index("-") + 1]
    return kind if kind in KERNEL_FILESYSTEMS else None


def not_storage(path: str | os.PathLike) -> str | None:
    """Why `path` cannot hold checkpoints (it lies on a kernel filesystem), or None."""
    kind = kernel_filesystem(path)
    return None if kind is None else f"it lies on {kind}, a filesystem of the kernel's, not storage"
