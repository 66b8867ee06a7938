"""Port mirroring on a Linux bridge (or any Linux interface) with tc, through pyroute2.

    add_mirror("p0", "m0", "both", netns="lab-sw")
    list_mirrors(netns="lab-sw")
    remove_mirrors("p0", netns="lab-sw")

add_mirror does what these commands would (once per hook for "both"):

    tc qdisc add dev p0 clsact
    tc filter add dev p0 ingress prio P matchall \
        action mirred egress mirror dev m0 continue

Direction is that of the mirrored port, as on a switch (SONiC's RX|TX|BOTH): "rx" or
"ingress" = frames the port receives (what the attached host sends), "tx" or "egress"
= frames the port sends (what the host receives), "both".

Kernels built without the matchall classifier (CONFIG_NET_CLS_MATCHALL unset, as on
this project's machines) refuse it; the rule then falls back to `u32 match u32 0 0`,
which matches every packet too.  The mirred action's control is "continue" rather
than tc's default "pipe": a filter whose verdict is "pipe" ends the search, so with
several mirror sessions on one port and direction only the first would get copies.

add_loss (for test networks) drops frames leaving an interface at random: netem
where the kernel has it, else a classic-BPF filter.
"""
from __future__ import annotations

import errno
import socket
import struct
from dataclasses import asdict, dataclass

from pyroute2 import IPRoute
from pyroute2.netlink import NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST, nla, nlmsg
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl import RTM_DELTFILTER, RTM_NEWTFILTER
from pyroute2.netlink.rtnl.tcmsg import tcmsg
from ckptd.errors import CkptdError

PARENTS = {"ingress": 0xFFFFFFF2, "egress": 0xFFFFFFF3}   # clsact's two hooks
ETH_P_ALL = 0x0003
MIRRED_EGRESS_MIRROR = 2                                  # tc_mirred.h TCA_EGRESS_MIRROR
TC_ACT_UNSPEC = -1                                        # "continue" with the next filter
LOSS_PRIO = 1                                             # add_loss's filter, ahead of all
_DIRECTIONS = {"rx": ("ingress",), "ingress": ("ingress",), "tx": ("egress",),
               "egress": ("egress",), "both": ("ingress", "egress")}


class MirrorError(CkptdError, RuntimeError):
    """A mirror rule could not be added, listed or removed; names interface and netns."""


@dataclass(frozen=True)
class MirrorRule:
    netns: str | None
    ifname: str          # the mirrored port
    direction: str       # "ingress" | "egress", relative to the mirrored port
    dst_ifname: str      # where the copies go
    classifier: str      # "matchall" | "u32"
    prio: int            # tc filter preference: (ifname, direction, prio) is the rule's key
    ifindex: int
    dst_ifindex: int

    def as_dict(self) -> dict:
        return asdict(self)


def _where(ifname, netns):
    return f"{ifname} (netns {netns})" if netns else ifname


def _open(netns):
    try:
        # flags=0: never create a namespace that does not exist (pyroute2's default).
        return IPRoute(netns=netns, flags=0) if netns else IPRoute()
    except OSError as e:
        raise MirrorError(f"network namespace {netns!r}: {e.strerror or e}") from e


def _index(ipr, ifname, netns):
    found = ipr.link_lookup(ifname=ifname)
    if not found:
        raise MirrorError(f"{_where(ifname, netns)}: no such interface")
    return found[0]


def _ensure_clsact(ipr, idx, ifname, netns):
    try:
        ipr.tc("add", "clsact", index=idx)
    except NetlinkError as e:
        if e.code != errno.EEXIST:
            raise MirrorError(f"{_where(ifname, netns)}: cannot add clsact qdisc: {e}") from e


def _options(kind: str, dst_idx: int) -> dict:
    """TCA_OPTIONS of a `kind` filter whose one action mirrors to dst_idx and then says
    "continue" (TC_ACT_UNSPEC).  Built by hand because pyroute2's mirred helper always
    sets "pipe", and the gact action that could follow it is not in every kernel
    either (it is not in this project's)."""
    mirred = {"attrs": [["TCA_MIRRED_PARMS", {"eaction": MIRRED_EGRESS_MIRROR,
                                              "ifindex": dst_idx, "action": TC_ACT_UNSPEC}]]}
    acts = {"attrs": [["TCA_ACT_PRIO_1", {"attrs": [["TCA_ACT_KIND", "mirred"],
                                                    ["TCA_ACT_OPTIONS", mirred]]}]]}
    if kind == "matchall":
        return {"attrs": [["TCA_MATCHALL_ACT", acts]]}
    # u32 match u32 0 0: one key comparing 0 bits at offset 0 -- every packet.
    return {"attrs": [["TCA_U32_ACT", acts], ["TCA_U32_SEL", {"keys": ["0x0/0x0+0"]}]]}


def _request(ipr, msg, msg_type: int, flags: int) -> None:
    """Send one message and wait for its ACK; NetlinkError if the kernel says no."""
    msg["header"]["type"], msg["header"]["flags"] = msg_type, flags
    ipr.nlm_request_batch([msg])


def _new_filter(ipr, idx: int, parent: int, prio: int, kind: str, dst_idx: int) -> None:
    msg = tcmsg()
    msg["index"], msg["handle"], msg["parent"] = idx, 0, parent
    msg["info"] = (prio << 16) | socket.htons(ETH_P_ALL)
    msg["attrs"] = [["TCA_KIND", kind], ["TCA_OPTIONS", _options(kind, dst_idx)]]
    _request(ipr, msg, RTM_NEWTFILTER, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL)


def _prios(ipr, idx, parent) -> set[int]:
    return {f["info"] >> 16 for f in ipr.get_filters(index=idx, parent=parent)}


def add_mirror(src_ifname: str, dst_ifname: str, direction: str,
               netns: str | None = None) -> list[MirrorRule]:
    """Copy src_ifname's traffic in `direction` (rx|tx|both, or ingress|egress) out of
    dst_ifname.  Returns one MirrorRule per hook installed."""
    if direction not in _DIRECTIONS:
        raise MirrorError(f"{_where(src_ifname, netns)}: direction must be one of "
                          f"{sorted(_DIRECTIONS)}, not {direction!r}")
    rules = []
    with _open(netns) as ipr:
        idx = _index(ipr, src_ifname, netns)
        dst = _index(ipr, dst_ifname, netns)
        _ensure_clsact(ipr, idx, src_ifname, netns)
        try:
            _add_hooks(ipr, idx, dst, src_ifname, dst_ifname, direction, netns, rules)
        except BaseException:
            for r in rules:  # all or nothing: no half-made "both"
                try:
                    _del_filter(ipr, r)
                except NetlinkError:
                    pass
            raise
    return rules


def _add_hooks(ipr, idx, dst, src_ifname, dst_ifname, direction, netns, rules):
    for hook in _DIRECTIONS[direction]:
        # A fresh preference per rule, so that each rule is its own filter and can be
        # removed alone.  Unused on both hooks: u32 keeps the hash tables of a qdisc's
        # ingress and egress in one list and dumps them by preference only, so equal
        # preferences would show each rule under both hooks.
        used = _prios(ipr, idx, PARENTS["ingress"]) | _prios(ipr, idx, PARENTS["egress"])
        prio = next(p for p in range(0xC000, 0, -1) if p not in used)
        kind = _add_filter(ipr, idx, PARENTS[hook], prio, dst, src_ifname, hook, netns)
        rules.append(MirrorRule(netns, src_ifname, hook, dst_ifname, kind, prio, idx, dst))


def _add_filter(ipr, idx, parent, prio, dst, ifname, hook, netns) -> str:
    try:
        _new_filter(ipr, idx, parent, prio, "matchall", dst)
        return "matchall"
    except NetlinkError as e:
        # ENOENT / EOPNOTSUPP / EINVAL: the kernel has no matchall classifier.
        if e.code not in (errno.ENOENT, errno.EOPNOTSUPP, errno.EINVAL):
            raise MirrorError(f"{_where(ifname, netns)}: cannot add {hook} mirror filter: {e}") from e
    try:
        _new_filter(ipr, idx, parent, prio, "u32", dst)
        return "u32"
    except NetlinkError as e:
        raise MirrorError(f"{_where(ifname, netns)}: cannot add {hook} mirror filter "
                          f"(neither matchall nor u32 accepted): {e}") from e


def _mirred_targets(msg) -> list[int]:
    """ifindexes of the egress-mirror actions in a filter message, [] if none."""
    opts = msg.get_attr("TCA_OPTIONS")
    if opts is None:
        return []
    acts = opts.get_attr("TCA_U32_ACT") or opts.get_attr("TCA_MATCHALL_ACT")
    if acts is None:
        return []
    out = []
    for _, act in acts["attrs"]:
        if act.get_attr("TCA_ACT_KIND") != "mirred":
            continue
        parms = act.get_attr("TCA_ACT_OPTIONS").get_attr("TCA_MIRRED_PARMS")
        if parms and parms["eaction"] == MIRRED_EGRESS_MIRROR:
            out.append(parms["ifindex"])
    return out


def _del_filter(ipr, rule: MirrorRule) -> None:
    """Delete the whole filter at the rule's preference (each rule has its own)."""
    msg = tcmsg()
    msg["index"], msg["handle"], msg["parent"] = rule.ifindex, 0, PARENTS[rule.direction]
    msg["info"] = (rule.prio << 16) | socket.htons(ETH_P_ALL)
    msg["attrs"] = [["TCA_KIND", rule.classifier]]
    _request(ipr, msg, RTM_DELTFILTER, NLM_F_REQUEST | NLM_F_ACK)


def list_mirrors(ifname: str | None = None, netns: str | None = None) -> list[MirrorRule]:
    """Mirror rules on ifname (or on every interface of the namespace): any clsact
    filter with a mirred egress-mirror action, whoever installed it."""
    out = []
    with _open(netns) as ipr:
        names = {l["index"]: l.get_attr("IFLA_IFNAME") for l in ipr.get_links()}
        idxs = [_index(ipr, ifname, netns)] if ifname else sorted(names)
        seen = set()
        for idx in idxs:
            for hook, parent in PARENTS.items():
                try:
                    msgs = ipr.get_filters(index=idx, parent=parent)
                except NetlinkError as e:
                    if e.code in (errno.EINVAL, errno.ENOENT):  # no clsact on it
                        continue
                    raise MirrorError(f"{_where(names.get(idx, idx), netns)}: cannot list filters: {e}") from e
                for m in msgs:
                    key = (idx, hook, m["info"] >> 16, m["handle"])
                    if key in seen:
                        continue
                    seen.add(key)
                    for dst in _mirred_targets(m):
                        out.append(MirrorRule(netns, names.get(idx, str(idx)), hook,
                                              names.get(dst, f"ifindex {dst}"),
                                              m.get_attr("TCA_KIND"), m["info"] >> 16, idx, dst))
    return out


def remove_mirrors(ifname: str, netns: str | None = None,
                   dst_ifname: str | None = None) -> list[MirrorRule]:
    """Remove the mirror rules on ifname (only those to dst_ifname if given); the clsact
    qdisc goes too once no filter is left on it.  Returns what was removed."""
    rules = [r for r in list_mirrors(ifname, netns)
             if dst_ifname is None or r.dst_ifname == dst_ifname]
    with _open(netns) as ipr:
        for r in rules:
            try:
                _del_filter(ipr, r)
            except NetlinkError as e:
                if e.code != errno.ENOENT:
                    raise MirrorError(f"{_where(ifname, netns)}: cannot remove {r.direction} "
                                      f"mirror filter (prio {r.prio}): {e}") from e
        idx = _index(ipr, ifname, netns)
        try:
            left = any(True for p in PARENTS.values() for _ in ipr.get_filters(index=idx, parent=p))
        except NetlinkError:
            left = True  # no clsact, or cannot tell: leave the qdisc alone
        if not left:
            try:
                ipr.tc("del", "clsact", index=idx)
            except NetlinkError as e:
                if e.code not in (errno.ENOENT, errno.EINVAL):
                    raise MirrorError(f"{_where(ifname, netns)}: cannot remove clsact qdisc: {e}") from e
    return rules


# -- loss on a link (for test networks) --------------------------------------------------
class _cbpf_tcmsg(nlmsg):
    """A tc filter message whose options are those of a classic-BPF `bpf` filter.
    pyroute2's own map types TCA_BPF_OPS_LEN and TCA_BPF_OPS as u32 where the kernel
    wants u16 and raw bytes, so this is a separate message class (a subclass of
    pyroute2's tcmsg would share its compiled attribute table)."""
    fields = tcmsg.fields
    nla_map = (("TCA_UNSPEC", "none"), ("TCA_KIND", "asciiz"), ("TCA_OPTIONS", "options"))

    class options(nla):
        nla_map = (("TCA_BPF_UNSPEC", "none"), ("TCA_BPF_ACT", "none"),
                   ("TCA_BPF_POLICE", "none"), ("TCA_BPF_CLASSID", "uint32"),
                   ("TCA_BPF_OPS_LEN", "uint16"), ("TCA_BPF_OPS", "cdata"),
                   ("TCA_BPF_FD", "uint32"), ("TCA_BPF_NAME", "asciiz"),
                   ("TCA_BPF_FLAGS", "uint32"))


TCA_BPF_FLAG_ACT_DIRECT = 1
TC_ACT_OK, TC_ACT_SHOT = 0, 2


def _random_drop_program(p: float) -> bytes:
    """Classic BPF, run in direct-action mode (its return value is the tc verdict):

        ld  rand                  A = 32 random bits (ancillary load SKF_AD_RANDOM)
        jge #T, keep, drop        T = p * 2^32
        keep: ret #TC_ACT_OK
        drop: ret #TC_ACT_SHOT
    """
    t = min(int(round(p * 2**32)), 0xFFFFFFFF)
    insns = [(0x20, 0, 0, 0xFFFFF000 + 56),   # BPF_LD|BPF_W|BPF_ABS at SKF_AD_OFF + SKF_AD_RANDOM
             (0x35, 0, 1, t),                  # BPF_JMP|BPF_JGE|BPF_K
             (0x06, 0, 0, TC_ACT_OK),
             (0x06, 0, 0, TC_ACT_SHOT)]
    return b"".join(struct.pack("=HBBI", *i) for i in insns)


def add_loss(ifname: str, probability: float, netns: str | None = None) -> str:
    """Drop each frame leaving ifname with `probability`, independently.  A netem qdisc
    where the kernel has one; otherwise (as on this project's machines, built without
    CONFIG_NET_SCH_NETEM) a classic-BPF tc filter on clsact egress that draws a random
    number per frame.  Egress, because packet sockets on the far end of a veth see a
    frame before any ingress hook could drop it.  Returns "netem" or "bpf"."""
    if not 0 <= probability <= 1:
        raise MirrorError(f"{_where(ifname, netns)}: loss probability {probability} not in [0, 1]")
    with _open(netns) as ipr:
        idx = _index(ipr, ifname, netns)
        try:
            ipr.tc("add", "netem", index=idx, loss=probability * 100, limit=100_000)
            return "netem"
        except NetlinkError as e:
            if e.code not in (errno.ENOENT, errno.EOPNOTSUPP, errno.EINVAL):
                raise MirrorError(f"{_where(ifname, netns)}: cannot add netem qdisc: {e}") from e
        _ensure_clsact(ipr, idx, ifname, netns)
        prog = _random_drop_program(probability)
        msg = _cbpf_tcmsg()
        msg["index"], msg["handle"], msg["parent"] = idx, 1, PARENTS["egress"]
        msg["info"] = (LOSS_PRIO << 16) | socket.htons(ETH_P_ALL)
        msg["attrs"] = [["TCA_KIND", "bpf"],
                        ["TCA_OPTIONS", {"attrs": [["TCA_BPF_OPS_LEN", len(prog) // 8],
                                                   ["TCA_BPF_OPS", prog],
                                                   ["TCA_BPF_NAME", "ckptd-loss"],
                                                   ["TCA_BPF_FLAGS", TCA_BPF_FLAG_ACT_DIRECT]]}]]
        try:
            _request(ipr, msg, RTM_NEWTFILTER, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL)
        except NetlinkError as e:
            raise MirrorError(f"{_where(ifname, netns)}: cannot add loss (no netem qdisc, and "
                              f"the bpf filter was refused): {e}") from e
        return "bpf"
