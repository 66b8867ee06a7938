"""A job's ring, nodes and NICs read from its `NCCL_DEBUG=INFO` output.

Nobody should hand-write rings: NCCL prints them. The lines read here, and where
NCCL prints them (the formats are the same at v2.19.4-1, v2.27.5-1 and v2.29.3-1
unless noted):

  prefix        "host:pid:tid [cudaDev] NCCL INFO " (src/debug.cc:179@v2.19.4-1,
                :352-366@v2.27.5-1, :370-382@v2.29.3-1); lines without it (the
                continuation lines of the Func/Proto/Algo matrix, application
                output) are skipped. The host names the node.
  version       "NCCL version 2.27.5+cuda12.9" (init.cc:471 VERSION_STRING@v2.19.4-1,
                printed bare on stdout or as an INFO line)
  rings         "Channel 00/04 :    0   1 ..." by rank 0 (graph/rings.cc:35@v2.19.4-1,
                " %3d" per rank, at most 20 ranks); "Channel 00/04 : 0 1 ..."
                (rings.cc:41@v2.27.5-1, rings.cc:47@v2.29.3-1, width of nranks-1,
                cut with "..." at 128 characters). A cut ring is rebuilt from the
                NCCL_GRAPH lines "Ring 00 : 7 -> 0 -> 1" every rank prints
                (init.cc:1074@v2.19.4-1).
  ranks         "... rank 3 nranks 8 cudaDev 3 nvmlDev 3 busId 8a000 ... - Init COMPLETE"
                (init.cc:1412@v2.19.4-1, :1469@v2.27.5-1, :1692@v2.29.3-1)
  nodes         "comm 0x.. rank 0 nRanks 8 nNodes 2 localRanks 4 localRank 0 MNNVL 0"
                (init.cc:998@v2.27.5-1, :1220@v2.29.3-1; absent in 2.19: counted from hosts)
  channels      "4 coll channels, 0 nvls channels, 4 p2p channels, ..." (init.cc:1145@v2.19.4-1);
                "4 coll channels, 4 collnet channels, 0 nvls channels, ..." (init.cc:1232@v2.27.5-1)
  prefix (2)    a launcher's in front of NCCL's: torchrun's "[default0]:" (--tee, or
                --log-dir's console), Slurm's "0: " (srun -l), "[1,0]<stdout>:" (mpirun
                --tag-output)
  settings      "NCCL_ALGO set by environment to Ring", "NCCL_PROTO set by environment to
                Simple" (graph/tuning.cc:256-261@v2.19.4-1, :398-403@v2.27.5-1),
                "NCCL_COLLNET_ENABLE set by environment to 1." (init.cc:899@v2.19.4-1),
                "NCCL_IB_ADAPTIVE_ROUTING set by environment to 1.", "NCCL_IB_AR_THRESHOLD ..."
                (ncclLoadParam, misc/param.cc:75@v2.19.4-1): RingConfig's adaptive_routing and
                ar_threshold (schedule.ib_ar_settings); the same for NCCL_NTHREADS,
                NCCL_BUFFSIZE, NCCL_IB_QPS_PER_CONNECTION and NCCL_IB_SPLIT_DATA_ON_QPS
                (RingConfig's max_threads, buffsize, qps_per_connection,
                split_data_on_qps: each changes the messages on the wire), and
                NCCL_LL128_NTHREADS, which a plan cannot say (refused with LL128)
  link layer    "NET/IB : Using [0]mlx5_0:1/RoCE [1]mlx5_1:1/IB ..." (net_ib.cc ncclIbInit):
                a device on an InfiniBand link layer carries no RoCEv2 (no UDP/IP on
                the wire), and "via NET/Socket/k" hops are TCP: both refused
  network hops  "Channel 00/0 : 3[3] -> 4[0] [send] via NET/IB/0(0)/GDRDMA" and
                "... [receive] via NET/IB/0/GDRDMA" (transport/net.cc:194-233@v2.19.4-1,
                :218-264@v2.27.5-1, :316-362@v2.29.3-1): the NCCL net device each end
                of a network hop uses; "(P)" is the PXN proxy rank whose NIC it is.
                The receiver always uses its own NIC (net.cc:224@v2.19.4-1).

"Trees [0] ..." lines are printed for every communicator (init.cc:1077@v2.19.4-1)
whether or not Tree ever runs, so they decide nothing; NCCL_ALGO does (with the NVLS
and CollNet channel counts), through ckptd.core.algorithms.

  merged NICs   2.20-2.23: "NET/IB : Using [0]={[0] mlx5_0:1/RoCE, [1] mlx5_1:1/RoCE} ..." (a
                "[d]={...}" group per device merged from several ports, net_ib.cc:311-330@v2.20.5-1,
                :519-538@v2.21.5-1, :571-590@v2.22.3-1, :650-669@v2.23.4-1); 2.24+: "NET/IB : Made
                virtual device [1] name=mlx5_0+mlx5_1 speed=400000 ndevs=2" (net_ib.cc:540@v2.24.3-1,
                :595@v2.27.7-1, net_ib/init.cc:190@v2.29.7-1; 2.30 adds " rail=%d plane=%d",
                init.cc:259@v2.30.7-1; printed with ndevs=1 for every plain device too). A log
                with a merged device is refused: --nic-addrs gives one address per device, and
                a merged device's QPs use every port's (plan ranks[].ports, by hand).

NIC addresses are not in the log (NET/IB devices are named, their RoCE GIDs are not):
the caller gives each host's NIC addresses in NCCL device order.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

from ckptd.core.algorithms import allreduce_protocol, check_allreduce_algorithm
from ckptd.core.plan import MAX_RANKS
from ckptd.core.schedule import LL128_MAX_THREADS, ScheduleError, ib_ar_settings
from ckptd.errors import CkptdError, show

PREFIX = re.compile(r"^(?:\[[^\]]*\](?:<\w+>)?:? ?|\d+: )?(?P<host>[^\s:]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] NCCL INFO (?P<msg>.*)$")
VERSION = re.compile(r"NCCL version (\d+)\.(\d+)\.(\d+)\S*")
RING = re.compile(r"^Channel (\d+)/(\d+) :((?: +\d+)+)( *\.\.\.)?\s*$")
RING_GRAPH = re.compile(r"^Ring (\d+) : (\d+) -> (\d+) -> (\d+)$")
COMPLETE = re.compile(r"\brank (\d+) nranks (\d+) cudaDev (\d+) nvmlDev \d+ busId ([0-9a-f]+) .*- Init COMPLETE$")
NODES = re.compile(r"\brank (\d+) nRanks (\d+) nNodes (\d+) localRanks (\d+) localRank (\d+)")
CHANNELS = re.compile(r"^(\d+) coll channels, (?:(\d+) collnet channels, )?(\d+) nvls channels")
SETTING = re.compile(r"^(NCCL_ALGO|NCCL_PROTO|NCCL_COLLNET_ENABLE|NCCL_IB_ADAPTIVE_ROUTING|NCCL_IB_AR_THRESHOLD|"
                     r"NCCL_NTHREADS|NCCL_BUFFSIZE|NCCL_IB_QPS_PER_CONNECTION|NCCL_IB_SPLIT_DATA_ON_QPS|"
                     r"NCCL_LL128_NTHREADS|NCCL_PAT_ENABLE) set by environment to (\S+?)\.?$")
USING_DEV = re.compile(r" \[(\d+)\][^:\s\[]+:\d+/(IB|RoCE)\b")
MERGED_USING = re.compile(r"^NET/IB : Using.*? \[(\d+)\]=\{([^}]*)\}")
MERGED_VDEV = re.compile(r"^NET/IB : Made virtual device \[(\d+)\] name=(\S+) speed=\d+ ndevs=(\d+)")
NET = re.compile(r"^Channel (\d+)/\d+ : (\d+)\[\d+\] -> (\d+)\[\d+\] \[(send|receive)\] via NET/([^/]+)/(\d+)(?:\((\d+)\))?")


class NcclLogError(CkptdError, ValueError):
    """An NCCL log that does not describe one ring communicator completely."""


MAX_HOST = 255     # a host name (RFC 1035: 253 characters); longer is no NCCL line
MAX_SETTING = 256  # an NCCL_* value as logged (NCCL_ALGO="allreduce:ring;..." stays far below)


@dataclass
class NcclJob:
    """What one communicator's INFO lines say about its ring allreduce."""

    version: tuple[int, int, int] | None = None
    nranks: int | None = None
    nnodes: int | None = None
    local_ranks: dict[int, int] = field(default_factory=dict)  # rank -> localRanks it printed
    rings: dict[int, tuple[int, ...]] = field(default_factory=dict)
    nrings: int | None = None
    graph_next: dict[int, dict[int, int]] = field(default_factory=dict)  # channel -> rank -> next
    coll_channels: int | None = None
    nvls_channels: int | None = None
    settings: dict[str, str] = field(default_factory=dict)
    host: dict[int, str] = field(default_factory=dict)  # rank -> host
    cuda_dev: dict[int, int] = field(default_factory=dict)
    bus_id: dict[int, str] = field(default_factory=dict)
    said: dict[str, str] = field(default_factory=dict)  # _agree's values -> "file:line" that first said it
    # (channel, sender, receiver) -> {"send": (dev, proxy rank or None), "receive": (dev, None)}
    net: dict[tuple[int, int, int], dict[str, tuple[int, int | None]]] = field(default_factory=dict)
    ib_link: dict[tuple[str, int], str] = field(default_factory=dict)  # (host, NET/IB device) -> "file:line"
    not_ib: str | None = None  # "file:line: NET/Socket" of the first hop over another NCCL net


def parse_nccl_log(text: str, where: str = "log", job: NcclJob | None = None) -> NcclJob:
    """What the lines of one log say, added to `job` (a fresh one without): a job's logs
    (one per host, or per rank) are parsed one by one into the same NcclJob, so an error
    names the file it is in and the line within that file."""
    job = NcclJob() if job is None else job
    for lineno, raw in enumerate(text.splitlines(), 1):
        try:
            _parse_line(job, raw, where, lineno)
        except NcclLogError:
            raise
        except ValueError as e:  # _num's names the number; any other ValueError, its own cause
            raise NcclLogError(f"{where}:{lineno}: {e}") from None
    return job


MAX_DIGITS = 12  # ranks, channels, devices, versions: far fewer; a longer number is no NCCL line


def _num(digits: str) -> int:
    """int() of a log's digits, refused (ValueError) past MAX_DIGITS: a huge value would
    make messages of thousands of digits (or, past 4300, int() itself raise)."""
    if len(digits) > MAX_DIGITS:
        raise ValueError(f"a number of more than {MAX_DIGITS} digits: {digits[:20]}... ({len(digits)} digits), "
                         "not a line NCCL printed")
    return int(digits)


def _parse_line(job: NcclJob, raw: str, where: str, lineno: int):
    m = VERSION.search(raw)
    if m and job.version is None:
        job.version = tuple(_num(x) for x in m.groups())
    p = PREFIX.match(raw.rstrip())
    if not p:
        return
    host, msg = p["host"], p["msg"].rstrip()
    if len(host) > MAX_HOST:  # every message naming it stays one short line
        raise NcclLogError(f"{where}:{lineno}: host name of {len(host)} characters "
                           f"({host[:40]!r}...): not a line NCCL printed")
    if (m := RING.match(msg)):
        c, n = _num(m[1]), _num(m[2])
        if m[4]:
            return  # cut at 128 characters: rebuilt from the Ring lines
        ranks = tuple(_num(x) for x in m[3].split())
        if c in job.rings and job.rings[c] != ranks:
            raise NcclLogError(f"{where}:{lineno}: a second ring for channel {c}: the log holds "
                               "several communicators; give the log of the data-parallel one")
        job.rings[c] = ranks
        job.nrings = n
    elif (m := RING_GRAPH.match(msg)):
        job.graph_next.setdefault(_num(m[1]), {})[_num(m[3])] = _num(m[4])
    elif (m := COMPLETE.search(msg)):
        r = _num(m[1])
        _agree(job, "nranks", _num(m[2]), where, lineno)
        job.host[r], job.cuda_dev[r], job.bus_id[r] = host, _num(m[3]), m[4]
    elif (m := NODES.search(msg)):
        _agree(job, "nranks", _num(m[2]), where, lineno)
        _agree(job, "nnodes", _num(m[3]), where, lineno)
        job.host.setdefault(_num(m[1]), host)
        job.local_ranks[_num(m[1])] = _num(m[4])
    elif (m := CHANNELS.match(msg)):
        _agree(job, "coll_channels", _num(m[1]), where, lineno)
        _agree(job, "nvls_channels", _num(m[3]), where, lineno)
    elif (m := SETTING.match(msg)):
        if len(m[2]) > MAX_SETTING:
            raise NcclLogError(f"{where}:{lineno}: {m[1]} set to a value of {len(m[2])} characters "
                               f"({m[2][:40]!r}...): not a setting NCCL takes")
        job.settings[m[1]] = m[2]
    elif msg.startswith("NET/IB : Using") and (devs := USING_DEV.findall(msg)) and \
            not MERGED_USING.match(msg):
        for dev, layer in devs:
            if layer == "IB":
                job.ib_link.setdefault((host, _num(dev)), f"{where}:{lineno}")
    elif (m := MERGED_USING.match(msg)) or ((m := MERGED_VDEV.match(msg)) and _num(m[3]) > 1):
        what = (f"device [{m[1][:12]}] = {{{m[2][:80]}}}" if m.re is MERGED_USING
                else f"virtual device [{m[1][:12]}] {m[2][:80]} of {m[3]} ports")
        raise NcclLogError(
            f"{where}:{lineno}: NCCL merged NIC ports into one net device on {host} ({what}): "
            "--nic-addrs maps a device to one address, and a merged device's QPs use every port's; "
            "write each rank's ranks[].ports into the plan by hand (docs/PLAN.md), or run the job "
            "unmerged (NCCL_IB_MERGE_NICS=0 up to 2.23, NCCL_NET_MERGE_LEVEL=LOC from 2.24)")
    elif (m := NET.match(msg)):
        c, s, d, kind, net, dev, proxy = _num(m[1]), _num(m[2]), _num(m[3]), m[4], m[5], _num(m[6]), m[7]
        if net != "IB" and job.not_ib is None:
            job.not_ib = f"{where}:{lineno}: channel {c} hop {s} -> {d} goes via NET/{net[:20]}"
        job.net.setdefault((c, s, d), {})[kind] = (dev, None if proxy is None else _num(proxy))
        job.host.setdefault(s if kind == "send" else d, host)


def _agree(job: NcclJob, name: str, value: int, where: str, lineno: int):
    old = getattr(job, name)
    if old is not None and old != value:  # (the first may be in another of the job's logs)
        raise NcclLogError(f"{where}:{lineno}: {name} {value} where {job.said[name]} said {old}: "
                           "the log holds several communicators; give the log of the data-parallel one")
    if old is None:
        job.said[name] = f"{where}:{lineno}"
    setattr(job, name, value)


@dataclass(frozen=True)
class RingTopology:
    """The plan's ring and ranks section, as read from a log."""

    nccl_version: tuple[int, int]
    protocol: str
    rings: tuple[tuple[int, ...], ...]
    addresses: tuple[str, ...]  # rank -> its own NIC
    nodes: tuple[str, ...]  # rank -> host
    channel_nics: tuple[tuple[str, ...], ...]  # rank -> channel -> NIC address
    settings: dict = field(default_factory=dict)  # RingConfig's keyword arguments the log sets (ring_settings)
    nccl_env: dict = field(default_factory=dict)  # NCCL_* -> value, as the log shows them set


def ring_topology(job: NcclJob, nic_addrs: dict[str, list[str]], where: str = "log") -> RingTopology:
    """The ring, nodes and NICs of the job, refusing what is not one ring allreduce.

    nic_addrs: host -> its NICs' addresses in NCCL's device order (NET/IB/k is the k-th)."""
    if job.version is None:
        raise NcclLogError(f"{where}: no 'NCCL version' line (run the job with NCCL_DEBUG=INFO)")
    if job.nranks is None:
        raise NcclLogError(f"{where}: no '- Init COMPLETE' line: how many ranks the job has is unknown")
    n = job.nranks
    if not 1 <= n <= MAX_RANKS:  # set(range(n)) below: a line saying nranks 10**12 must not take the memory
        raise NcclLogError(f"{where}: nranks {n} is not 1..{MAX_RANKS}")
    missing = sorted(set(range(n)) - set(job.host))
    if missing:
        raise NcclLogError(f"{where}: no line of ranks {missing[:8]} names their host: give every rank's log")
    hosts = [job.host[r] for r in range(n)]
    nnodes = len(set(hosts))
    if job.nnodes is not None and job.nnodes != nnodes:
        raise NcclLogError(f"{where}: nNodes {job.nnodes}, but the ranks' lines come from {nnodes} hosts")
    for r, local in sorted(job.local_ranks.items()):
        if hosts.count(hosts[r]) != local:
            raise NcclLogError(f"{where}: rank {r} says localRanks {local}, but {hosts.count(hosts[r])} ranks' "
                               f"lines come from its host {hosts[r]}")
    algo = job.settings.get("NCCL_ALGO")
    # CollNet runs only when NCCL_COLLNET_ENABLE=1, which NCCL then logs (init.cc:897-902@v2.19.4-1,
    # :1566-1571@v2.27.5-1); a ncclConfig_t could enable it without a line, which PyTorch does not do.
    collnet = job.settings.get("NCCL_COLLNET_ENABLE") == "1"
    check_allreduce_algorithm(algo, nnodes=nnodes, nvls_channels=job.nvls_channels, collnet=collnet,
                              where=f"{where}: ")
    protocol = allreduce_protocol(job.settings.get("NCCL_PROTO"), where=f"{where}: ")
    if job.not_ib:
        raise NcclLogError(f"{job.not_ib}: NCCL's TCP socket transport, not RoCE; ckptd decodes RoCEv2 "
                           "(NCCL_IB_DISABLE=1 or no RDMA NIC?)")
    rings = _rings(job, where)
    own: dict[int, str] = {}
    claims: list[tuple[int, int, str]] = []  # (strength, rank, NIC address)
    nics = [[None] * len(rings) for _ in range(n)]

    def addr(host: str, dev: int, what: str) -> str:
        try:
            a = nic_addrs[host][dev]
        except (KeyError, IndexError):
            raise NcclLogError(f"{where}: {what} uses NET device {dev} of host {host}, but the NIC addresses "
                               f"give {len(nic_addrs.get(host, []))} for it") from None
        return str(ipaddress.ip_address(a))

    for c, ring in enumerate(rings):
        for i, s in enumerate(ring):
            d = ring[(i + 1) % n]
            if hosts[s] == hosts[d]:
                if (c, s, d) in job.net:
                    raise NcclLogError(f"{where}: channel {c} hop {s} -> {d} stays on host {hosts[s]} but goes "
                                       "through a NIC (P2P and SHM disabled?); ckptd expects hops inside a node "
                                       "over NVLink/PCIe: unset NCCL_P2P_DISABLE/NCCL_SHM_DISABLE")
                continue
            ends = job.net.get((c, s, d), {})
            if "send" not in ends or "receive" not in ends:
                lacking = " and ".join(k for k in ("send", "receive") if k not in ends)
                raise NcclLogError(f"{where}: channel {c} hop {s} -> {d} crosses hosts but the log has no "
                                   f"'[{lacking}] via NET' line for it: give every rank's log")
            (sdev, proxy), (rdev, _) = ends["send"], ends["receive"]
            for host, dev in ((hosts[s], sdev), (hosts[d], rdev)):
                if (host, dev) in job.ib_link:
                    raise NcclLogError(f"{job.ib_link[host, dev]}: NET/IB device {dev} of {host} (channel {c} hop "
                                       f"{s} -> {d}) is on an InfiniBand link layer, not RoCE: native InfiniBand "
                                       "carries no UDP/IP, so no Ethernet mirror port sees it; ckptd decodes RoCEv2")
            for rank, host, dev in ((s, hosts[s], sdev), (d, hosts[d], rdev)):
                a = addr(host, dev, f"channel {c} hop {s} -> {d}")
                if nics[rank][c] not in (None, a):
                    raise NcclLogError(f"{where}: rank {rank} sends and receives channel {c} through different "
                                       f"NICs ({nics[rank][c]}, {a}); a plan has one NIC per rank and channel")
                nics[rank][c] = a
            # whose NIC it is: a receiver uses its own (net.cc:224@v2.19.4-1), a PXN send the
            # proxy's; a plain send may go through a NIC that is not the sender's nearest
            claims.append((0, d, nics[d][c]))
            claims.append((1, proxy, nics[s][c]) if proxy is not None else (2, s, nics[s][c]))
    for _, r, a in sorted(claims, key=lambda x: x[0]):
        own.setdefault(r, a)
    for r in range(n):
        if r not in own:  # a rank that never touches the network: any NIC of its host names it
            local = sorted(x for x in range(n) if hosts[x] == hosts[r]).index(r)
            devs = nic_addrs.get(hosts[r]) or []
            if not devs:
                raise NcclLogError(f"{where}: no NIC addresses given for host {hosts[r]}")
            own[r] = addr(hosts[r], local % len(devs), f"rank {r}")
    channel_nics = tuple(tuple(a if a is not None else own[r] for a in nics[r]) for r in range(n))
    return RingTopology(job.version[:2], protocol, rings, tuple(own[r] for r in range(n)), tuple(hosts),
                        channel_nics, ring_settings(job, protocol, where), dict(job.settings))


# NCCL integer parameters the log prints when set (ncclLoadParam) -> RingConfig's field;
# -2 is NCCL's "unset" (NCCL_PARAM default), as for the adaptive routing ones
RING_SETTINGS = {"NCCL_NTHREADS": "max_threads", "NCCL_BUFFSIZE": "buffsize",
                 "NCCL_IB_QPS_PER_CONNECTION": "qps_per_connection", "NCCL_IB_SPLIT_DATA_ON_QPS": "split_data_on_qps"}


def ring_settings(job: NcclJob, protocol: str, where: str) -> dict:
    """RingConfig's keyword arguments from the settings the log shows set by the
    environment: each changes how the ring's messages are cut or spread over QPs."""
    try:
        out = ib_ar_settings(job.version[:2], job.settings)
    except ScheduleError as e:
        raise NcclLogError(f"{where}: {e}") from None
    for var, key in RING_SETTINGS.items():
        text = job.settings.get(var)
        if text is None:
            continue
        try:
            value = int(text, 0)
        except ValueError:
            raise NcclLogError(f"{where}: {var}={text!r} is not an integer") from None
        if value != -2:
            out[key] = value != 0 if key == "split_data_on_qps" else value  # (NCCL reads it as a flag)
    ll128 = job.settings.get("NCCL_LL128_NTHREADS")
    if ll128 is not None and protocol == "ll128" and ll128.strip() not in ("-2", str(LL128_MAX_THREADS)):
        raise NcclLogError(f"{where}: NCCL_LL128_NTHREADS={ll128}: LL128 with other than NCCL's "
                           f"{LL128_MAX_THREADS} threads cuts its messages in ways a plan cannot say; "
                           "unset it, or run with NCCL_PROTO=Simple")
    return out


def _rings(job: NcclJob, where: str) -> tuple[tuple[int, ...], ...]:
    n = job.nranks
    count = job.coll_channels or job.nrings or len(job.graph_next)
    if not count:
        raise NcclLogError(f"{where}: no 'Channel NN/NN :' ring lines (they are NCCL_DEBUG_SUBSYS=INIT lines of rank 0)")
    out = []
    for c in range(count):
        ring = job.rings.get(c)
        if ring is None or len(ring) != n:
            nxt = job.graph_next.get(c, {})
            if len(nxt) != n:
                raise NcclLogError(f"{where}: the ring of channel {c} is missing or cut; give rank 0's log whole, "
                                   "or every rank's 'Ring NN :' lines (NCCL_DEBUG_SUBSYS=INIT,GRAPH)")
            ring, r = [0], nxt.get(0)
            while r is not None and r != 0 and len(ring) <= n:  # a next no line names ends it: refused below
                ring.append(r)
                r = nxt.get(r)
            ring = tuple(ring)
        if sorted(ring) != list(range(n)):
            shown = " ".join(map(str, ring[:16])) + (" ..." if len(ring) > 16 else "")
            raise NcclLogError(f"{where}: the ring of channel {c} [{shown}] does not hold ranks 0..{n - 1} once each")
        out.append(ring)
    return tuple(out)


MAX_NIC_ADDRS_BYTES = 16 << 20  # a NIC address map larger than this is not one
MAX_NCCL_LOG_BYTES = 1 << 30  # nor an NCCL log (its set-up lines are a few MB for 65536 ranks)


def load_nic_addrs(path: str) -> dict[str, list[str]]:
    """host -> NIC addresses in NCCL device order, from a JSON or YAML file."""
    import yaml

    from ckptd.core.docload import strict_json, strict_yaml
    from ckptd.core.readfile import read_bounded
    try:
        # bounded, and a FIFO nobody writes into is an error after a wait (read_text() hung)
        text = read_bounded(path, MAX_NIC_ADDRS_BYTES, "NIC addresses").decode()
    except (OSError, UnicodeDecodeError) as e:
        raise NcclLogError(f"{path}: cannot read NIC addresses: {(e.strerror or e) if isinstance(e, OSError) else e}") from e
    try:
        doc = strict_json(text) if path.endswith(".json") else strict_yaml(text)
    except (ValueError, RecursionError, yaml.YAMLError) as e:  # ValueError: also an int over 4300 digits
        raise NcclLogError(f"{path}: cannot read NIC addresses: {str(e)[:200]}") from e
    if not isinstance(doc, dict):
        raise NcclLogError(f"{path}: expected a map host -> list of NIC addresses in NCCL device order, "
                           f"not {show(doc)}")
    out = {}
    owner: dict[str, str] = {}  # address -> the host (and index) that lists it
    for host, addrs in doc.items():
        # every value is shown short (show): a YAML alias bomb must not be walked by repr or str
        if not isinstance(host, (str, int)) or isinstance(host, int) and host.bit_length() > 64:
            raise NcclLogError(f"{path}: host {show(host)} is not a host name")
        if not isinstance(addrs, list):
            raise NcclLogError(f"{path}: host {show(host)}: expected a list of NIC addresses in NCCL device "
                               f"order, not {show(addrs)}")
        for i, a in enumerate(addrs):
            try:
                if not isinstance(a, str):
                    raise ValueError(a)
                ipaddress.ip_address(a)
            except ValueError:
                raise NcclLogError(f"{path}: host {show(host)}: NIC address [{i}] {show(a)} is not an "
                                   "IPv4 or IPv6 address") from None
            ip = ipaddress.ip_address(a)
            if getattr(ip, "scope_id", None):
                raise NcclLogError(f"{path}: host {show(host)}: NIC address [{i}] {show(a)} has a zone "
                                   f"(%{ip.scope_id}), which no packet carries: give the address alone")
            # one NIC per address: the plan tells ranks and channels apart by it
            if str(ip) in owner:
                raise NcclLogError(f"{path}: host {show(host)}: NIC address [{i}] {a} is also {owner[str(ip)]}: "
                                   "every NIC has an address of its own")
            owner[str(ip)] = f"host {show(host)}'s [{i}]"
        out[str(host)] = list(addrs)
    families = {ipaddress.ip_address(a).version for addrs in out.values() for a in addrs}
    if len(families) > 1:
        raise NcclLogError(f"{path}: NIC addresses of both IPv4 and IPv6: a job's RoCE GIDs are all of the one "
                           "kind NCCL_IB_GID_INDEX (or NCCL_IB_ADDR_FAMILY) picks; give them all as that kind")
    return out
