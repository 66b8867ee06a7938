"""The collective schedule: what every directed ring link carries, message by message.

Given the ring configuration and the gradient buckets of one iteration, `RingSchedule`
lists for every connection (sender rank -> receiver rank, channel) the NCCL sends in
the order the sender issues them, and for every QP of that connection the RDMA
messages those sends become on the wire: their lengths, their immediates, how many
PSNs they use, and which bucket elements their payload is (reduce-scatter partial
sums, ignored downstream, or allgather final values, which are the gradient).

Each rule names the NCCL source it follows; the sources were read at tags v2.19.4-1
and v2.20.5-1 of NVIDIA/nccl. The same schedule drives the synthesizer (which writes
what NCCL would send) and the extractor (which reads it back), so a wrong rule here is
caught only by real traffic: tests/test_flowcheck_allreduce.py checks it against the
FlowCheck captures taken on real NICs.
"""
from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np
from ckptd.errors import CkptdError

NCCL_STEPS = 8  # src/include/device.h
WARP_SIZE = 32
# Default per-protocol buffer sizes, src/init.cc DEFAULT_{LL,LL128,SIMPLE}_BUFFSIZE.
DEFAULT_BUFFSIZE = {"simple": 4 << 20, "ll": 524288, "ll128": 4915200}
# src/include/comm.h NCCL_{SIMPLE,LL}_THREAD_THRESHOLD; ring LL is scaled by nRanks
# in src/graph/tuning.cc ncclTopoTuneModel.
THREAD_THRESHOLD = {"simple": 64, "ll": 8, "ll128": 8}
# LL128 runs 640 threads (NCCL_LL128_MAX_NTHREADS, comm.h:36-38@v2.22.3); NCCL_LL128_NTHREADS
# overrides it in the job, which a plan cannot say yet.
LL128_MAX_THREADS = 640
ALLREDUCE_CHUNKSTEPS = NCCL_STEPS // 2  # src/include/collectives.h
ALLREDUCE_SLICESTEPS = NCCL_STEPS // 4
# A ring broadcast sends every chunk as one step, one slice (include/collectives.h:21-22@v2.22.3-1,
# 27-28@v2.30.7-1): calcCollChunking's Simple chunk is then one step, not four.
BROADCAST_CHUNKSTEPS = 1
BROADCAST_SLICESTEPS = 1
# A ring allgather cuts chunks and slices like the allreduce (include/collectives.h:17-18@v2.22.3-1,
# 21-22@v2.30.7-1): ProtoSimple<ALLGATHER_CHUNKSTEPS/ALLGATHER_SLICESTEPS, ALLGATHER_SLICESTEPS>.
ALLGATHER_CHUNKSTEPS = NCCL_STEPS // 2
ALLGATHER_SLICESTEPS = NCCL_STEPS // 4
SIMPLE_SLICES_PER_CHUNK = ALLREDUCE_CHUNKSTEPS // ALLREDUCE_SLICESTEPS
IB_SPLIT_ALIGN = 128  # src/transport/net_ib.cc ncclIbMultiSend: "multiples of 128B"
# NCCL_IB_AR_THRESHOLD default: a send larger than this goes as RDMA WRITE + 0-byte
# WRITE_WITH_IMM where adaptive routing applies (net_ib.cc:81,969@v2.14.3-1, 89,1623@v2.22.3-1;
# net_ib/p2p.cc:18,142@v2.29.7-1; 2.30's default -2 means the same 8192, init.cc:475-482@v2.30.7-1).
IB_AR_THRESHOLD = 8192
# Below this a data WRITE could be the length of a clear-to-send write (cts_bytes, at most 64):
# the decoder could not tell them apart, so a plan may not ask for it.
MIN_AR_THRESHOLD = 64
LL_LINE = 16  # union ncclLLFifoLine: {u32 data1, u32 flag1, u32 data2, u32 flag2}
LL_DATA_PER_LINE = 8
# LL128 (device/prims_ll128.h@v2.22.3): a warp writes 2048 wire bytes (16 lines of 16 u64,
# word 15 of each the flag) for every 1920 data bytes; docs/NCCL.md section 3.
LL128_LINE = 128
LL128_BLOCK = 2048
LL128_DATA_PER_BLOCK = 1920

RS, AG = 0, 1  # phase of a send: reduce-scatter partial sum, or allgather final value
PHASE_NAMES = ("reduce-scatter", "allgather")


class ScheduleError(CkptdError, ValueError):
    """The plan asks for a collective this schedule cannot describe exactly."""



NCCL_VERSIONS = ((2, 14), (2, 32))  # the ring layouts RingConfig implements (docs/NCCL.md)


def parse_nccl_version(text) -> tuple[int, int]:
    """MAJOR.MINOR ("2.19") as (2, 19); ValueError for anything else (ASCII digits only:
    int() takes other scripts' digits and fails on '2.²'; no leading zero: "2.020" is
    not how a version is written, and would read 2.20)."""
    m = re.fullmatch(r"(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})", str(text))
    if m is None:
        raise ValueError(f"{str(text)[:40]!r} is not MAJOR.MINOR (e.g. 2.19)")
    return int(m[1]), int(m[2])

@dataclass(frozen=True)
class RingConfig:
    """How the job's NCCL communicator runs its ring allreduce.

    rings[c] lists the ranks in ring order for channel c (the order data flows).
    channels is the communicator's channel count; NCCL's tuner may use fewer for a
    small collective (`tune`). max_threads is NCCL_NTHREADS as the tuner sees it
    (512 unless the job changed it, 256 for Simple on PCIe-bound rings).
    """

    nranks: int
    rings: tuple[tuple[int, ...], ...]
    protocol: str = "simple"
    nccl_version: tuple[int, int] = (2, 19)
    max_threads: int = 512
    buffsize: int | None = None
    qps_per_connection: int = 1
    split_data_on_qps: bool | None = None
    mtu: int = 4096
    # Ports of the merged NIC (NCCL_IB_MERGE_NICS, ncclIbMergedDev / vProps.ndevs) behind
    # every rank's net device: the plan's ranks[].ports (Plan.ports), the same on every NIC.
    ndevs: int = 1
    adaptive_routing: bool | None = None
    ar_threshold: int = IB_AR_THRESHOLD

    def __post_init__(self):
        if self.protocol not in ("simple", "ll", "ll128"):
            raise ScheduleError(f"unknown NCCL protocol {self.protocol!r} (expected simple, ll or ll128)")
        if not (NCCL_VERSIONS[0] <= tuple(self.nccl_version) <= NCCL_VERSIONS[1]):
            raise ScheduleError(
                f"NCCL {self.nccl_version[0]}.{self.nccl_version[1]} is not supported: the ring "
                "layout is implemented for 2.14-2.19 (channels interleaved), 2.20-2.21 "
                "(contiguous per channel) and 2.22-2.32 (ncclCollCbdPart cells; docs/NCCL.md)")
        if self.nranks < 2:
            raise ScheduleError("a ring needs at least 2 ranks")
        for c, ring in enumerate(self.rings):
            if sorted(ring) != list(range(self.nranks)):
                raise ScheduleError(f"ring of channel {c} is {list(ring)}: it must list each of "
                                    f"ranks 0..{self.nranks - 1} exactly once")
        if self.mtu not in (256, 512, 1024, 2048, 4096):
            raise ScheduleError(f"path MTU {self.mtu} is not an IB MTU (256..4096)")
        if self.qps_per_connection < 1:
            raise ScheduleError("qps_per_connection must be at least 1")
        if self.ndevs < 1:
            raise ScheduleError("ndevs (ports of a merged NIC) must be at least 1")
        if self.ndevs > 1 and tuple(self.nccl_version) < (2, 20):
            raise ScheduleError(
                f"merged NICs ({self.ndevs} ports) with NCCL {self.nccl_version[0]}.{self.nccl_version[1]}: "
                "net_ib merges ports only from 2.20 (ncclIbMergedDev, net_ib.cc:47,108@v2.20.5-1)")
        most = 2 if tuple(self.nccl_version) < (2, 24) else 4
        if self.ndevs > most:
            raise ScheduleError(
                f"a merged NIC of {self.ndevs} ports with NCCL {self.nccl_version[0]}.{self.nccl_version[1]}: "
                f"NCCL_IB_MAX_DEVS_PER_NIC is {most} (net_ib.cc:45@v2.21.5-1, @v2.24.3-1)")
        if self.split_data_on_qps is False and tuple(self.nccl_version) < (2, 18):
            raise ScheduleError(
                f"split_data_on_qps false with NCCL {self.nccl_version[0]}.{self.nccl_version[1]}: "
                "NCCL_IB_SPLIT_DATA_ON_QPS exists only from 2.18; before, every send is split over "
                "all QPs (net_ib.cc:984@v2.14.3-1)")
        if self.adaptive_routing is False and tuple(self.nccl_version) < (2, 16):
            raise ScheduleError(
                f"adaptive_routing false with NCCL {self.nccl_version[0]}.{self.nccl_version[1]}: "
                "NCCL_IB_ADAPTIVE_ROUTING exists only from 2.16; before, every send over the AR threshold "
                "is a WRITE + 0-byte WRITE_WITH_IMM (net_ib.cc:969@v2.14.3-1)")
        if not MIN_AR_THRESHOLD <= self.ar_threshold < 1 << 31:
            raise ScheduleError(f"ar_threshold {self.ar_threshold}: NCCL_IB_AR_THRESHOLD from "
                                f"{MIN_AR_THRESHOLD} (a smaller write could be a clear-to-send) to 2^31-1")

    @property
    def channels(self) -> int:
        return len(self.rings)

    @property
    def interleaved(self) -> bool:
        """NCCL <= 2.19 walks the whole buffer on every channel, chunks interleaved."""
        return tuple(self.nccl_version) <= (2, 19)

    @property
    def split(self) -> bool:
        """Whether each send is cut into one part per QP. 2.14-2.17 always do it (the
        QP loop in ncclIbMultiSend, net_ib.cc:984@v2.14.3-1, 1003@v2.17.1-1);
        NCCL_IB_SPLIT_DATA_ON_QPS arrives in 2.18 (net_ib.cc:967@v2.18.6-1), default 1
        in 2.18-2.19 and 0 from 2.20."""
        if tuple(self.nccl_version) < (2, 18):
            return True
        if self.split_data_on_qps is not None:
            return self.split_data_on_qps
        return tuple(self.nccl_version) <= (2, 19)

    @property
    def ar_writes(self) -> bool:
        """Whether a send over ar_threshold (NCCL_IB_AR_THRESHOLD) goes as RDMA WRITE of the
        data then a 0-byte WRITE_WITH_IMM. 2.14-2.15 do it whatever the link layer
        (net_ib.cc:969@v2.14.3-1, @v2.15.5-1); from 2.16 only with adaptive routing, the
        sender's `comm->ar` (net_ib.cc:979@v2.16.5-1, 1623@v2.22.3-1; net_ib/p2p.cc:142@v2.29.7-1):
        every merged NIC's `ar`, 1 on an IB link layer and 0 on RoCE unless
        NCCL_IB_ADAPTIVE_ROUTING (default -2: unset) says otherwise (net_ib.cc:84,237-238@v2.16.5-1,
        91,507-508,1078-1082@v2.22.3-1; net_ib/init.cc:11,343-344@v2.29.7-1). ckptd reads RoCE, so
        adaptive_routing None is off. Not modelled: 2.30's exception when both ends have
        NCCL_IB_OOO_RQ (net_ib/p2p.cc:131-132@v2.30.7-1, default off)."""
        return tuple(self.nccl_version) <= (2, 15) or bool(self.adaptive_routing)

    @property
    def cts_bytes(self) -> int:
        """Size of the clear-to-send RDMA write (one ncclIbSendFifo entry for a
        collective): 32 B up to 2.19 (net_ib.cc:408-415,435@v2.14.3-1), 64 B from 2.20
        (net_ib.cc:45,794@v2.22.3-1; net_ib/common.h:229@v2.29.7-1, 58,245@v2.30.7-1)."""
        return 32 if tuple(self.nccl_version) < (2, 20) else 64

    @property
    def data_qps(self) -> int:
        """QPs of one connection: NCCL_IB_QPS_PER_CONNECTION per port of the merged NIC
        (net_ib.cc:1000@v2.21.5-1 local ndevs; 2.24+ max(local, remote) ndevs,
        net_ib.cc:1232-1234@v2.24.3-1, net_ib/connect.cc:588-591@v2.29.7-1; ckptd needs
        the same port count on every NIC, so both are ndevs)."""
        return self.qps_per_connection * self.ndevs

    @property
    def parts_per_send(self) -> int:
        """QPs one send is cut over: every QP with split, else one per port
        (net_ib.cc:1644@v2.22.3-1 `ndevs`; 2.24+ nDataQps = max(local, remote) ndevs,
        net_ib.cc:1390,1899@v2.24.3-1; net_ib/common.h:354-358@v2.29.7-1)."""
        return self.data_qps if self.split else self.ndevs

    def port_of_qp(self, qp: int) -> int:
        """The merged NIC's port QP `qp` of a connection uses, at both ends: QPs are
        created striped over the ports, devIndex = q % ndevs, and QP q of the sender is
        connected to QP q of the receiver (net_ib.cc:1015-1027,1130-1136,1245-1258@v2.21.5-1;
        net_ib.cc:1248-1264,1361-1366,1570-1584@v2.24.3-1; net_ib/connect.cc:445,500,832-842@v2.29.7-1)."""
        return qp % self.ndevs

    def cts_qp(self, send_index: int) -> int:
        """The QP (index, reversed: receiver -> sender) that carries the clear-to-send of
        the connection's send number `send_index`. 2.14-2.19: qps[0] (net_ib.cc:1219@v2.19.4-1);
        2.20-2.28: qps[devIndex], devIndex +1 mod the receiver's ndevs per posted receive
        (net_ib.cc:1790-1791@v2.22.3-1, 2046-2047@v2.24.3-1); 2.29+: the first QP of device
        id % ndevs, id the receive counter (net_ib/p2p.h:20-27@v2.29.7-1, common.h:311-313),
        i.e. qps[id % ndevs] again. One receive per send, counted like send_index."""
        return send_index % self.ndevs

    @property
    def rotation_modulus(self) -> int:
        """qp_of_part depends on send_index only modulo this: 1 where every send is
        split over all QPs from QP 0 (2.14-2.28 with split), the QP count otherwise."""
        if tuple(self.nccl_version) < (2, 29) and self.split:
            return 1
        return self.data_qps

    def qp_of_part(self, send_index: int, part: int, nparts: int) -> int:
        """The QP that carries part `part` of the connection's send number `send_index`
        (counted from the connection's first send, over all collectives).

        <= 2.28: a rotating index kept on the connection, `qpIndex`, advanced by one per
        QP post and never reset between collectives (net_ib.cc:1572-1613@v2.21.5-1,
        1644-1688@v2.22.3-1; 2.14-2.17 have no index and post part q on QP q,
        net_ib.cc:984-998@v2.14.3-1). So the send's first part is on QP
        send_index*nparts mod nqps. 2.29+: part i on QP (req.id + i) % nqps, req.id the
        connection's send counter (net_ib/common.h:325-330,354-358@v2.29.7-1)."""
        nq = self.data_qps
        if tuple(self.nccl_version) >= (2, 29):
            return (send_index + part) % nq
        return (send_index * nparts + part) % nq

    @property
    def imm_big_endian(self) -> bool:
        # net_ib writes the size as host-order immediate up to 2.28 (little-endian on x86).
        return tuple(self.nccl_version) >= (2, 29)

    @property
    def step_bytes(self) -> int:
        return (self.buffsize or DEFAULT_BUFFSIZE[self.protocol]) // NCCL_STEPS

    def ring_index(self, channel: int, rank: int) -> int:
        """ring->index: distance from rank 0 along the ring (src/graph/rings.cc)."""
        ring = self.rings[channel]
        return (ring.index(rank) - ring.index(0)) % self.nranks

    def rank_at(self, channel: int, index: int) -> int:
        ring = self.rings[channel]
        return ring[(ring.index(0) + index) % self.nranks]

    def next_rank(self, channel: int, rank: int) -> int:
        ring = self.rings[channel]
        return ring[(ring.index(rank) + 1) % self.nranks]

    def tune(self, nbytes: int) -> tuple[int, int]:
        """Channels and threads NCCL uses for an allreduce of nbytes.

        src/enqueue.cc getAlgoInfo (2.19) / getChannnelThreadInfo (2.20): shrink
        channels, then threads, while nBytes < nc*nt*threshold; Simple adds a sync warp.
        """
        nc = self.channels
        nt = LL128_MAX_THREADS if self.protocol == "ll128" else self.max_threads
        threshold = THREAD_THRESHOLD[self.protocol] * (self.nranks if self.protocol == "ll" else 1)
        while nbytes < nc * nt * threshold:
            if nc >= 2:
                nc -= 1
            elif nt % 128 == 0:
                nt //= 2
            else:
                break
        if self.protocol == "simple":
            nt += WARP_SIZE
        nt = max(nt, 3 * WARP_SIZE)
        return nc, nt


def ib_ar_settings(version: tuple[int, int], env) -> dict:
    """RingConfig's adaptive_routing and ar_threshold from the job's NCCL_IB_ADAPTIVE_ROUTING
    and NCCL_IB_AR_THRESHOLD (a mapping: os.environ, or the "set by environment" lines of an
    NCCL log). NCCL reads both with strtoll (misc/param.cc:66-75@v2.19.4-1); -2 is "unset"
    (net_ib.cc:84@v2.16.5-1; the threshold's -2 from 2.30, net_ib/init.cc:475-482@v2.30.7-1).
    NCCL_IB_ADAPTIVE_ROUTING does not exist before 2.16 (RingConfig.ar_writes)."""
    out = {}
    for var, key in (("NCCL_IB_ADAPTIVE_ROUTING", "adaptive_routing"), ("NCCL_IB_AR_THRESHOLD", "ar_threshold")):
        text = env.get(var)
        if text is None or not str(text).strip():
            continue
        try:
            value = int(str(text).strip(), 0)
        except ValueError:
            raise ScheduleError(f"{var}={text!r} is not an integer") from None
        if value == -2 or (key == "adaptive_routing" and tuple(version) < (2, 16)):
            continue
        out[key] = value != 0 if key == "adaptive_routing" else value
    return out


class Send(NamedTuple):
    """One prims send on a connection: `nelem` elements of `bucket` from `offset`.

    For Simple a chunk is sent as 2 slices, each its own Send (a slice may be empty
    and is still sent). `step` is the index of this send among all sends of its
    connection in the iteration: LL writes step-derived flags into every line.
    A broadcast's send (RingSchedule._add_broadcast) is one whole chunk with phase AG
    (the root's final values), `chunk` its index in the channel's part and `ring_step`
    the sender's distance from the root. An allgather's send (RingSchedule._add_allgather)
    is one Simple slice (or LL/LL128 chunk) of one rank's block, phase AG, `offset` within
    the gathered buffer (owner rank * count + element), `chunk` its index in the channel's
    part and `ring_step` how many hops the block has made (0: the sender's own).
    A NamedTuple, not a dataclass: its fields are a row of ConnectionSends, which keeps
    a schedule's sends (16k for issue 16's replay) as rows and makes a Send only where
    one is asked for, and a tuple is made in a third of the time.
    """

    bucket: int  # gradient bucket; < 0: other collective -1-bucket (RingSchedule.others), no gradient
    phase: int
    offset: int  # first element, within the bucket
    nelem: int
    wire_bytes: int
    step: int
    chunk: int  # ring chunk index (which rank finishes reducing it)
    ring_step: int  # 0 for the loop's first send, which carries the sender's own values


_new = tuple.__new__  # a NamedTuple made without its Python-level __new__ (same object)


class Message(NamedTuple):
    """One RDMA write message on one QP: a Send, or one QP's part of it.

    Normally a WRITE_WITH_IMM carrying the data. Where the send goes as RDMA WRITE + a
    0-byte WRITE_WITH_IMM (RingConfig.ar_writes) it is two Messages: the data with
    `imm` None (a plain WRITE), then one of wire_len 0 with the immediate. A NamedTuple
    like Send; where every send is one message, FlowSchedule makes them on demand too."""

    send: Send
    wire_offset: int  # where this part starts within the send's wire bytes
    wire_len: int
    imm: int | None  # NCCL writes the whole send's size as immediate, on every part
    npkts: int


SEND_FIELDS = len(Send._fields)
# columns of a ConnectionSends row
BUCKET, STEP, WIRE_BYTES = (Send._fields.index(f) for f in ("bucket", "step", "wire_bytes"))


class ConnectionSends:
    """One connection's sends in issue order, kept as rows of Send's fields (int64) and
    made into Send tuples only where asked for. A plan's schedules hold every send of an
    iteration (16k for issue 16's replay, built before its first frame is placed); the
    fast path reads them as arrays (FlowSchedule.columns), the reference only the few
    messages it places itself. Blocks come as int64 rows (allreduces,
    RingSchedule._add_allreduce) or as Send tuples, which are kept as they are: a Send is
    one object wherever it is handed out (Message.send is the connection's send)."""

    __slots__ = ("n", "_blocks", "_rows", "_made", "_unmade")

    def __init__(self):
        self.n = 0
        self._blocks: list = []
        self._rows: np.ndarray | None = None
        self._made: list[Send | None] = []  # the Send of each index handed out so far
        self._unmade = 0  # how many of _made are None

    def add(self, block):
        """Sends issued next: an int64 array of rows, or a list of Send tuples."""
        if not len(block):
            return
        if isinstance(block, np.ndarray):
            self._made += [None] * len(block)
            self._unmade += len(block)
        else:
            self._made += block
        self._blocks.append(block)
        self.n += len(block)
        self._rows = None

    def rows(self) -> np.ndarray:
        """Every send as a row of Send's fields, (n, SEND_FIELDS) int64."""
        if self._rows is None:
            parts = [b if isinstance(b, np.ndarray) else np.array(b, np.int64).reshape(-1, SEND_FIELDS)
                     for b in self._blocks]
            self._rows = np.concatenate(parts) if parts else np.zeros((0, SEND_FIELDS), np.int64)
            self._blocks = [self._rows]
        return self._rows

    def send(self, i: int) -> Send:
        s = self._made[i]
        if s is None:
            s = self._made[i] = _new(Send, tuple(self.rows()[i].tolist()))
            self._unmade -= 1
        return s

    def sends(self) -> list[Send]:
        """Every send as a Send tuple (made now where not yet)."""
        if self._unmade:
            self._made[:] = [s if s is not None else _new(Send, tuple(r))
                             for s, r in zip(self._made, self.rows().tolist())]
            self._unmade = 0
        return self._made


def _whole_message(send: Send, npkts: int) -> Message:
    """A send as one WRITE_WITH_IMM of all its bytes, its size the immediate."""
    return _new(Message, (send, 0, send.wire_bytes, send.wire_bytes, npkts))


class FlowSchedule:
    """The messages one QP carries in one iteration, with fast PSN-position lookup.

    It holds them one of two ways. Where every send is one message on one QP
    (RingSchedule._whole_sends, NCCL's usual case) it is a view of its connection's sends:
    every `stride`-th from `first`; their Message tuples are made only where asked for
    (`message`, `messages`) and `columns` reads the sends' rows. Otherwise (a send split
    over QPs, or sent as a WRITE and a 0-byte WRITE_WITH_IMM) its messages are `add`ed one
    by one."""

    def __init__(self, src: int, dst: int, channel: int, qp: int):
        self.src, self.dst, self.channel, self.qp = src, dst, channel, qp
        self._messages: list[Message | None] = []  # added, or made so far (a view)
        self._starts: list[int] = []  # packet position of each message start (added)
        self._npkts = 0  # (added)
        self._view: tuple[ConnectionSends, int, int, int] | None = None  # (sends, first, stride, mtu)
        self._derived: tuple | None = None  # a view's (sends.n, indices, npkts, starts, starts as a list)
        self._columns: tuple[int, dict] | None = None  # (len, columns()) as last made
        self._unmade = 0  # a view's messages not made yet (None in _messages)

    @classmethod
    def view_of(cls, src: int, dst: int, channel: int, qp: int, sends: ConnectionSends, first: int,
                stride: int, mtu: int) -> "FlowSchedule":
        """The QP that carries sends first, first + stride, ... of its connection, each one
        WRITE_WITH_IMM of the whole send with its size as immediate."""
        fs = cls(src, dst, channel, qp)
        fs._view = (sends, first, stride, mtu)
        return fs

    def add(self, msg: Message):
        if self._view is not None:
            raise TypeError("a view of its connection's sends takes no messages of its own")
        self._starts.append(self._npkts)
        self._messages.append(msg)
        self._npkts += msg.npkts

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
        """A view's (send indices, packets per message, message starts, the same as a list:
        locate bisects it, a few times faster than searchsorted on the array)."""
        sends, first, stride, mtu = self._view
        if self._derived is None or self._derived[0] != sends.n:
            idx = np.arange(first, sends.n, stride, dtype=np.int64)
            wire = sends.rows()[idx, WIRE_BYTES]
            npk = np.maximum(1, -(-wire // mtu))  # npkts(): an empty write takes one PSN
            starts = np.zeros(len(idx), np.int64)
            np.cumsum(npk[:-1], out=starts[1:])
            self._derived = (sends.n, idx, npk, starts, starts.tolist())
            self._messages = [None] * len(idx)
            self._unmade = len(idx)
        return self._derived[1:]

    @property
    def npkts(self) -> int:
        if self._view is None:
            return self._npkts
        _, npk, starts, _ = self._arrays()
        return int(starts[-1] + npk[-1]) if len(npk) else 0

    @property
    def starts(self) -> list[int]:
        return self._starts if self._view is None else self._arrays()[3]

    def __len__(self) -> int:
        return len(self._messages) if self._view is None else len(self._arrays()[0])

    def message(self, m: int) -> Message:
        """Message m (made now if it is a view's and not made yet)."""
        if self._view is None:
            return self._messages[m]
        idx, npk, _, _ = self._arrays()
        msg = self._messages[m]
        if msg is None:
            msg = self._messages[m] = _whole_message(self._view[0].send(int(idx[m])), int(npk[m]))
            self._unmade -= 1
        return msg

    @property
    def messages(self) -> list[Message]:
        if self._view is not None:
            idx, npk, _, _ = self._arrays()  # (sized for every send so far)
            if self._unmade:
                made, sends = self._messages, self._view[0].sends()
                for m, (i, k) in enumerate(zip(idx.tolist(), npk.tolist())):
                    if made[m] is None:
                        made[m] = _whole_message(sends[i], k)
                self._unmade = 0
        return self._messages

    def locate(self, pkt: int) -> tuple[int, int]:
        """(message index, packet index within it) of the packet at position pkt."""
        starts = self._starts if self._view is None else self._arrays()[3]
        m = bisect_right(starts, pkt) - 1
        return m, pkt - starts[m]

    def columns(self) -> dict[str, np.ndarray]:
        """Every message as int64 columns: m_<Send field> of its send (bucket, phase,
        offset, nelem, wire_bytes, step, chunk, ring_step), m_wire_offset, m_wire_len,
        m_imm (0 where there is none), m_has_imm, m_npkts, m_start. Read-only."""
        if self._columns is None or self._columns[0] != len(self):
            self._columns = (len(self), self._make_columns())
        return self._columns[1]

    def _make_columns(self) -> dict[str, np.ndarray]:
        if self._view is None:
            n = len(self._messages)
            rows = np.array([m.send for m in self._messages], np.int64).reshape(n, SEND_FIELDS)
            out = {f"m_{f}": rows[:, k] for k, f in enumerate(Send._fields)}
            out.update(m_wire_offset=np.array([m.wire_offset for m in self._messages], np.int64),
                       m_wire_len=np.array([m.wire_len for m in self._messages], np.int64),
                       m_imm=np.array([m.imm or 0 for m in self._messages], np.int64),
                       m_has_imm=np.array([m.imm is not None for m in self._messages], np.int64),
                       m_npkts=np.array([m.npkts for m in self._messages], np.int64),
                       m_start=np.array(self._starts, np.int64))
            return out
        idx, npk, starts, _ = self._arrays()
        rows = self._view[0].rows()[idx]
        out = {f"m_{f}": rows[:, k] for k, f in enumerate(Send._fields)}
        wire = out["m_wire_bytes"]
        out.update(m_wire_offset=np.zeros(len(idx), np.int64), m_wire_len=wire, m_imm=wire,
                   m_has_imm=np.ones(len(idx), np.int64), m_npkts=npk, m_start=starts)
        return out


@dataclass(frozen=True)
class Bucket:
    count: int
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize


@dataclass(frozen=True)
class Broadcast(Bucket):
    """A ring broadcast of `count` elements from rank `root` on the communicator (DDP's
    _sync_module_states and buffer broadcasts): one of RingSchedule's `before`/`after`."""

    root: int = 0


@dataclass(frozen=True)
class AllGather(Bucket):
    """A ring allgather of `count` elements from every rank (DDP's constructor verifies the
    parameter count with one of 1 int64: c10d verify_params_across_processes): one of
    RingSchedule's `before`/`after`. count is per rank, as ncclAllGather's sendcount."""


def wire_bytes(protocol: str, nelem: int, itemsize: int) -> int:
    """Bytes a send of nelem elements puts on the wire (prims_ll.h: 8 data bytes a line;
    prims_ll128.h:306@v2.22.3: a whole 2048-B block for every started 1920 data bytes)."""
    data = max(0, nelem) * itemsize
    if protocol == "ll":
        return -(-data // LL_DATA_PER_LINE) * LL_LINE
    if protocol == "ll128":
        return -(-data // LL128_DATA_PER_BLOCK) * LL128_BLOCK
    return data


def npkts(wire_len: int, mtu: int) -> int:
    """A message of L bytes takes max(1, ceil(L/PMTU)) PSNs (IBA 9.7; WIRE.md)."""
    return max(1, -(-wire_len // mtu))


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _div_up(a, b) * b


@lru_cache(maxsize=None)
def ring_steps(nranks: int, ring_ix: int) -> tuple[tuple[int, int], ...]:
    """(phase, chunk) of each send of the rank at ring index ring_ix in one loop.

    src/device/all_reduce.h runRing: send chunk r-1; recvReduceSend r-j for j=2..n-1;
    recvReduceCopySend chunk r (final value leaves here: allgather starts);
    recvCopySend r-j for j=1..n-2; the final recv sends nothing.
    """
    n, r = nranks, ring_ix
    steps = [(RS, (r - 1) % n)]
    steps += [(RS, (r - j) % n) for j in range(2, n)]
    steps.append((AG, r))
    steps += [(AG, (r - j) % n) for j in range(1, n - 1)]
    return tuple(steps)


def cbd_ranges(version: tuple[int, int], protocol: str, count: int, itemsize: int,
               comm_channels: int, nc: int, traffic_per_byte: int = 2) -> list[tuple[int, int, int]]:
    """(channel, first element, element count) of each channel an allreduce of `count`
    elements uses, NCCL 2.22+: the host cuts the buffer into cells and gives each channel
    one contiguous run of them (docs/NCCL.md section 2; enqueue.cc scheduleCollTasksToPlan
    and include/device.h ncclCollCbdPart, 583-797 and 294-320@v2.22.3, 571-829@v2.29.7).
    Checked row by row against NCCL's own code compiled at every tag
    (tests/data/nccl/partition-*.json). traffic_per_byte is ncclFuncTrafficPerByte
    (enqueue.cc:57-64@v2.22.3-1, 91-100@v2.30.7-1): 2 for an allreduce, 1 for a broadcast
    (which NCCL partitions as int8: pass its bytes with itemsize 1)."""
    v = tuple(version)
    ll = protocol == "ll"
    min_traffic = 512 if v < (2, 23) else 16384 if v < (2, 29) else 32768
    per_byte = traffic_per_byte  # an allreduce moves every byte twice, a broadcast once
    if ll and v >= (2, 26):  # LL lines carry 8 data bytes in 16 (enqueue.cc:389,570@v2.26.6)
        per_byte *= 4
    traffic = count * itemsize * per_byte
    if v >= (2, 23):
        traffic = max(min_traffic, traffic)
    nplan = min(nc, comm_channels)
    if v >= (2, 29):
        per_channel = _round_up(traffic // nplan, 16)
    else:
        per_channel = max(min_traffic, traffic // nplan)
    cell = 16 if v < (2, 23) else _round_up(_div_up(min_traffic, per_byte), 16)
    elts_per_cell = cell // itemsize
    cells = _div_up(count * itemsize, cell)
    per_cell = cell * per_byte
    per_ch = min(cells, _div_up(per_channel, per_cell))
    ch = 0
    if ch + 1 == comm_channels:
        lo = cells
    elif v < (2, 23):  # 2.22 rounds the first channel's share down: work can spill
        lo = min(cells, per_channel // per_cell)
    else:
        lo = min(cells, _div_up(per_channel, per_cell))
    mid, hi = divmod(cells - lo, per_ch)
    if ch + (lo > 0) + mid + (hi > 0) > comm_channels:  # squeeze into the channels there are
        mid = comm_channels - ch - 2
        per_ch = (cells - lo) // (mid + 1)
        hi = per_ch + (cells - lo) % (mid + 1)
    if hi == 0 and mid != 0:
        hi, mid = per_ch, mid - 1
    if lo == 0:
        ch += 1
        if mid == 0:
            lo, hi = hi, 0
        else:
            lo, mid = per_ch, mid - 1
    count_lo, count_mid, count_hi = lo * elts_per_cell, per_ch * elts_per_cell, hi * elts_per_cell
    tail = cells * elts_per_cell - count  # the last cell is partial
    if count_hi:
        count_hi -= tail
    else:
        count_lo -= tail
    out, off = [], 0
    if count_lo > 0:
        out.append((ch, 0, count_lo))
        off, ch = count_lo, ch + 1
    for _ in range(mid):
        out.append((ch, off, count_mid))
        off, ch = off + count_mid, ch + 1
    if hi > 0:
        out.append((ch, off, count_hi))
    return out


def min_buffsize(nccl_version: tuple[int, int], protocol: str, broadcast: bool = False) -> int:
    """The smallest NCCL_BUFFSIZE (bytes) whose ring chunks hold at least one element of
    every dtype a plan takes (8 bytes at most) in every collective this module cuts: a
    step is buffsize / NCCL_STEPS, and a smaller buffer makes some chunk 0 elements (an
    endless, empty loop). `broadcast`: the job also runs ring broadcasts, whose Simple
    chunk is one step, not four (BROADCAST_CHUNKSTEPS).
    2.14-2.19 (_channel_loops, interleaved): Simple step // itemsize * 4, LL step / 2 //
    itemsize, LL128 step / 16 * 15 // itemsize. 2.20-2.21: Simple step * 4 // itemsize,
    LL and LL128 as before. 2.22+ (_ring_chunk_bytes): the chunk is rounded down to the
    protocol's grain, Simple 512 B (step * chunk steps), LL 16 B (step / 2), LL128
    1920 B (step / 16 * 15)."""
    big = 8  # the largest itemsize of DTYPES
    if tuple(nccl_version) >= (2, 22):
        step = {"simple": -(-512 // (BROADCAST_CHUNKSTEPS if broadcast else ALLREDUCE_CHUNKSTEPS)),
                "ll": 2 * 16, "ll128": 16 * -(-LL128_DATA_PER_BLOCK // 15)}[protocol]
    elif protocol == "simple":
        step = big if tuple(nccl_version) < (2, 20) else -(-big // ALLREDUCE_CHUNKSTEPS)
    else:  # LL: step / 2 >= 8; LL128: step / 16 * 15 >= 8, i.e. step >= 16
        step = 16
    return step * NCCL_STEPS


def cbd_chunk_count(protocol: str, step_bytes: int, itemsize: int) -> int:
    """Elements per chunk for a ring, 2.22+ (calcCollChunking, enqueue.cc:1757-1762,1813@v2.22.3):
    Simple 4 steps, LL half a step, LL128 the 15/16 of a step that is data, each rounded
    down to the protocol's grain."""
    return _ring_chunk_bytes(protocol, step_bytes) // itemsize


def _ring_chunk_bytes(protocol: str, step_bytes: int, chunk_steps: int = ALLREDUCE_CHUNKSTEPS) -> int:
    """A ring chunk in data bytes (enqueue.cc calcCollChunking; ProtoLL128::calcBytePerStep is the
    same stepSize/16*15 in 2.14-2.19's all_reduce.h). chunk_steps: the collective's CHUNKSTEPS,
    which only Simple uses (enqueue.cc:1757-1762@v2.22.3-1, 2223-2227@v2.30.7-1)."""
    grain = {"simple": 512, "ll": 16, "ll128": LL128_DATA_PER_BLOCK}[protocol]
    if protocol == "simple":
        chunk = step_bytes * chunk_steps
    elif protocol == "ll":
        chunk = step_bytes // 2
    else:
        chunk = step_bytes // 16 * 15
    return chunk // grain * grain


def _channel_loops(cfg: RingConfig, count: int, itemsize: int, nc: int, nt: int):
    """For each channel bid, its loops as (chunk -> (offset, nelem)) callables.

    Yields (bid, [per-loop function chunk -> (offset, nelem)]).
    2.19: src/device/all_reduce.h (v2.19.4) runRing gridOffset loop, realChunkSize.
    2.20-2.21: src/enqueue.cc (v2.20.5) addTunedCollToPlan, computeCollAlignCount,
    computeCollLastChunkInfo, and runRing's per-channel workOffset/workCount loop.
    """
    n = cfg.nranks
    step = cfg.step_bytes
    if cfg.interleaved:
        if cfg.protocol == "simple":
            chunk_size = step // itemsize * ALLREDUCE_CHUNKSTEPS
        elif cfg.protocol == "ll":
            chunk_size = step // 2 // itemsize  # ProtoLL::calcBytePerStep = stepSize/2
            min_chunk = nt * (8 // itemsize)  # nthreads * calcBytePerGrain/sizeof(T)
        else:
            chunk_size = step // 16 * 15 // itemsize  # ProtoLL128::calcBytePerStep
            # nthreads*(calcBytePerGrain/sizeof(T))/2, grain = 8 u64 per thread, 15/16 of them
            # data = 60 B (all_reduce.h runRing and prims_ll128.h@v2.19.4)
            min_chunk = nt * (60 // itemsize) // 2
        loop_size = nc * n * chunk_size
        for bid in range(nc):
            loops = []
            for grid in range(0, count, loop_size):
                if cfg.protocol == "simple":
                    real = min(chunk_size, _div_up(count - grid, nc * n))
                    real = _round_up(real, (nt - WARP_SIZE) * 8 // itemsize)
                else:
                    real = min(chunk_size, _div_up(count - grid, nc * n * min_chunk) * min_chunk)
                if cfg.protocol == "simple":
                    def at(chunk, grid=grid, real=real, bid=bid):
                        off = grid + bid * n * real + chunk * real
                        return off, max(0, min(real, count - off))
                else:
                    def at(chunk, grid=grid, real=real, bid=bid):
                        off = grid + (chunk * nc + bid) * real
                        return off, max(0, min(real, count - off))
                loops.append(at)
            yield bid, loops
        return
    if tuple(cfg.nccl_version) >= (2, 22):
        chunk_count = cbd_chunk_count(cfg.protocol, step, itemsize)
        align = 16 // itemsize  # the short last loop: alignUp(divUp(rem, nranks), 16/sizeof(T))
        for bid, work_offset, work in cbd_ranges(cfg.nccl_version, cfg.protocol, count, itemsize,
                                                 cfg.channels, nc):
            yield bid, _contiguous_loops(n, work_offset, work, chunk_count,
                                         _round_up(_div_up(work % (n * chunk_count), n), align))
        return
    # 2.20-2.21: each channel owns one contiguous range.
    if cfg.protocol == "simple":
        align = WARP_SIZE * 8 * 16 // itemsize  # NCCL_SIMPLE_ALIGNMENT / typeSize
        chunk_count = step * ALLREDUCE_CHUNKSTEPS // itemsize
    elif cfg.protocol == "ll128":
        # enqueue.cc computeCollAlignCount@v2.20.5: NCCL_LL128_ALIGNMENT_PER_WARP (480) / typeSize
        # per warp; calcCollChunking: stepSize/16*15 (no grain rounding before 2.22)
        align = 480 // itemsize * (nt // WARP_SIZE)
        chunk_count = step // 16 * 15 // itemsize
    else:
        align = 8 // itemsize * nt  # NCCL_LL_ALIGNMENT_PER_THREAD / typeSize * nThreads
        chunk_count = step // 2 // itemsize
    per_channel = _round_up(_div_up(count, nc), align)
    nchan = _div_up(count, per_channel)
    work_offset, rem = 0, count
    for bid in range(nchan):
        work = min(per_channel, rem)
        last_chunk = _round_up(_div_up(work % (n * chunk_count), n), align)
        yield bid, _contiguous_loops(n, work_offset, work, chunk_count, last_chunk)
        work_offset += work
        rem -= work


def _contiguous_loops(n: int, work_offset: int, work: int, chunk_count: int, last_chunk: int):
    """runRing over one channel's contiguous range (2.20+, device/all_reduce.h): loops of
    n chunks of chunk_count elements, the short last loop with chunks of last_chunk;
    each loop a function chunk index -> (first element, element count)."""
    loops = []
    loop_count = n * chunk_count
    for elem in range(0, work, loop_count):
        remc = work - elem
        cc = last_chunk if remc < loop_count else chunk_count

        def at(chunk, base=work_offset + elem, cc=cc, remc=remc):
            off = chunk * cc
            return base + off, max(0, min(cc, remc - off))
        loops.append(at)
    return loops


def pipeline_chunks(cfg: RingConfig, nbytes: int, nc: int, nt: int, allgather: bool):
    """For each channel of a ring broadcast of nbytes (or allgather of nbytes a rank), the
    chunks its device loop walks, in order, as (byte offset, bytes); bytes may be 0 (an
    empty send, still posted). NCCL turns both into int8 on the host in every version
    (ncclInfoSetDerived, include/info.h:62-67@v2.14.3-1, 66-71@v2.19.4-1, 83-88@v2.20.5-1;
    taskAppend enqueue.cc:2007-2008@v2.22.3-1), so everything here is bytes. nc, nt: the
    tuned channels and threads (RingConfig.tune of the bytes, nranks times them for an
    allgather). Checked against NCCL's own code compiled at every tag
    (tests/data/nccl/broadcast-*.json, allgather-*.json; docs/NCCL.md section 6).

    2.22+: each channel's cbd part (cbd_ranges with ncclFuncTrafficPerByte 1 or nRanks) in
    chunks of calcCollChunking's size; the device takes min(chunk, rest), no short-loop rule
    (device/broadcast.h:30-44@v2.22.3-1, all_gather.h:12-53@v2.22.3-1).
    2.20-2.21: addCBDCollToPlan (enqueue.cc:431-490@v2.20.5-1; for one collective the same
    cut as addTunedCollToPlan, 324-411) gives channel c roundUp(divUp(bytes, nc), align) bytes
    from c times that, align = computeCollAlignCount (214-223: Simple 4096, LL 8*nt, LL128
    480*nt/32); the chunk is computeCollChunkInfo's stepSize*chunkSteps (LL /2, LL128 *15/16,
    no grain rounding, 1683-1736), walked as min(chunk, rest) (broadcast.h:12-47@v2.20.5-1,
    all_gather.h:12-63@v2.20.5-1).
    2.14-2.19: every channel walks the whole buffer in loops of nc chunks; loop g's chunk on
    channel bid starts at g + bid*real (broadcast.h:12-59@v2.19.4-1, all_gather.h:12-76@v2.19.4-1,
    the same in collectives/device/*.h@v2.14.3-1), real = Simple roundUp(min(chunk,
    divUp(rest, nc)), (nt-32)*8); LL chunk, or in the last, short loop the host's lastChunkSize
    roundUp(divUp(bytes mod (nc*chunk), nc), nt*8) (computeColl, enqueue.cc:1394-1398@v2.19.4-1,
    1224-1228@v2.14.3-1); LL128 min(chunk, divUp(rest, nc*m)*m), m = nt*60 (broadcast) or
    nt*60/2 (allgather: "we should not need the final /2", all_gather.h:21@v2.19.4-1)."""
    v = tuple(cfg.nccl_version)
    proto = cfg.protocol
    chunk_steps = ALLGATHER_CHUNKSTEPS if allgather else BROADCAST_CHUNKSTEPS
    if v >= (2, 22):
        chunk = _ring_chunk_bytes(proto, cfg.step_bytes, chunk_steps)
        per_byte = cfg.nranks if allgather else 1
        for bid, off, cnt in cbd_ranges(v, proto, nbytes, 1, cfg.channels, nc, traffic_per_byte=per_byte):
            yield bid, [(off + e, min(chunk, cnt - e)) for e in range(0, cnt, chunk)]
        return
    # calcBytePerStep (device/primitives.h:34-66@v2.19.4-1) / computeCollChunkInfo: no grain rounding
    chunk = {"simple": cfg.step_bytes * chunk_steps, "ll": cfg.step_bytes // 2,
             "ll128": cfg.step_bytes // 16 * 15}[proto]
    if v >= (2, 20):
        align = {"simple": WARP_SIZE * 8 * 16, "ll": 8 * nt, "ll128": 480 * (nt // WARP_SIZE)}[proto]
        per_channel = _round_up(_div_up(nbytes, nc), align)
        for bid, off in enumerate(range(0, nbytes, per_channel)):
            work = min(per_channel, nbytes - off)
            yield bid, [(off + e, min(chunk, work - e)) for e in range(0, work, chunk)]
        return
    loop = nc * chunk
    grain = nt * 60 // (2 if allgather else 1)  # LL128's minChunkSizeLL128
    out: list[list[tuple[int, int]]] = [[] for _ in range(nc)]
    for grid in range(0, nbytes, loop):
        rest = nbytes - grid
        if proto == "simple":
            real = _round_up(min(chunk, _div_up(rest, nc)), (nt - WARP_SIZE) * 8)
        elif proto == "ll":
            real = chunk if rest >= loop else _round_up(_div_up(nbytes % loop, nc), nt * 8)
        else:
            real = min(chunk, _div_up(rest, nc * grain) * grain)
        for bid in range(nc):
            off = grid + bid * real
            out[bid].append((off, max(0, min(real, nbytes - off))))
    yield from enumerate(out)


class RingSchedule:
    """The wire schedule of one iteration: every bucket allreduced once, in order.

    flows[(src, dst, channel, qp)] is the FlowSchedule of that QP; sends[(src, dst,
    channel)] the connection's sends in issue order (Send tuples, made on first use:
    the fast path reads the same sends as arrays, FlowSchedule.columns; `conns` and
    `steps` need neither).
    """

    def __init__(self, cfg: RingConfig, buckets: list[Bucket], send_base: dict | None = None,
                 before: Sequence[Bucket] = (), after: Sequence[Bucket] = (), cells: dict | None = None,
                 order: Sequence[int] | None = None):
        """send_base[conn]: sends the connection made before this iteration (earlier
        iterations and other collectives on the communicator), which is where NCCL's QP
        rotation stands (RingConfig.qp_of_part); only its value modulo the QP count matters.
        before/after: other collectives on the same communicator around the gradient
        buckets (allreduces of a loss or metric, Broadcast entries for DDP's broadcasts:
        Plan.collectives); their sends are on the wire and advance every counter of the
        connection, and carry no gradient (bucket < 0). cells: _allreduce_cells' cache, to
        share with other schedules of the same cfg (Plan.schedule's layouts). order: the
        buckets' indices in the order they are allreduced (Plan.wire_order: static_graph's
        iteration 0 allreduces the used map, the last bucket, first); by default their own.
        A send's bucket is always its index in `buckets`."""
        self._start(cfg, buckets, list(before) + list(after), send_base)
        self._cells = {} if cells is None else cells
        for c in range(cfg.channels):
            for idx in range(cfg.nranks):
                src = cfg.rank_at(c, idx)
                self._add_connection((src, cfg.next_rank(c, src), c))
        for k, other in enumerate(before):
            self._add_other(-1 - k, other)
        if order is not None and sorted(order) != list(range(len(self.buckets))):
            raise ScheduleError(f"bucket order {list(order)} is not a permutation of the {len(self.buckets)} buckets")
        for b in range(len(self.buckets)) if order is None else order:
            self._add_allreduce(b, self.buckets[b])
        for k, other in enumerate(after):
            self._add_other(-1 - len(before) - k, other)

    # -- building -----------------------------------------------------------------
    def _start(self, cfg: RingConfig, buckets, others, send_base):
        """The state every schedule of connections and their QPs starts from (the ring's,
        ckptd.core.tree's)."""
        self.cfg = cfg
        self.buckets = list(buckets)
        self.others = others
        self.send_base = dict(send_base or {})
        # every send one message on one QP (no split, no adaptive-routing write pair):
        # _emit's short path
        self._whole_sends = cfg.parts_per_send == 1 and not cfg.ar_writes
        self._sends: dict[tuple[int, int, int], ConnectionSends] = {}
        self._sends_made: dict | None = None  # `sends` as last made (until the next _emit)
        self.flows: dict[tuple[int, int, int, int], FlowSchedule] = {}

    def _add_connection(self, conn):
        """A connection with no sends yet, and its QPs' FlowSchedules: views of its sends
        where every send is one message (send index i goes on QP i mod nq: qp_of_part(i,
        0, 1), counted from send_base), else filled by _emit."""
        cfg = self.cfg
        sends = self._sends[conn] = ConnectionSends()
        nq, base = cfg.data_qps, self.send_base.get(conn, 0)
        for q in range(nq):
            if self._whole_sends:
                self.flows[conn + (q,)] = FlowSchedule.view_of(*conn, q, sends, (q - base) % nq, nq, cfg.mtu)
            else:
                self.flows[conn + (q,)] = FlowSchedule(*conn, q)

    @property
    def conns(self) -> list[tuple[int, int, int]]:
        """The connections (sender, receiver, channel)."""
        return list(self._sends)

    @property
    def sends(self) -> dict[tuple[int, int, int], list[Send]]:
        """Each connection's sends in issue order, as Send tuples (made on first use: the
        fast path reads them as arrays, FlowSchedule.columns)."""
        if self._sends_made is None:
            self._sends_made = {conn: s.sends() for conn, s in self._sends.items()}
        return self._sends_made

    def _add_other(self, b: int, other: Bucket):
        if isinstance(other, Broadcast):
            self._add_broadcast(b, other)
        elif isinstance(other, AllGather):
            self._add_allgather(b, other)
        else:
            self._add_allreduce(b, other)

    def _add_broadcast(self, b: int, bc: Broadcast):
        """A ring broadcast from bc.root, NCCL 2.14+ (docs/NCCL.md section 4a); the chunks each
        channel walks are pipeline_chunks', the rest below is read at 2.22+ and is the same before.

        Host: taskAppend turns a broadcast into int8 of count*itemsize bytes
        (enqueue.cc:2007-2008@v2.22.3-1, 2476@v2.28.9-1, 2611@v2.29.7-1; 2.29+ first queue
        it for allgatherv and turn a lone root's back into a broadcast, 2581-2599 and
        367-386@v2.29.7-1), tuned like an allreduce of those bytes (topoGetAlgoInfo does not
        look at the function), partitioned over channels with ncclFuncTrafficPerByte 1
        (enqueue.cc:57-64,660@v2.22.3-1), chunked by calcCollChunking with pattern
        PipelineFrom and BROADCAST_CHUNKSTEPS 1 (enqueue.cc:1700-1701,1757-1762,1813@v2.22.3-1).
        Device (device/broadcast.h:30-44@v2.22.3-1, 40-54@v2.30.7-1): on each channel, for
        every chunk of the channel's part, in order, the root sends it, every other rank
        receives and forwards it, and the rank before the root only receives it; Simple
        posts one slice per chunk (ProtoSimple<1, 1>, broadcast.h:52@v2.22.3-1). So every hop
        of the channel's ring except the one into the root carries every chunk once, and
        the hop into the root carries nothing (NeedProxy for PipelineFrom,
        proxy.cc:543-551@v2.22.3-1)."""
        cfg = self.cfg
        if bc.count == 0:
            return  # empty collectives never reach the proxy (src/enqueue.cc)
        n = cfg.nranks
        if not 0 <= bc.root < n:
            raise ScheduleError(f"broadcast root {bc.root} is not a rank of the {n}-rank ring")
        itemsize = bc.dtype.itemsize
        nc, nt = cfg.tune(bc.nbytes)
        for bid, chunks in pipeline_chunks(cfg, bc.nbytes, nc, nt, allgather=False):
            # (element offset, element count, wire bytes) of each chunk: bytes divide into
            # whole elements (every chunk size and alignment is a multiple of 16 bytes)
            cut = [(boff // itemsize, bn // itemsize, wire_bytes(cfg.protocol, bn, 1)) for boff, bn in chunks]
            src = bc.root
            for dist in range(n - 1):  # the hops root -> ... -> the rank before the root
                conn = (src, cfg.next_rank(bid, src), bid)
                first = self._sends[conn].n
                self._emit(conn, [Send(b, AG, eoff, nelem, wb, first + k, k, dist)
                                  for k, (eoff, nelem, wb) in enumerate(cut)])
                src = conn[1]

    def _add_allgather(self, b: int, ag: AllGather):
        """A ring allgather of ag.count elements a rank, NCCL 2.14+ (docs/NCCL.md section 4a); the
        chunks each channel walks are pipeline_chunks', the rest below is read at 2.22+ and is the same before.

        Host: taskAppend turns it into int8 of count*itemsize bytes a rank
        (enqueue.cc:2007-2008@v2.22.3-1, 2733-2736@v2.30.7-1); the tuner sees nRanks times
        that (ncclFuncMaxSendRecvCount, enqueue.cc:1669@v2.22.3-1); the per-rank bytes are
        partitioned over channels with ncclFuncTrafficPerByte nRanks (enqueue.cc:57-64,
        660@v2.22.3-1, 91-100,657@v2.30.7-1) and chunked by calcCollChunking with pattern Ring
        and ALLGATHER_CHUNKSTEPS 4 (enqueue.cc:1706-1712,1757-1762@v2.22.3-1).
        Device (device/all_gather.h:12-53@v2.22.3-1, 13-87@v2.30.7-1, runRing): on each
        channel, for every chunk of the channel's part, in order, a rank sends its own block's
        chunk (step 0), then receives and forwards the chunk of the rank j hops before it
        for j = 1..nranks-2, and only receives the last one: every hop carries nranks-1
        copies of every chunk, the sender's own first. Simple posts each as SlicePerChunk 2
        slices (ProtoSimple<2, 2>, all_gather.h:59@v2.22.3-1), computed on int8."""
        cfg = self.cfg
        if ag.count == 0:
            return  # empty collectives never reach the proxy (src/enqueue.cc)
        n = cfg.nranks
        itemsize = ag.dtype.itemsize
        nc, nt = cfg.tune(ag.nbytes * n)
        for bid, chunks in pipeline_chunks(cfg, ag.nbytes, nc, nt, allgather=True):
            # each chunk's slices as (byte offset in the block, bytes); 16-byte multiples
            # but at a block's end, so whole elements
            cut = [[(boff + min(s_off, bn), s_n) for s_off, s_n in self._slices(bn, 1)] for boff, bn in chunks]
            for idx in range(n):
                src = cfg.rank_at(bid, idx)
                conn = (src, cfg.next_rank(bid, src), bid)
                first = self._sends[conn].n
                cells = [(k, j, cfg.rank_at(bid, (idx - j) % n) * ag.count + boff // itemsize, bn)
                         for k, slices in enumerate(cut) for j in range(n - 1) for boff, bn in slices]
                self._emit(conn, [Send(b, AG, eoff, bn // itemsize, wire_bytes(cfg.protocol, bn, 1), first + i, k, j)
                                  for i, (k, j, eoff, bn) in enumerate(cells)])

    def _add_allreduce(self, b: int, bucket: Bucket):
        if bucket.count == 0:
            return  # empty collectives never reach the proxy (src/enqueue.cc)
        for conn, cells in self._allreduce_cells(bucket.count, bucket.dtype.itemsize).items():
            # the cells' rows with this bucket and the connection's next step numbers: as
            # rows, not Send tuples (ConnectionSends), since this is every send of the plan
            rows = cells.copy()
            rows[:, BUCKET] = b
            rows[:, STEP] += self._sends[conn].n
            self._emit(conn, rows if self._whole_sends else [_new(Send, tuple(r)) for r in rows.tolist()])

    def _allreduce_cells(self, count: int, itemsize: int) -> dict:
        """{connection: its sends of an allreduce of count elements as rows of Send's
        fields, with bucket 0 and steps counted from 0}. Kept per (count, itemsize): DDP's
        buckets repeat a few sizes (issue 16's 18 buckets a layout have 7), and this is
        every send of the plan, built before the first frame is read."""
        key = (count, itemsize)
        if key in self._cells:
            return self._cells[key]
        cfg = self.cfg
        nc, nt = cfg.tune(count * itemsize)
        n = cfg.nranks
        out = self._cells[key] = {}
        for bid, loops in _channel_loops(cfg, count, itemsize, nc, nt):
            # Every rank of the channel's ring walks the same loops and cuts a chunk into
            # the same slices; only the order of the chunks differs (ring_steps). Cut each
            # chunk once here rather than once per rank.
            cut = [[[(off + s_off, s_n, wire_bytes(cfg.protocol, s_n, itemsize))
                     for s_off, s_n in self._slices(nelem, itemsize)]
                    for off, nelem in map(at, range(n))] for at in loops]
            for idx in range(n):
                src = cfg.rank_at(bid, idx)
                rows = [(0, phase, off, s_n, wb, 0, chunk, k) for chunks in cut
                        for k, (phase, chunk) in enumerate(ring_steps(n, idx)) for off, s_n, wb in chunks[chunk]]
                out[(src, cfg.next_rank(bid, src), bid)] = cells = np.array(rows, np.int64).reshape(-1, SEND_FIELDS)
                cells[:, STEP] = np.arange(len(cells))
        return out

    def _slices(self, nelem: int, itemsize: int):
        """Simple sends a chunk as SlicePerChunk slices, empty ones included.

        src/device/prims_simple.h genericOp: sliceSize = max(divUp(nelem, 16*SlicePerChunk)*16,
        stepSize*StepPerSlice/32); every slice is posted even when it is empty. LL sends
        a chunk as one step (prims_ll.h)."""
        if self.cfg.protocol != "simple":
            return [(0, nelem)]
        step_elems = self.cfg.step_bytes // itemsize
        size = max(_div_up(nelem, 16 * SIMPLE_SLICES_PER_CHUNK) * 16,
                   step_elems * ALLREDUCE_SLICESTEPS // 32)
        out, off = [], 0
        for _ in range(SIMPLE_SLICES_PER_CHUNK):
            n = max(0, min(size, nelem - off))
            out.append((off, n))
            off += size
        return out

    def _emit(self, conn, new):
        """Turn the connection's next sends, in issue order (Send tuples, or rows of their
        fields where every send is one message), into RDMA messages on its QPs.

        src/transport/net_ib.cc ncclIbMultiSend: with NCCL_IB_SPLIT_DATA_ON_QPS (always
        before 2.18) every send is cut into nqps parts of DIVUP(DIVUP(size, nqps), 128)*128
        bytes, each a WRITE_WITH_IMM carrying the whole size (an empty part is a 0-byte
        write); without it, whole sends rotate over the QPs. Which QP a part takes is
        RingConfig.qp_of_part, from the connection's send count over all collectives.
        """
        cfg = self.cfg
        sends = self._sends[conn]
        index = self.send_base.get(conn, 0) + sends.n
        sends.add(new)
        self._sends_made = None
        nq = cfg.data_qps
        if self._whole_sends:
            return  # one part on one QP, the whole send: the QPs' FlowSchedules are views
        nparts = cfg.parts_per_send
        for index, send in enumerate(new, index):
            part = _round_up(_div_up(send.wire_bytes, nparts), IB_SPLIT_ALIGN) if nparts > 1 else send.wire_bytes
            ar = cfg.ar_writes and send.wire_bytes > cfg.ar_threshold
            for j in range(nparts):
                woff = j * part
                wlen = max(0, min(part, send.wire_bytes - woff))
                flow = self.flows[conn + (cfg.qp_of_part(index, j, nparts),)]
                if ar:  # the data as a plain WRITE, then a 0-byte WRITE_WITH_IMM (net_ib.cc:969@v2.14.3-1)
                    if wlen == cfg.cts_bytes:  # only with many QPs: a short last part
                        raise ScheduleError(
                            f"a {send.wire_bytes}-byte send over {nq} QPs leaves a {wlen}-byte RDMA WRITE, "
                            "the size of a clear-to-send write: ckptd cannot tell them apart; use fewer QPs")
                    flow.add(Message(send, woff, wlen, None, npkts(wlen, cfg.mtu)))
                    flow.add(Message(send, woff + wlen, 0, send.wire_bytes, 1))
                else:
                    flow.add(Message(send, woff, wlen, send.wire_bytes, npkts(wlen, cfg.mtu)))

    # -- queries ------------------------------------------------------------------
    def bucket_of(self, send: Send) -> Bucket:
        """The gradient bucket, or other collective, a send belongs to."""
        return self.buckets[send.bucket] if send.bucket >= 0 else self.others[-1 - send.bucket]

    def steps(self, conn) -> int:
        """LL steps a connection advances by in one iteration (one per send)."""
        return self._sends[conn].n

    def ag_elements(self, b: int) -> np.ndarray:
        """How many allgather copies of each element of bucket b cross the ring (tests)."""
        seen = np.zeros(self.buckets[b].count, np.int32)
        for sends in self._sends.values():
            rows = sends.rows()
            for offset, nelem in rows[(rows[:, 0] == b) & (rows[:, 1] == AG)][:, 2:4].tolist():
                seen[offset:offset + nelem] += 1
        return seen


# -- which hops are on the wire ------------------------------------------------------
def network_connections(cfg: RingConfig, node_of: Sequence[str]) -> frozenset[tuple[int, int, int]]:
    """The ring connections (sender, receiver, channel) whose ranks are on different
    nodes: the only hops that leave a host through a NIC, cross a switch and can be
    mirrored. NCCL connects peers of one host over P2P (NVLink/PCIe) or SHM, whose
    canConnect refuse peers of another host (src/transport/p2p.cc:107@v2.19.4-1,
    src/transport/shm.cc:62@v2.19.4-1), and falls through to NET only when they both
    refuse (src/transport.cc:26-30@v2.19.4-1, the transports tried in order). Every
    connection still exists in the schedule: the data of an intra-node hop shapes
    what the next hop sends, it just never reaches a mirror."""
    out = set()
    for c, ring in enumerate(cfg.rings):
        for i, src in enumerate(ring):
            dst = ring[(i + 1) % len(ring)]
            if node_of[src] != node_of[dst]:
                out.add((src, dst, c))
    return frozenset(out)
