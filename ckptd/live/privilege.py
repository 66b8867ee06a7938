"""Least privilege for the daemon: once its capture sockets are open (and any network
namespace entered, which needs CAP_SYS_ADMIN), it becomes the configured `user` and
keeps one capability, CAP_NET_RAW, and nothing else: not in the bounding set, not
inheritable, no way back (no_new_privs). Sockets already open keep working; a bug or a
hostile input past this point runs as an unprivileged user that can only write the
checkpoint directory (which is handed to that user here).

Capabilities are per thread. The threads already running (the status server) lose all
of theirs: glibc applies setresuid to every thread, and only the calling thread set
PR_SET_KEEPCAPS. Layouts from linux/capability.h and linux/prctl.h.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import grp
import logging
import os
import pwd
import threading

from ckptd.errors import CkptdError

log = logging.getLogger("ckptd")
CAP_NET_RAW = 13
PR_SET_KEEPCAPS = 8
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
_LINUX_CAPABILITY_VERSION_3 = 0x20080522

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class PrivilegeError(CkptdError):
    """The daemon could not drop to the configured user and capabilities."""


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def resolve(user: str, group: str | None) -> tuple[int, int]:
    """(uid, gid) of a user name (and a group name, else the user's primary group)."""
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise PrivilegeError(f"user: no user named {user!r} on this host") from None
    if group is None:
        return pw.pw_uid, pw.pw_gid
    try:
        return pw.pw_uid, grp.getgrnam(group).gr_gid
    except KeyError:
        raise PrivilegeError(f"group: no group named {group!r} on this host") from None


def drop_privileges(user: str, group: str | None, writable: list[str]) -> None:
    """Become `user` (and `group`) keeping only CAP_NET_RAW; `writable` directories
    (the checkpoint directory) are handed to that user first if root owns them."""
    uid, gid = resolve(user, group)
    if os.geteuid() != 0:
        if os.geteuid() == uid:
            return  # started as that user already (systemd User=)
        raise PrivilegeError(f"user: dropping to {user!r} needs root; ckptd runs as uid {os.geteuid()}")
    for d in writable:
        st = os.stat(d)
        if st.st_uid == 0:
            os.chown(d, uid, gid)
    last = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last + 1):
        if cap != CAP_NET_RAW:
            _prctl(PR_CAPBSET_DROP, cap, "drop capability from the bounding set")
    _prctl(PR_SET_KEEPCAPS, 1, "keep capabilities across setuid")
    try:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    except OSError as e:
        raise PrivilegeError(f"user: cannot become {user!r} (uid {uid}, gid {gid}): {e.strerror}") from None
    keep = 1 << CAP_NET_RAW
    data = (_CapData * 2)(_CapData(keep, keep, 0), _CapData(0, 0, 0))
    if _libc.capset(ctypes.byref(_CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)), data) != 0:
        raise PrivilegeError(f"user: capset: {os.strerror(ctypes.get_errno())}")
    _prctl(PR_SET_KEEPCAPS, 0, "clear keep-capabilities")
    _prctl(PR_SET_NO_NEW_PRIVS, 1, "set no_new_privs")
    eff = effective_capabilities()
    if os.getuid() != uid or eff & ~keep:
        raise PrivilegeError(f"user: after dropping, uid {os.getuid()} and capabilities {eff:#x} "
                             f"remain (wanted uid {uid}, {keep:#x})")
    log.info("privileges dropped", extra={"fields": {"user": user, "uid": uid, "gid": gid,
                                                     "capabilities": ["CAP_NET_RAW"]}})


def effective_capabilities() -> int:
    """This thread's CapEff from /proc (a bit per capability)."""
    with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    raise PrivilegeError("cannot read CapEff from /proc")


def _prctl(option: int, arg: int, what: str) -> None:
    if _libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise PrivilegeError(f"user: cannot {what}: {os.strerror(err)}")
