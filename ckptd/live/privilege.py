"""Least privilege for the daemon: once its capture sockets are open (and any network
namespace entered, which needs CAP_SYS_ADMIN), it becomes the configured `user` and
keeps one capability, CAP_NET_RAW, and nothing else: not in the bounding set, not
inheritable, no way back (no_new_privs). Sockets already open keep working; a bug or a
hostile input past this point runs as an unprivileged user that can only write the
checkpoint directory (which is handed to that user here).

Without `user`, `drop_capabilities` (on by default in a config file) drops every
capability once the rings are open: an open AF_PACKET socket needs none (the kernel
checks CAP_NET_RAW when the socket is created), so the daemon goes on as root with
empty effective, permitted, inheritable, ambient and bounding sets and no_new_privs.

Capabilities are per thread (capset(2), PR_CAPBSET_DROP and no_new_privs act on the
calling thread), and the status server, the persistence writer and torch's pools are
running before the rings are open: cython_ext/capdrop.c applies the drop in every
thread of the process (a signal to each, whose handler makes the system calls), and
every thread's /proc status is read back to check it. Layouts from
linux/capability.h and linux/prctl.h.
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
CAP_SETPCAP = 8
PR_SET_KEEPCAPS = 8
PR_CAPBSET_READ = 23
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


CAP_NAMES = ("CAP_CHOWN CAP_DAC_OVERRIDE CAP_DAC_READ_SEARCH CAP_FOWNER CAP_FSETID CAP_KILL "
             "CAP_SETGID CAP_SETUID CAP_SETPCAP CAP_LINUX_IMMUTABLE CAP_NET_BIND_SERVICE "
             "CAP_NET_BROADCAST CAP_NET_ADMIN CAP_NET_RAW CAP_IPC_LOCK CAP_IPC_OWNER CAP_SYS_MODULE "
             "CAP_SYS_RAWIO CAP_SYS_CHROOT CAP_SYS_PTRACE CAP_SYS_PACCT CAP_SYS_ADMIN CAP_SYS_BOOT "
             "CAP_SYS_NICE CAP_SYS_RESOURCE CAP_SYS_TIME CAP_SYS_TTY_CONFIG CAP_MKNOD CAP_LEASE "
             "CAP_AUDIT_WRITE CAP_AUDIT_CONTROL CAP_SETFCAP CAP_MAC_OVERRIDE CAP_MAC_ADMIN CAP_SYSLOG "
             "CAP_WAKE_ALARM CAP_BLOCK_SUSPEND CAP_AUDIT_READ CAP_PERFMON CAP_BPF "
             "CAP_CHECKPOINT_RESTORE").split()


def cap_names(bits: int) -> list[str]:
    return [CAP_NAMES[i] if i < len(CAP_NAMES) else f"cap_{i}" for i in range(64) if bits >> i & 1]


def _last_cap() -> int:
    return int(open("/proc/sys/kernel/cap_last_cap").read())


def thread_capabilities() -> dict[int, dict[str, int]]:
    """Every thread of this process: {tid: {"CapEff", "CapPrm", "CapInh", "CapBnd",
    "CapAmb", "NoNewPrivs"}} from /proc (a thread that ended meanwhile is left out)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            text = open(f"/proc/self/task/{tid}/status").read()
        except OSError:
            continue
        row = {}
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key in ("CapEff", "CapPrm", "CapInh", "CapBnd", "CapAmb"):
                row[key] = int(value.split()[0], 16)
            elif key == "NoNewPrivs":
                row[key] = int(value.split()[0])
        out[int(tid)] = row
    return out


def _all_threads(keep: int, set_caps: bool, key: str, keep_bounding: int | None = None) -> int:
    """The drop in every thread (cython_ext/capdrop.c); the number of threads."""
    try:
        from cython_ext.caps import drop_all_threads
    except ImportError as e:
        raise PrivilegeError(f"{key}: the capability helper (cython_ext.caps) is not built: {e}") from None
    r, threads, tid, what = drop_all_threads(keep, keep if keep_bounding is None else keep_bounding, set_caps,
                                         _last_cap())
    if r != 0:
        raise PrivilegeError(f"{key}: cannot {what} in thread {tid}: {os.strerror(-r)}")
    return threads


def _check_threads(keep: int, key: str, bounding: int | None = None) -> None:
    bounding = keep if bounding is None else bounding
    for tid, row in thread_capabilities().items():
        bad = {k: v for k, v in row.items() if k in ("CapEff", "CapPrm") and v & ~keep}
        bad.update({k: v for k, v in row.items() if k in ("CapInh", "CapAmb") and v})
        if row.get("CapBnd", 0) & ~bounding:
            bad["CapBnd"] = row["CapBnd"]
        if row.get("NoNewPrivs") != 1:
            bad["NoNewPrivs"] = row.get("NoNewPrivs")
        if bad:
            raise PrivilegeError(f"{key}: thread {tid} still holds " + ", ".join(
                f"{k} {v:#x}" if k != "NoNewPrivs" else f"{k}={v}" for k, v in sorted(bad.items())))


def drop_capabilities(key: str = "drop_capabilities") -> None:
    """Drop every capability in every thread of this process: effective, permitted,
    inheritable, ambient and bounding sets emptied, no_new_privs set. The capture
    sockets already open keep working; no new one can be opened."""
    eff, bnd = effective_capabilities(), _bounding()
    # without CAP_SETPCAP (started unprivileged, as deploy/ckptd.service does) the
    # bounding set cannot shrink; with nothing permitted and no_new_privs it grants nothing
    keep_bnd = 0 if eff >> CAP_SETPCAP & 1 else bnd
    threads = _all_threads(0, True, key, keep_bnd)
    _check_threads(0, key, keep_bnd)
    left = f" (bounding set left at {' '.join(cap_names(keep_bnd))}: no CAP_SETPCAP)" if keep_bnd else ""
    log.info(f"capabilities dropped in all {threads} threads: "
             f"{' '.join(cap_names((eff | bnd) & ~keep_bnd)) or 'none held'}; none kept{left}",
             extra={"fields": {"threads": threads, "dropped": cap_names((eff | bnd) & ~keep_bnd), "kept": [],
                               "bounding_left": cap_names(keep_bnd), "no_new_privs": True}})


def start_resource_tracker_unprivileged(key: str = "drop_capabilities") -> None:
    """multiprocessing's resource tracker (a child process that spawning the capture
    workers starts, whether or not any shared memory is named: their slots are memfds
    now) is started before the rings are open, so no later drop
    reaches it: start it now from a short-lived thread that has dropped every capability
    of its own first (capabilities are per thread, and a root execve gains nothing with an
    empty bounding set and no_new_privs), so the tracker never holds one."""
    from multiprocessing import resource_tracker
    if getattr(resource_tracker._resource_tracker, "_pid", None) is not None:
        return  # already running (started earlier by this process): nothing to do
    box: dict = {}

    def body():
        try:
            for cap in range(_last_cap() + 1):
                if _libc.prctl(PR_CAPBSET_READ, ctypes.c_ulong(cap), 0, 0, 0) == 1:
                    _prctl(PR_CAPBSET_DROP, cap, "drop capability from the bounding set", key)
            data = (_CapData * 2)(_CapData(0, 0, 0), _CapData(0, 0, 0))
            if _libc.capset(ctypes.byref(_CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)), data) != 0:
                raise PrivilegeError(f"{key}: capset: {os.strerror(ctypes.get_errno())}")
            _prctl(PR_SET_NO_NEW_PRIVS, 1, "set no_new_privs", key)
            resource_tracker.ensure_running()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    t = threading.Thread(target=body, name="ckptd-tracker-start")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]


def _bounding() -> int:
    """This thread's CapBnd from /proc (a bit per capability)."""
    return _own_capability_set("CapBnd")


def drop_privileges(user: str, group: str | None, writable: list[str], keep_net_raw: bool = True,
                    hand_over: bool = True) -> list[str]:
    """Become `user` (and `group`) keeping only CAP_NET_RAW (none with keep_net_raw
    False: drop_capabilities); `writable` directories (the checkpoint directory) are
    handed to that user first if root owns them, or with hand_over False (`ckptd run
    --check`, which changes nothing) only named. Returns those root owned."""
    uid, gid = resolve(user, group)
    if os.geteuid() != 0:
        if os.geteuid() == uid:
            return []  # started as that user already (systemd User=)
        raise PrivilegeError(f"user: dropping to {user!r} needs root; ckptd runs as uid {os.geteuid()}")
    rooted = [d for d in writable if os.stat(d).st_uid == 0]
    for d in rooted if hand_over else ():
        os.chown(d, uid, gid)
    keep = (1 << CAP_NET_RAW) if keep_net_raw else 0
    before = effective_capabilities() | _bounding()
    # the bounding set and no_new_privs of every thread (the setuid below clears the
    # other threads' permitted and effective sets: glibc applies it to every thread,
    # and only this one sets PR_SET_KEEPCAPS); the setuid needs CAP_SETUID/SETGID here
    threads = _all_threads(keep, False, "user")
    _prctl(PR_SET_KEEPCAPS, 1, "keep capabilities across setuid")
    try:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    except OSError as e:
        raise PrivilegeError(f"user: cannot become {user!r} (uid {uid}, gid {gid}): {e.strerror}") from None
    data = (_CapData * 2)(_CapData(keep, keep, 0), _CapData(0, 0, 0))
    if _libc.capset(ctypes.byref(_CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)), data) != 0:
        raise PrivilegeError(f"user: capset: {os.strerror(ctypes.get_errno())}")
    _prctl(PR_SET_KEEPCAPS, 0, "clear keep-capabilities")
    _prctl(PR_SET_NO_NEW_PRIVS, 1, "set no_new_privs")
    eff = effective_capabilities()
    if os.getuid() != uid or eff & ~keep:
        raise PrivilegeError(f"user: after dropping, uid {os.getuid()} and capabilities {eff:#x} "
                             f"remain (wanted uid {uid}, {keep:#x})")
    _check_threads(keep, "user")
    log.info(f"privileges dropped: now {user} (uid {uid}) in all {threads} threads, keeping "
             f"{' '.join(cap_names(keep)) or 'no capability'}, dropped {' '.join(cap_names(before & ~keep))}",
             extra={"fields": {"user": user, "uid": uid, "gid": gid, "threads": threads,
                               "capabilities": cap_names(keep), "dropped": cap_names(before & ~keep)}})
    return rooted


def effective_capabilities() -> int:
    """This thread's CapEff from /proc (a bit per capability)."""
    return _own_capability_set("CapEff")


def _own_capability_set(name: str) -> int:
    with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1], 16)
    raise PrivilegeError(f"cannot read {name} from /proc")


def _prctl(option: int, arg: int, what: str, key: str = "user") -> None:
    if _libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise PrivilegeError(f"{key}: cannot {what}: {os.strerror(err)}")
