"""A test network in network namespaces: GPU hosts, a leaf switch with mirror ports,
and a checkpoint host that captures the mirrored streams.

    with NetLab(plan, loss={"mirror1": 0.01}) as lab:
        caps = lab.capture()                       # one RingCapture per plan mirror
        lab.send(host_frames("run/"))              # each host sends its own frames
        frames = [c.drain() for c in caps]

Layout, for a plan with N ranks and K mirrors (names are <prefix>-<role>):

    <p>-h<r>  eth0 (rank r's address)  ──veth──  h<r> ┐
                                                       ├ br0  in <p>-sw (the switch)
    <p>-ck    <mirror name>           ──veth──  m<k>   (not bridged: a mirror port)

Mirror k copies the traffic of its rank's bridge port to m<k> with tc (switch_config.
linux): the plan's "tx" (frames the host sends) is the port's ingress, "rx" its egress.
Loss on a mirror link is a netem qdisc on m<k>, or a random-drop tc filter where the
kernel has no netem.  The bridge neither learns nor floods unknown unicast: static FDB
entries put each host's MACs on its port, so a frame only ever leaves through the port
of the host it is addressed to, and each mirror sees exactly what its rule says.  IPv6 is off where it is not needed, so the kernels stay
quiet on the mirrored ports.  Deleting the namespaces deletes everything else.
"""
from __future__ import annotations

import ctypes
import fcntl
import ipaddress
import os
import re
import secrets
import shutil
import socket
import struct
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from pyroute2 import IPRoute, netns as pr_netns

from parsers.capfile import open_capture
from switch_config.linux import add_loss, add_mirror, list_mirrors

from ckptd.live.ring import NETNS_RUN_DIR, RingCapture, in_netns
from ckptd.core.plan import Plan, load_plan
from ckptd.testing.sender import SendResult, send_frames
from ckptd.errors import CkptdError

ROLES = re.compile(r"-(sw|ck|h\d+)$")
NUD_NOARP = 0x40           # a static bridge FDB entry ("bridge fdb add ... static")
NTF_MASTER = 0x04
_PORT_DIRECTION = {"tx": "ingress", "rx": "egress", "both": "both"}  # host -> port view


class NetLabError(CkptdError, RuntimeError):
    """The test network could not be built or torn down; the message says which part."""


def unique_prefix() -> str:
    """Short (interface-name budget) and unique across parallel runs on one machine."""
    return f"ckl{os.getpid() % 0xFFFF:x}{secrets.token_hex(2)}"


def lab_unavailable() -> str | None:
    """Why no lab can be built here (not root, no network namespaces), or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs, tc)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"{unique_prefix()}-probe"
    try:
        pr_netns.create(probe)
    except Exception as e:  # noqa: BLE001 -- any failure means "no namespaces here"
        return f"cannot create a network namespace: {e}"
    finally:
        try:
            remove_namespaces([probe])
        except OSError:
            pass
    return None


# -- small helpers ---------------------------------------------------------------------
def sysctl(netns: str | None, key: str, value) -> None:
    """Write a net.* sysctl inside netns (/proc/sys/net follows the writer's namespace)."""
    path = "/proc/sys/" + key.replace(".", "/")

    def write():
        with open(path, "w") as f:
            f.write(str(value))
    in_netns(netns, write)


SIOCETHTOOL = 0x8946
ETHTOOL_GTXCSUM, ETHTOOL_STXCSUM = 0x16, 0x17


def tx_checksum(ifname: str, netns: str | None = None, enable: bool | None = None) -> bool:
    """Read, or set, an interface's tx checksum offload with the SIOCETHTOOL ioctl (no
    ethtool binary here).  veths leave UDP/TCP checksums of locally generated packets to
    "offload", which never happens, so captures would show bad checksums; off, the
    kernel computes them.  Returns the state after the call."""
    def call():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            if enable is not None:
                _ethtool(s, ifname, ETHTOOL_STXCSUM, int(enable))
            return bool(_ethtool(s, ifname, ETHTOOL_GTXCSUM, 0))

    def _ethtool(s, name, cmd, data):
        val = ctypes.create_string_buffer(struct.pack("=II", cmd, data), 8)  # ethtool_value
        ifr = struct.pack("16sP", name.encode(), ctypes.addressof(val)).ljust(40, b"\0")
        fcntl.ioctl(s.fileno(), SIOCETHTOOL, ifr)
        return struct.unpack("=II", val.raw)[1]
    try:
        return in_netns(netns, call)
    except OSError as e:
        raise NetLabError(f"{ifname} (netns {netns}): ethtool tx checksum: {e.strerror or e}") from e


def _mac(b: bytes) -> str:
    return ":".join(f"{x:02x}" for x in b)


def _src_ip(frame: bytes):
    """Source address of an Ethernet [802.1Q] IPv4/IPv6 frame, None for anything else."""
    et, off = struct.unpack_from("!H", frame, 12)[0], 14
    if et == 0x8100 and len(frame) >= 18:
        et, off = struct.unpack_from("!H", frame, 16)[0], 18
    if et == 0x0800 and len(frame) >= off + 20:
        return ipaddress.IPv4Address(frame[off + 12:off + 16])
    if et == 0x86DD and len(frame) >= off + 40:
        return ipaddress.IPv6Address(frame[off + 8:off + 24])
    return None


# -- the frames each host sends ------------------------------------------------------
def host_frames(run_dir: str | Path, plan: Plan | None = None) -> dict[int, list[tuple[int, bytes]]]:
    """Each rank's outbound frames (ts_ns, bytes), in time order, recovered from a
    `ckptd synth` run: the union of every mirror's pcap, de-duplicated on (timestamp,
    bytes) -- the synthesizer stamps each wire frame once, so the copies on several
    mirrors carry the same timestamp -- and attributed to the rank whose address is
    the source IP.  Complete when every frame crosses a mirrored port (e.g. 3 ranks, 2
    mirrors "both"); frames no mirror saw, or lost on every mirror that saw them, are
    missing.  Frames from addresses outside the plan are left out."""
    run_dir = Path(run_dir)
    plan = plan or load_plan(run_dir / "plan.json")
    rank_of = {ipaddress.ip_address(a): r for r, a in enumerate(plan.addresses)}
    seen = set()
    out: dict[int, list[tuple[int, bytes]]] = {r: [] for r in range(plan.nranks)}
    for pcap in sorted((run_dir / "mirrors").glob("*.pcap")):
        for fr in open_capture(pcap):
            key = (fr.ts_ns, fr.data)
            if key in seen:
                continue
            seen.add(key)
            r = rank_of.get(_src_ip(fr.data))
            if r is not None:
                out[r].append((fr.ts_ns or 0, fr.data))
    for frames in out.values():
        frames.sort(key=lambda x: x[0])
    return out


# -- the lab ---------------------------------------------------------------------------
@dataclass
class HostPort:
    rank: int
    netns: str
    ifname: str          # in the host namespace
    port: str            # the bridge port in the switch namespace
    addr: str


@dataclass
class MirrorPort:
    name: str
    rank: int
    direction: str       # as in the plan: tx | rx | both (host's view)
    port: str            # mirror port in the switch namespace
    capture_ifname: str  # its peer in the checkpoint namespace
    loss: float = 0.0
    loss_kind: str | None = None  # "netem" or "bpf" (switch_config.linux.add_loss)
    rules: list = field(default_factory=list)


class NetLab:
    """Builds the namespaces on enter (or up()) and removes all of them on exit (or
    down()), exceptions included.  `plan` is a Plan or a path to plan.json; `loss`
    maps mirror names to a loss probability on that mirror link; `mtu` must carry the
    largest frame (RoCE 4096 MTU + headers)."""

    def __init__(self, plan: Plan | str | Path, prefix: str | None = None,
                 loss: dict[str, float] | None = None, mtu: int = 9000):
        self.plan = plan if isinstance(plan, Plan) else load_plan(plan)
        if not self.plan.one_host_per_rank:
            raise NetLabError("the test network gives every rank a host with one NIC; a plan with nodes or "
                              "per-channel NICs (shared NICs, hops inside a node) is not supported by netlab")
        if self.plan.ring.ndevs > 1:
            raise NetLabError("the test network gives every NIC one port; a plan with merged NICs "
                              "(ranks[].ports) is not supported by netlab")
        self.prefix = prefix or unique_prefix()
        self.mtu = mtu
        self.switch_ns, self.ckpt_ns = f"{self.prefix}-sw", f"{self.prefix}-ck"
        self.bridge = "br0"
        self.ipv6 = any(ipaddress.ip_address(a).version == 6 for a in self.plan.addresses)
        self.hosts = [HostPort(r, f"{self.prefix}-h{r}", "eth0", f"h{r}", a)
                      for r, a in enumerate(self.plan.addresses)]
        loss = dict(loss or {})
        unknown = set(loss) - {m.name for m in self.plan.mirrors}
        if unknown:
            raise NetLabError(f"loss given for mirrors not in the plan: {sorted(unknown)}")
        self.mirrors, taken = [], {"lo"}
        for k, m in enumerate(self.plan.mirrors):
            # The capture interface is named after the mirror when that is a valid,
            # unused interface name, so `ckptd run` configs can say ifname: mirror0.
            cap = m.name if _ifname_ok(m.name) and m.name not in taken else f"mirror{k}"
            taken.add(cap)
            self.mirrors.append(MirrorPort(m.name, m.rank, m.direction, f"m{k}", cap,
                                           float(loss.get(m.name, 0.0))))
        self._captures: list[RingCapture] = []
        self._learned: dict[str, int] = {}

    @property
    def namespaces(self) -> list[str]:
        return [self.switch_ns, self.ckpt_ns] + [h.netns for h in self.hosts]

    # -- build / tear down ---------------------------------------------------------
    def __enter__(self):
        self.up()
        return self

    def __exit__(self, *exc):
        self.down()

    def up(self) -> "NetLab":
        existing = set(pr_netns.listnetns())
        clash = [n for n in self.namespaces if n in existing]
        if clash:
            raise NetLabError(f"namespaces already exist: {clash} (another lab with prefix "
                              f"{self.prefix!r}? `scripts/netlab down --name {self.prefix}`)")
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self):
        for ns in self.namespaces:
            pr_netns.create(ns)
            # Before any interface exists, so new ones inherit it: no IPv6 chatter
            # (router solicitations, MLD) on ports whose traffic is being mirrored.
            if ns in (self.switch_ns, self.ckpt_ns) or not self.ipv6:
                sysctl(ns, "net.ipv6.conf.default.disable_ipv6", 1)
                sysctl(ns, "net.ipv6.conf.all.disable_ipv6", 1)
            else:
                sysctl(ns, "net.ipv6.conf.default.accept_dad", 0)
                sysctl(ns, "net.ipv6.conf.default.router_solicitations", 0)
        with IPRoute(netns=self.switch_ns, flags=0) as sw:
            # No multicast snooping: with it the bridge joins the snoopers' group
            # 224.0.0.106 and sends IGMP reports out of every port, mirrors included.
            sw.link("add", ifname=self.bridge, kind="bridge", br_mcast_snooping=0)
            br = sw.link_lookup(ifname=self.bridge)[0]
            sw.link("set", index=br, mtu=self.mtu, state="up")
            for h in self.hosts:
                sw.link("add", ifname=h.port, kind="veth", peer={"ifname": h.ifname, "net_ns_fd": h.netns})
                p = sw.link_lookup(ifname=h.port)[0]
                sw.link("set", index=p, mtu=self.mtu, master=br)
                sw.brport("set", index=p, learning=0, unicast_flood=0)
                sw.link("set", index=p, state="up")
                self._host_up(h)
                self._fdb(sw, h.port, self._host_mac(h))
            for m in self.mirrors:
                sw.link("add", ifname=m.port, kind="veth",
                        peer={"ifname": m.capture_ifname, "net_ns_fd": self.ckpt_ns})
                p = sw.link_lookup(ifname=m.port)[0]
                sw.link("set", index=p, mtu=self.mtu, state="up")
                if m.loss:
                    m.loss_kind = add_loss(m.port, m.loss, netns=self.switch_ns)
        with IPRoute(netns=self.ckpt_ns, flags=0) as ck:
            for m in self.mirrors:
                ck.link("set", index=ck.link_lookup(ifname=m.capture_ifname)[0], mtu=self.mtu, state="up")
        for m in self.mirrors:
            m.rules = add_mirror(self.hosts[m.rank].port, m.port, _PORT_DIRECTION[m.direction],
                                 netns=self.switch_ns)

    def _host_up(self, h: HostPort):
        with IPRoute(netns=h.netns, flags=0) as ipr:
            lo = ipr.link_lookup(ifname="lo")[0]
            ipr.link("set", index=lo, state="up")
            i = ipr.link_lookup(ifname=h.ifname)[0]
            ipr.link("set", index=i, mtu=self.mtu, state="up")
            addr = ipaddress.ip_address(h.addr)
            full = 32 if addr.version == 4 else 128
            ipr.addr("add", index=i, address=h.addr, prefixlen=full)
            for peer in self.hosts:  # host routes: plan addresses need not share a subnet
                if peer.rank != h.rank:
                    ipr.route("add", dst=f"{peer.addr}/{full}", oif=i, scope=253 if addr.version == 4 else 0)
        tx_checksum(h.ifname, h.netns, enable=False)

    def _host_mac(self, h: HostPort) -> str:
        with IPRoute(netns=h.netns, flags=0) as ipr:
            return ipr.get_links(ifname=h.ifname)[0].get_attr("IFLA_ADDRESS")

    def _fdb(self, sw, port: str, mac: str):
        sw.fdb("replace", ifindex=sw.link_lookup(ifname=port)[0], lladdr=mac,
               state=NUD_NOARP, flags=NTF_MASTER)

    def learn(self, frames_by_rank: dict[int, list]) -> None:
        """Static FDB entries for the source MACs of the frames each host will send, on
        that host's port (replayed frames carry the synthesizer's MACs, not the veths')."""
        new = {}
        for r, frames in frames_by_rank.items():
            for item in frames:
                data = item[1] if isinstance(item, tuple) else item
                mac = _mac(data[6:12])
                owner = self._learned.get(mac, new.get(mac, r))
                if owner != r:
                    raise NetLabError(f"MAC {mac} is the source of frames of ranks {owner} and {r}")
                new[mac] = r
        with IPRoute(netns=self.switch_ns, flags=0) as sw:
            for mac, r in new.items():
                if mac not in self._learned:
                    self._fdb(sw, self.hosts[r].port, mac)
                    self._learned[mac] = r

    def down(self) -> list[str]:
        """Close this lab's captures and delete its namespaces (all that exist)."""
        for c in self._captures:
            c.close()
        self._captures.clear()
        return remove_namespaces(self.namespaces)

    # -- using it --------------------------------------------------------------------
    def capture(self, **ring_kw) -> list[RingCapture]:
        """A RingCapture on every mirror's capture interface, in plan order; closed by
        down() if not before."""
        caps = []
        try:
            for m in self.mirrors:
                caps.append(RingCapture(m.capture_ifname, netns=self.ckpt_ns, **ring_kw))
        except BaseException:
            for c in caps:
                c.close()
            raise
        self._captures += caps
        return caps

    def send(self, frames_by_rank: dict[int, list], **send_kw) -> dict[int, SendResult]:
        """Every host sends its frames from its own namespace, all hosts at once (one
        thread each).  send_kw go to ckptd.testing.sender.send_frames (timing, pps, speed)."""
        self.learn(frames_by_rank)
        results: dict[int, SendResult] = {}
        errors: list[BaseException] = []

        def one(r, frames):
            try:
                h = self.hosts[r]
                results[r] = send_frames(frames, h.ifname, h.netns, **send_kw)
            except BaseException as e:
                errors.append(e)
        threads = [threading.Thread(target=one, args=(r, f), name=f"send-h{r}")
                   for r, f in frames_by_rank.items() if f]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results

    def link_drops(self) -> dict[str, int]:
        """Frames dropped on purpose on each mirror link so far: the injected loss,
        counted by the mirror port's qdisc (netem, or clsact for the drop filter)."""
        with IPRoute(netns=self.switch_ns, flags=0) as ipr:
            ports = {l["index"]: l.get_attr("IFLA_IFNAME") for l in ipr.get_links()}
            drops = defaultdict(int)
            for q in ipr.get_qdiscs():
                drops[ports.get(q["index"])] += (q.get_attr("TCA_STATS") or {}).get("drop", 0)
        return {m.name: drops.get(m.port, 0) for m in self.mirrors}

    def exists(self) -> bool:
        return all(os.path.exists(os.path.join(NETNS_RUN_DIR, n)) for n in self.namespaces)

    def status(self) -> dict:
        return lab_status(self.prefix, exact=True)


def _ifname_ok(name: str) -> bool:
    return 0 < len(name) < 16 and re.fullmatch(r"[A-Za-z0-9_.-]+", name) is not None


# -- by prefix (for the script and for leftovers) -----------------------------------
def lab_namespaces(prefix: str = "ckl", exact: bool = False) -> list[str]:
    """Namespaces of the lab named `prefix` (exact), or of every lab whose name starts
    with `prefix`: <name>-sw, <name>-ck, <name>-h<N>.  NetLab's own unique names start
    with "ckl", so lab_namespaces() finds every leftover of tests and scripts."""
    try:
        names = pr_netns.listnetns()
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        if not ROLES.search(n):
            continue
        lab = ROLES.sub("", n)
        if lab == prefix or (not exact and lab.startswith(prefix)):
            out.append(n)
    return sorted(out)


def remove_namespaces(names: list[str]) -> list[str]:
    gone = []
    for n in names:
        if os.path.exists(os.path.join(NETNS_RUN_DIR, n)):
            pr_netns.remove(n)
            gone.append(n)
    return gone


def down(prefix: str = "ckl", exact: bool = False) -> list[str]:
    """Remove the lab `prefix` (exact) or every lab starting with it: the namespaces,
    and with them all interfaces, the bridge, tc rules and qdiscs inside."""
    return remove_namespaces(lab_namespaces(prefix, exact))


def lab_status(prefix: str = "ckl", exact: bool = False) -> dict:
    """Per namespace: interfaces (name, state, mtu, rx/tx packets and drops); for switch
    namespaces also the mirror rules and the clsact / netem qdiscs with their drops."""
    out = {}
    for ns in lab_namespaces(prefix, exact):
        with IPRoute(netns=ns, flags=0) as ipr:
            links = []
            for l in ipr.get_links():
                st = l.get_attr("IFLA_STATS64") or {}
                links.append({"ifname": l.get_attr("IFLA_IFNAME"), "state": l.get_attr("IFLA_OPERSTATE"),
                              "mtu": l.get_attr("IFLA_MTU"), "rx_packets": st.get("rx_packets"),
                              "tx_packets": st.get("tx_packets"), "rx_dropped": st.get("rx_dropped"),
                              "tx_dropped": st.get("tx_dropped")})
            entry = {"links": links}
            if ns.endswith("-sw"):
                entry["mirrors"] = [r.as_dict() for r in list_mirrors(netns=ns)]
                names = {l["index"]: l.get_attr("IFLA_IFNAME") for l in ipr.get_links()}
                entry["qdiscs"] = [_qdisc(q, names) for q in ipr.get_qdiscs()
                                   if q.get_attr("TCA_KIND") in ("netem", "clsact")]
            out[ns] = entry
    return out


def _qdisc(q, names) -> dict:
    st = q.get_attr("TCA_STATS") or {}
    return {"ifname": names.get(q["index"]), "kind": q.get_attr("TCA_KIND"),
            "packets": st.get("packets"), "drops": st.get("drop")}
