# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The batch kernel: decode + place + assemble for many frames in one pass, without the GIL.

It is the compiled twin of the reference path, stage for stage and name for name:

    decode_frame, icrc_ok     parsers/roce.py decode_frame (link layer with VLAN/QinQ tags,
                              IPv4/IPv6 and extension headers, UDP 4791, BTH, extension
                              headers, FrameClass precedence) and parsers/icrc.py verify
    lookup_flow               ckptd/transports/roce/flows.py FlowBinder.bound (bindings made in Python)
    place, find_message,      ckptd/transports/roce/extract.py Extractor._place: FlowBinder.locate (PSN
    check, _reject            unwrap, FlowTimeline), Extractor._check, LL lines and flags
                              (ll_unpack), counters
    ack                       Extractor.feed's ACK branch
    assemble                  ckptd/core/assemble.py IterationAssembly.place: copy, coverage
                              (total, per stream, per bucket), conflicts

The kernel never decides anything the reference has not already decided for it, but it
owns the tables those decisions fill: flows bound by Python's FlowBinder are entered
with add_flow (the one flow hash is here), their PSN anchors live here and the
reference reads and moves them through anchor/set_anchor; LL flag bases learned by the
reference Extractor are set with set_flag_base; iterations are tracked, opened (the
kernel lends its buffers to the pipeline's IterationAssembly) and closed by the Python
pipeline (track_iteration, open_iteration, close_iteration, sync), and what the kernel
counted goes into the reference's own counters and assemblies (drain). Whenever a frame needs a
decision the kernel does not hold (a flow it does not know, an iteration it does not
track, a connection whose flag base is unknown, a rejection the reference must describe
in its examples, a GRE-wrapped frame, ...), `run` stops *before* changing any state for
that frame and returns its index and the reason; Python runs the reference path on that
one frame, updates the kernel's tables and resumes at the next frame. After a frame that
completed a bucket it stops too, so the pipeline steps and commits when the reference
would. So frames are processed in exactly the order the reference processes them, and
every counter, buffer and coverage map comes out identical.
"""
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

import numpy as np

cdef extern from "crc.h":
    ctypedef uint32_t (*ckptd_crc_fn)(uint32_t, const uint8_t *, uint64_t) noexcept nogil
    uint32_t ckptd_crc_zlib(uint32_t crc, const uint8_t *p, uint64_t n) noexcept nogil
    uint32_t ckptd_crc_clmul(uint32_t crc, const uint8_t *p, uint64_t n) noexcept nogil
    uint32_t ckptd_crc_vclmul(uint32_t crc, const uint8_t *p, uint64_t n) noexcept nogil
    int ckptd_cpu_clmul() noexcept nogil
    int ckptd_cpu_vclmul() noexcept nogil
    uint32_t ckptd_icrc_clmul(const uint8_t *hdr, uint64_t hn, const uint8_t *p, uint64_t n, int wide) noexcept nogil
    uint64_t K128_LO, K128_HI, K256_LO, K256_HI, K512_LO, K512_HI, K1024_LO, K1024_HI
    uint64_t K95, K63, CRC_MU_REFL, CRC_P_REFL
    void ckptd_crc_table_init() noexcept nogil

cdef extern from "lines.h":
    int ckptd_ll_unpack(const uint8_t *inp, int64_t lines, uint32_t flag, uint8_t *out) noexcept nogil
    int ckptd_ll128_unpack(const uint8_t *inp, int64_t halves, uint64_t flag, uint8_t *out) noexcept nogil
    int ckptd_bit(const uint8_t *b, int64_t k) noexcept nogil
    int64_t ckptd_bits_count(const uint8_t *b, int64_t s, int64_t n) noexcept nogil
    void ckptd_bits_set(uint8_t *b, int64_t s, int64_t n) noexcept nogil

from cython_ext.wire cimport *

# the wire constants as compiled (cython_ext/wire.pxd), for the test that checks them
# against the Python references
WIRE = dict(
    LT_ETHERNET=LT_ETHERNET, LT_RAW=LT_RAW, LT_LINUX_SLL=LT_LINUX_SLL, LT_IPV4=LT_IPV4,
    LT_IPV6=LT_IPV6, LT_LINUX_SLL2=LT_LINUX_SLL2, ETH_TYPE_IPV4=ETH_TYPE_IPV4,
    ETH_TYPE_IPV6=ETH_TYPE_IPV6, TPIDS=(TPID_8021Q, TPID_8021AD, TPID_9100), PROTO_UDP=PROTO_UDP,
    PROTO_GRE=PROTO_GRE, GRE_PROTO_ERSPAN=GRE_PROTO_ERSPAN, GRE_PROTO_ERSPAN3=GRE_PROTO_ERSPAN3,
    GRE_PROTO_TEB=GRE_PROTO_TEB, ERSPAN2_LEN=ERSPAN2_LEN, ERSPAN3_LEN=ERSPAN3_LEN,
    ERSPAN3_PLATFORM_LEN=ERSPAN3_PLATFORM_LEN, ROCEV2_PORT=ROCEV2_PORT, UDP_LEN=UDP_LEN, BTH_LEN=BTH_LEN,
    ICRC_LEN=ICRC_LEN, WRITE_FIRST=WRITE_FIRST, WRITE_MIDDLE=WRITE_MIDDLE, WRITE_LAST=WRITE_LAST,
    WRITE_LAST_IMM=WRITE_LAST_IMM, WRITE_ONLY=WRITE_ONLY, WRITE_ONLY_IMM=WRITE_ONLY_IMM,
    ACKNOWLEDGE=ACKNOWLEDGE, PSN_MASK=PSN_MASK, PSN_MOD=PSN_MOD, LL_LINE=LL_LINE,
    LL_DATA_PER_LINE=LL_DATA_PER_LINE)


# -- constants shared with ckptd/fast/pipeline.py ---------------------------------------------
# Frame classes: index into the per-stream class counts (order: CLASS_NAMES)
cdef enum:
    K_FRAMES = 0
    K_ROCE_DATA = 1
    K_ROCE_ACK = 2
    K_OTHER = 3
    K_TRUNCATED = 4
    K_BAD_ICRC = 5
    K_UNKNOWN_OPCODE = 6
    K_MALFORMED = 7
    K_OTHER_ROCE = 8
    NCLASSES = 9
    K_ENCAPSULATED = -1  # GRE (ERSPAN) the kernel does not unwrap: the reference decapsulates it
CLASS_NAMES = ("frames", "roce_data", "roce_ack", "other", "truncated", "bad_icrc",
               "unknown_opcode", "malformed", "other_roce")

# Extractor counters (ckptd/transports/roce/extract.py) plus the pipeline's `late`
cdef enum:
    C_BEFORE_START = 0
    C_SCHEDULE_MISMATCH = 1
    C_LL_FLAG_MISMATCH = 2
    C_UNRELATED = 3
    C_AG_PACKETS = 4
    C_RS_PACKETS = 5
    C_LATE = 6
    C_ACKS = 7
    C_OTHER_COLLECTIVE = 8
    C_EARLIER_MICRO_BATCH = 9
    NCOUNTERS = 10
COUNTER_NAMES = ("before_start", "schedule_mismatch", "ll_flag_mismatch", "unrelated",
                 "ag_packets", "rs_packets", "late", "acks", "other_collective_packets",
                 "earlier_micro_batch_packets")

# Why `run` stopped (0: it reached the end of the range)
cdef enum:
    STOP_END = 0
    STOP_UNKNOWN_FLOW = 1  # flow not in the table: FlowBinder must see it
    STOP_ITERATION = 2  # iteration not open (or not held by the kernel)
    STOP_FLAG_BASE = 3  # LL connection whose flag base is not learned yet
    STOP_EXAMPLE = 4  # a rejection, while the reference still keeps examples
    STOP_RS_DUMP = 5  # reduce-scatter step 0 while gradients are dumped
    STOP_RANGE = 6  # placement past the bucket's end: the reference raises
    STOP_CONFLICTS_FULL = 7  # conflict buffer full: drain and resume at this frame
    STOP_ACK = 8  # an ACK the FlowBinder still learns from (its hop is not bound yet)
    STOP_ENCAPSULATED = 9  # GRE/ERSPAN-wrapped frame the kernel does not unwrap: parsers.roce does
    STOP_COMPLETE = 10  # AFTER the frame: it completed a bucket (the pipeline may step or commit)
    STOP_SCATTERED = 11  # LL128 packet not made of whole half blocks: its data is not one run
    STOP_BUFFER = 12  # DDP's module-buffer broadcast whose iteration is not finalized: the reference keeps it
STOP_NAMES = ("end", "unknown_flow", "iteration", "flag_base", "example", "rs_dump",
              "range", "conflicts_full", "ack", "encapsulated", "complete", "scattered", "buffer")

# the wire protocol the kernel decodes (set_tables)
PROTOCOLS = ("simple", "ll", "ll128")
cdef enum:
    PROTO_SIMPLE = 0
    PROTO_LL = 1
    PROTO_LL128 = 2

# Flow table entry kinds
cdef enum:
    FLOW_BOUND = 1
    FLOW_UNRELATED = 2
    ACK_QP = 0xFFFFFFFF  # dest-QP field of ACK keys (QPNs have 24 bits: no clash)


cdef enum:
    KEY_LEN = 40  # flow key: ver, pad[3], dest QP u32 LE, src[16], dst[16]
    HDR_MAX = 120  # masked ICRC headers copied to the stack up to this size
    MAX_MTU = 4096
    MAX_LINE_DATA = 3840  # the data of one MTU of LL lines (2048) or LL128 half blocks (4 x 960)
    LL128_HALF = 1024  # wire bytes of an LL128 half block, 960 of them data
    LL128_HALF_DATA = 960

MAX_SLOTS = 8                  # open iterations the kernel holds at once
cdef int64_t INT64_MAX_ITER = 0x7FFFFFFFFFFFFFFF  # s_low before any packet
FLOWS_START = 64               # flow entries allocated at first (the table grows itself)
CONFLICT_CAP = 4096

# the ICRC starts with 8 bytes of 0xFF standing in for the InfiniBand LRH: fold them once
cdef uint8_t _LRH[8]
memset(_LRH, 0xFF, 8)
cdef uint32_t LRH_CRC = ckptd_crc_zlib(0, _LRH, 8)


cdef struct Frame:
    # What decode_frame found (parsers/roce.py RoceFrame, the fields the kernel needs)
    int cls
    int ip_ver
    int64_t ip_off
    int64_t udp_off
    int64_t bth_off
    int64_t icrc_off
    int64_t payload_off
    int64_t payload_len
    int opcode


cdef inline uint32_t be16(const uint8_t *p) noexcept nogil:
    return (<uint32_t>p[0] << 8) | p[1]

cdef inline uint32_t be24(const uint8_t *p) noexcept nogil:
    return (<uint32_t>p[0] << 16) | (<uint32_t>p[1] << 8) | p[2]

cdef inline uint32_t be32(const uint8_t *p) noexcept nogil:
    return (<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | p[3]

cdef inline uint32_t le32(const uint8_t *p) noexcept nogil:
    cdef uint32_t v
    memcpy(&v, p, 4)
    return v  # x86 and every other target we build for are little-endian

cdef inline bint is_tpid(uint32_t t) noexcept nogil:
    # parsers/ethernet.py VLAN_TPIDS: 802.1Q, 802.1ad (QinQ), pre-standard 0x9100
    return t == TPID_8021Q or t == TPID_8021AD or t == TPID_9100

cdef inline int64_t psn_diff(int64_t a, int64_t b) noexcept nogil:
    # ckptd/core/psn.py psn_diff: a - b as a signed distance in (-2**23, 2**23]
    cdef int64_t d = (a - b) & PSN_MASK
    return d - PSN_MOD if d > PSN_HALF else d

cdef inline int64_t psn_unwrap(int64_t psn, int64_t near) noexcept nogil:
    # ckptd/core/psn.py psn_unwrap: the unbounded position with these low 24 bits nearest `near`
    return near + psn_diff(psn, near & PSN_MASK)


# -- CRC entry points for tests and benchmarks ---------------------------------------------
CRC_IMPLS = ("zlib", "clmul", "vclmul", "external")

# fold distance in bits -> (K_lo, K_hi), as compiled (see ckptd.fast.pipeline.fold_constants)
FOLD_CONSTANTS = {128: (K128_LO, K128_HI), 256: (K256_LO, K256_HI), 512: (K512_LO, K512_HI),
                  1024: (K1024_LO, K1024_HI)}
# the final reduction: (x^95 mod P, x^63 mod P) reflected, mu and P reflected
REDUCTION_CONSTANTS = (K95, K63, CRC_MU_REFL, CRC_P_REFL)
ckptd_crc_table_init()


def cpu_features():
    """{'clmul': bool, 'vclmul': bool}: which folding CRCs this CPU runs."""
    return {"clmul": bool(ckptd_cpu_clmul()), "vclmul": bool(ckptd_cpu_vclmul())}


cdef ckptd_crc_fn _crc_fn(int impl, size_t external) noexcept:
    if impl == 1:
        return ckptd_crc_clmul
    if impl == 2:
        return ckptd_crc_vclmul
    if impl == 3 and external:
        return <ckptd_crc_fn>external
    return ckptd_crc_zlib


def crc32(const uint8_t[::1] data, uint32_t crc=0, int impl=0, size_t external=0):
    """zlib.crc32(data, crc) through implementation `impl` (index into CRC_IMPLS)."""
    if impl in (1, 2) and not ckptd_cpu_clmul() or impl == 2 and not ckptd_cpu_vclmul():
        raise ValueError(f"CRC implementation {CRC_IMPLS[impl]} needs a CPU feature this one lacks")
    cdef ckptd_crc_fn f = _crc_fn(impl, external)
    cdef uint64_t n = data.shape[0]
    if n == 0:
        return crc
    with nogil:
        crc = f(crc, &data[0], n)
    return crc


def crc32_frames(const uint8_t[::1] buf, const int64_t[::1] offsets, const int64_t[::1] lengths,
                 int impl=0, size_t external=0):
    """XOR of the CRC-32 of every frame: a benchmark of `impl` on frame-sized calls."""
    cdef ckptd_crc_fn f = _crc_fn(impl, external)
    cdef Py_ssize_t i
    cdef uint32_t acc = 0
    with nogil:
        for i in range(offsets.shape[0]):
            acc ^= f(0, &buf[offsets[i]], lengths[i])
    return acc


def ll_unpack_into(const uint8_t[::1] payload, uint8_t[::1] out, uint32_t flag):
    """(ckptd.transports.roce.extract.ll_unpack without the flag learning) data of whole lines into
    `out`; True when every flag equals `flag`."""
    cdef int64_t lines = payload.shape[0] // LL_LINE
    if out.shape[0] < lines * 8:
        raise ValueError(f"out holds {out.shape[0]} bytes, {lines * 8} needed")
    if lines == 0:
        return True
    cdef int ok
    with nogil:
        ok = ckptd_ll_unpack(&payload[0], lines, flag, &out[0])
    return bool(ok)


def ll128_unpack_into(const uint8_t[::1] payload, uint8_t[::1] out, uint64_t flag):
    """(ckptd.core.ll128.decode for whole half blocks, without the flag learning) the data of
    whole 1024-byte half blocks into `out`, in data order; True when every flag equals `flag`."""
    cdef int64_t halves = payload.shape[0] // LL128_HALF
    if payload.shape[0] % LL128_HALF:
        raise ValueError(f"{payload.shape[0]} bytes are not whole LL128 half blocks")
    if out.shape[0] < halves * LL128_HALF_DATA:
        raise ValueError(f"out holds {out.shape[0]} bytes, {halves * LL128_HALF_DATA} needed")
    if halves == 0:
        return True
    cdef int ok
    with nogil:
        ok = ckptd_ll128_unpack(&payload[0], halves, flag, &out[0])
    return bool(ok)


# -- source helpers --------------------------------------------------------------------------
cdef extern from *:
    void __builtin_prefetch(const void *addr) noexcept nogil

# How many frames ahead `run` asks for a frame's first two cache lines (its headers up
# to the RETH). A Batch's frames were last touched on the reader's core, usually long
# enough ago to be out of the caches, and decode cannot start before its header is in.
cdef enum:
    PREFETCH_AHEAD = 8


cdef int64_t index_records(const uint8_t *buf, int64_t n, int64_t *pos, int64_t stop, bint big_endian,
                           int64_t base, int64_t cap, int64_t *offsets, int64_t *caplen, int64_t *origlen,
                           int64_t *ts_sec, int64_t *ts_frac, BatchKernel checker, int linktype,
                           uint8_t *checked, bint *clean) noexcept nogil:
    """index_pcap's walk over the n bytes of one file: the records that start in
    [*pos, stop), at most cap; *pos ends where the next record starts. Returns how many.
    A checker (NULL for none) checks each frame's ICRC into checked."""
    cdef int64_t p = pos[0], k = 0, nxt
    cdef uint32_t sec, frac, cl, ol
    cdef Frame f
    clean[0] = True
    if stop > n:
        stop = n
    while p < stop:
        if p + 16 > n or k >= cap:
            clean[0] = p + 16 <= n and k < cap
            break
        if big_endian:
            sec, frac, cl, ol = be32(&buf[p]), be32(&buf[p + 4]), be32(&buf[p + 8]), be32(&buf[p + 12])
        else:
            sec, frac, cl, ol = le32(&buf[p]), le32(&buf[p + 4]), le32(&buf[p + 8]), le32(&buf[p + 12])
        # parsers.frame.MAX_SNAPLEN; more bytes captured than on the wire: a broken header
        if cl > 262144 or cl > ol or p + 16 + cl > n:
            clean[0] = False
            break
        offsets[k] = base + p + 16
        caplen[k] = cl
        origlen[k] = ol
        ts_sec[k] = sec
        ts_frac[k] = frac
        nxt = p + 16 + cl
        if checker is not None:
            if nxt < n:
                __builtin_prefetch(&buf[nxt])
            checked[k] = checker.decode_frame(&buf[p + 16] if cl else NULL, cl, ol, linktype, &f) \
                in (K_ROCE_DATA, K_ROCE_ACK)
        k += 1
        p = nxt
    pos[0] = p
    return k


def index_pcap(const uint8_t[::1] buf, int64_t start, int64_t stop, bint big_endian, int64_t base,
               int64_t[::1] offsets, int64_t[::1] caplen, int64_t[::1] origlen,
               int64_t[::1] ts_sec, int64_t[::1] ts_frac,
               BatchKernel checker=None, int linktype=0, uint8_t[::1] checked=None):
    """Walk the pcap records that start in [start, stop) (start: after the file header,
    or where the last walk ended; buf: the whole file) and fill the arrays (offsets get
    `base` added). Returns (frames, end, clean): end is where the next record starts;
    clean is False when the file ends inside a record or a record is implausible, where
    parsers/pcap.py would raise CaptureError; the caller then asks that reader for the
    exact error. Arrays of (stop - start) // 16 + 1 frames always suffice: a record
    takes at least its 16-byte header.

    With a checker (a kernel with opcode tables and a CRC) each frame's ICRC is checked
    as it is indexed, as check_icrc would (checked[k]; linktype: the file's). Walking
    the headers alone waits on memory at every record (the next header's place is in
    this one); here the next header is fetched while this frame's CRC runs."""
    cdef int64_t pos = start, k, cap = offsets.shape[0]
    cdef bint clean
    if caplen.shape[0] < cap or origlen.shape[0] < cap or ts_sec.shape[0] < cap or ts_frac.shape[0] < cap:
        raise ValueError("the per-frame arrays must be as long as offsets")
    if checker is not None and (checked is None or checked.shape[0] < cap):
        raise ValueError("checked must hold as many frames as offsets")
    if checker is not None and checker.op_known is None:
        raise RuntimeError("opcode tables not set")
    if cap == 0:
        return 0, start, start >= min(stop, buf.shape[0])
    with nogil:
        k = index_records(&buf[0], buf.shape[0], &pos, stop, big_endian, base, cap, &offsets[0], &caplen[0],
                          &origlen[0], &ts_sec[0], &ts_frac[0], checker, linktype,
                          &checked[0] if checker is not None else NULL, &clean)
    return k, pos, clean


# how far a stream of PcapMerge has read
cdef enum:
    MERGE_READING = 0  # chunks left to index
    MERGE_ENDED = 1  # read to the end of the file
    MERGE_CUT = 2  # ends inside a record, or a record is implausible: no chunk after this one
    MERGE_CUT_REPORTED = 3  # ... and every frame before the cut handed out (cut_short)


cdef class PcapMerge:
    """Several pcap files mapped in one buffer (cython_ext/filemap.pyx), each indexed a
    chunk at a time (index_pcap's walk, ICRCs checked on the way with a checker) and
    merged in capture-time order (merge_order's order: time, then stream), a Batch's
    index per `next_batch`. A Batch ends where some stream's indexed chunk runs out, as
    ckptd.fast.batches' merge of separate sources does. Indexing and merging run in one
    call without the GIL: the reader thread that calls it otherwise waits for the GIL at
    every numpy call, up to the switch interval (5 ms) each time the pipeline is running
    Python (benchmarks/RESULTS.md, session 17)."""
    cdef const uint8_t[::1] buf
    cdef BatchKernel checker
    cdef int64_t k, cap, chunk
    cdef int64_t[::1] base, size, pos, tick, shift, first_no, head, count
    cdef int32_t[::1] linktype
    cdef uint8_t[::1] big, state
    cdef int64_t[:, ::1] offsets, caplen, origlen, sec, frac, ts
    cdef uint8_t[:, ::1] checked

    def __init__(self, const uint8_t[::1] buf, list files, int64_t chunk_bytes, BatchKernel checker=None):
        """files: per stream, (where its file starts in buf, its size, big-endian, ns per
        timestamp tick, linktype, ns taken off its times: ckptd.core.clock), or None for a
        stream with no frames."""
        if chunk_bytes < 1:
            raise ValueError("chunk_bytes must be at least 1")
        if checker is not None and checker.op_known is None:
            raise RuntimeError("opcode tables not set")
        self.buf, self.checker, self.chunk = buf, checker, chunk_bytes
        self.k = len(files)
        self.cap = chunk_bytes // 16 + 1
        k = self.k
        self.base, self.size, self.pos = np.zeros(k, np.int64), np.zeros(k, np.int64), np.full(k, 24, np.int64)
        self.tick, self.first_no = np.ones(k, np.int64), np.ones(k, np.int64)
        self.shift = np.zeros(k, np.int64)
        self.head, self.count = np.zeros(k, np.int64), np.zeros(k, np.int64)
        self.linktype, self.big = np.zeros(k, np.int32), np.zeros(k, np.uint8)
        self.state = np.full(k, MERGE_ENDED, np.uint8)
        for s, f in enumerate(files):
            if f is None:
                continue
            start, size, big, tick, linktype, shift = f
            if start < 0 or size < 0 or start + size > buf.shape[0]:
                raise ValueError(f"stream {s}: bytes {start}..{start + size} are outside the buffer")
            self.base[s], self.size[s], self.big[s], self.tick[s], self.linktype[s] = start, size, big, tick, linktype
            self.shift[s] = shift
            self.state[s] = MERGE_READING
        self.offsets, self.caplen, self.origlen = (np.empty((k, self.cap), np.int64) for _ in range(3))
        self.sec, self.frac, self.ts = (np.empty((k, self.cap), np.int64) for _ in range(3))
        self.checked = np.empty((k, self.cap if checker is not None else 1), np.uint8)

    cdef void _refill(self, int64_t s) noexcept nogil:
        """Stream s's next chunk indexed, where the last one is all handed out."""
        cdef int64_t i, n
        cdef bint clean
        while self.head[s] == self.count[s] and self.state[s] == MERGE_READING:
            self.head[s] = 0
            self.first_no[s] += self.count[s]
            self.count[s] = 0
            if self.pos[s] >= self.size[s]:
                self.state[s] = MERGE_ENDED
                return
            n = index_records(&self.buf[self.base[s]], self.size[s], &self.pos[s], self.pos[s] + self.chunk,
                              self.big[s], self.base[s], self.cap, &self.offsets[s, 0], &self.caplen[s, 0],
                              &self.origlen[s, 0], &self.sec[s, 0], &self.frac[s, 0], self.checker,
                              self.linktype[s], &self.checked[s, 0] if self.checker is not None else NULL,
                              &clean)
            for i in range(n):
                self.ts[s, i] = self.sec[s, i] * 1_000_000_000 + self.frac[s, i] * self.tick[s]
                if self.ts[s, i] == 0:  # no timestamp: its frame number (CapturedFrame.merge_time)
                    self.ts[s, i] = self.first_no[s] + i
                else:
                    self.ts[s, i] -= self.shift[s]
            self.count[s] = n
            if not clean:
                self.state[s] = MERGE_CUT

    def next_batch(self):
        """(offsets, caplen, origlen, stream, linktype, frame_no, ts, icrc_checked or None)
        of the next Batch, or None when every stream is read out. Streams that ended
        early (see MERGE_CUT) are listed by cut_short() once their last frame is out."""
        cdef int64_t s, total = 0
        with nogil:
            for s in range(self.k):
                self._refill(s)
                total += self.count[s] - self.head[s]
        if total == 0:
            return None
        out = [np.empty(total, np.int64) for _ in range(3)] + [np.empty(total, np.int32) for _ in range(2)] + \
              [np.empty(total, np.int64) for _ in range(2)]
        checked = np.empty(total, np.uint8) if self.checker is not None else None
        cdef int64_t[::1] o_off = out[0], o_cap = out[1], o_orig = out[2], o_no = out[5], o_ts = out[6]
        cdef int32_t[::1] o_stream = out[3], o_link = out[4]
        cdef uint8_t[::1] o_chk = checked if checked is not None else np.empty(1, np.uint8)
        cdef int64_t i = 0, best, h, t, bt
        cdef bint check = self.checker is not None
        with nogil:
            while True:
                best, bt = -1, 0
                for s in range(self.k):
                    if self.head[s] < self.count[s]:
                        t = self.ts[s, self.head[s]]
                        if best < 0 or t < bt:  # ties: the lower stream, as merge_order
                            best, bt = s, t
                h = self.head[best]
                o_off[i], o_cap[i], o_orig[i] = self.offsets[best, h], self.caplen[best, h], self.origlen[best, h]
                o_stream[i], o_link[i] = <int32_t>best, self.linktype[best]
                o_no[i], o_ts[i] = self.first_no[best] + h, bt
                if check:
                    o_chk[i] = self.checked[best, h]
                i += 1
                self.head[best] = h + 1
                if h + 1 == self.count[best]:
                    break  # past here the order needs best's next chunk
        return tuple(a[:i] for a in out) + (None if checked is None else checked[:i],)

    def cut_short(self) -> list:
        """Streams whose file ended early (MERGE_CUT) and whose every frame before that is
        now handed out; each is listed once."""
        out = []
        for s in range(self.k):
            if self.state[s] == MERGE_CUT and self.head[s] == self.count[s]:
                self.state[s] = MERGE_CUT_REPORTED
                out.append(s)
        return out


def merge_order(list ts_per_stream):
    """The order heapq.merge(key=(ts, stream, index)) yields the frames of several
    streams in (ckptd/pipeline.py file_source): repeatedly the smallest head. Returns
    (stream, index) int64 arrays. Exact even when a stream's times go backwards."""
    cdef Py_ssize_t k = len(ts_per_stream), total = 0, i, s, best
    arrays = [np.ascontiguousarray(ts, dtype=np.int64) for ts in ts_per_stream]
    for a in arrays:
        total += a.shape[0]
    out_s = np.empty(total, np.int64)
    out_i = np.empty(total, np.int64)
    cdef int64_t[::1] os_ = out_s, oi = out_i
    heads = np.zeros(k, np.int64)
    lens = np.array([a.shape[0] for a in arrays], np.int64)
    ptrs = np.array([a.ctypes.data for a in arrays], np.uint64)
    cdef int64_t[::1] h = heads, ln = lens
    cdef uint64_t[::1] pp = ptrs
    cdef int64_t t, bt
    with nogil:
        for i in range(total):
            best = -1
            bt = 0
            for s in range(k):
                if h[s] < ln[s]:
                    t = (<int64_t *>pp[s])[h[s]]
                    if best < 0 or t < bt:  # ties: the lower stream number, as the key says
                        best, bt = s, t
            os_[i] = best
            oi[i] = h[best]
            h[best] += 1
    return out_s, out_i


# -- flow keys ------------------------------------------------------------------------------
cdef inline void make_key(uint32_t dqp, const uint8_t *src, const uint8_t *dst, int alen,
                          uint8_t *key) noexcept nogil:
    """A flow (source, destination, dest QP) as FlowBinder names it, in KEY_LEN bytes:
    IP version, 3 zero bytes, dest QP (LE), source and destination zero-padded to 16."""
    memset(key, 0, KEY_LEN)
    key[0] = 4 if alen == 4 else 6
    memcpy(&key[4], &dqp, 4)
    memcpy(&key[8], src, alen)
    memcpy(&key[24], dst, alen)


cdef inline uint64_t hash_key(const uint8_t *key) noexcept nogil:
    """The key's five 64-bit words, multiply-xorshift mixed."""
    cdef uint64_t h = 0, w
    cdef int i
    for i in range(KEY_LEN // 8):
        memcpy(&w, key + 8 * i, 8)
        h = (h ^ w) * 0x9E3779B97F4A7C15ULL
        h ^= h >> 29
    return h


def flow_key(bytes src not None, bytes dst not None, uint32_t dqp):
    """The kernel's key of a flow: packed source and destination addresses (both 4 or
    both 16 bytes, ipaddress's .packed) and the destination QP (ACK_QP for a hop's ACKs)."""
    if len(src) != len(dst) or len(src) not in (4, 16):
        raise ValueError(f"addresses of {len(src)} and {len(dst)} bytes: both 4 (IPv4) or both 16 (IPv6)")
    cdef uint8_t key[KEY_LEN]
    make_key(dqp, src, dst, len(src), key)
    return bytes(key[:KEY_LEN])


FLOW_KINDS = {"bound": FLOW_BOUND, "unrelated": FLOW_UNRELATED}
ACK_FLOW_QP = <uint32_t>ACK_QP  # the dest QP of a hop's ACK key


# -- the kernel ----------------------------------------------------------------------------
cdef class BatchKernel:
    """Decode, place and assemble frames; see the module docstring for the contract.

    The plan's tables (opcodes, compiled schedule) come in through set_tables, read only;
    the flow table, flag bases, iteration slots with their buffers, and the output
    counts are the kernel's own, changed from Python only through its methods.
    """
    # options
    cdef public bint trust_icrc       # skip the ICRC check: the NIC already did it
    cdef public int protocol          # PROTO_SIMPLE, PROTO_LL or PROTO_LL128 (index in PROTOCOLS)
    cdef public bint examples_open    # the reference still records rejection examples
    cdef public bint dump_rs          # hand reduce-scatter step-0 placements to Python
    cdef public int64_t done          # pipeline: iterations <= done are finalized
    cdef public int64_t highest       # pipeline: the newest iteration a placement reached
    cdef public int64_t mtu
    cdef public int crc_impl
    cdef ckptd_crc_fn crc_fn
    cdef int64_t nstreams

    # opcode table (parsers/opcodes.py)
    cdef uint8_t[::1] op_known, op_payload, op_is_ack
    cdef int64_t[::1] op_ext_len, op_decoded_end

    # compiled schedule (ckptd/fast/pipeline.py CompiledSchedule)
    cdef int64_t[::1] tl_conn                 # timeline -> connection index
    cdef int64_t[:, ::1] tl_npkts             # [layout, timeline]
    cdef int64_t[::1] tl_cycle                # [timeline] packets of layouts nprefix.. (one QP-rotation period)
    cdef readonly int64_t nlayouts            # nprefix + the rotation period (Plan.timeline_schedules)
    cdef readonly int64_t nprefix             # the opening layouts (Plan.timeline_prefix: 1, 2 with static_graph)
    cdef public int64_t per_step              # wire rounds per training iteration (Plan.allreduces_per_step)
    cdef int64_t cts_bytes                    # RDMA WRITE (no imm) carries data unless this long; -1: never
    cdef int64_t[:, ::1] tl_mlo, tl_mhi       # [layout, timeline] message index range
    cdef int64_t[:, ::1] tl_recv_off          # [layout, timeline] offset in a received map
    cdef int64_t[::1] recv_total              # [layout] packets of all timelines
    cdef int64_t[:, ::1] conn_steps           # [opening round 0 .. nprefix-1, then a rebuilt round, connection] sends
    cdef int64_t[::1] m_start, m_npkts, m_wire_len, m_wire_offset, m_bucket, m_offset
    cdef int64_t[::1] m_nelem, m_phase, m_step, m_ring_step
    cdef uint32_t[::1] m_imm                  # the immediate's 4 wire bytes, read LE
    cdef int64_t[::1] m_has_imm               # 0: a plain RDMA WRITE (data before a 0-byte WRITE_WITH_IMM)
    cdef int64_t[::1] m_keep                  # 1: a module-buffer broadcast send (Plan.buffer_others)
    cdef int64_t[:, ::1] b_itemsize, b_count  # [layout, bucket]
    cdef int64_t[::1] b_nbuckets              # [layout]

    # flow table, owned here (add_flow, anchor, set_anchor): open addressing over entries
    cdef int64_t[::1] ft_slots                # hash slot -> entry, -1 empty (a power of 2)
    cdef uint8_t[:, ::1] fe_key
    cdef int64_t[::1] fe_kind, fe_tl, fe_base, fe_last, fe_msg
    cdef int64_t nflows

    # LL flag bases per connection (Extractor.flag_base)
    cdef uint8_t[::1] fb_known
    cdef int64_t[::1] fb_value

    # live iterations (done < it <= highest): their received maps, and the assembly
    # once the pipeline has opened one
    cdef int64_t[::1] slot_iter, slot_layout, slot_has_asm
    cdef int64_t[:, :, ::1] slot_ptr          # [slot, bucket, 0 data | 1 covered | 2+s by_stream]
    cdef int64_t[::1] slot_recv               # pointer to uint8[nstreams, recv_total[layout]]
    cdef int64_t[:, ::1] slot_counts          # [slot, 0 packets | 1 bytes | 2 stop after any placement]
    cdef int64_t[:, :, ::1] slot_bucket       # [slot, bucket, 0 newly covered | 1 still uncovered]

    # how far each stream's copies have come (Pipeline.copies_seen, read by progress):
    # the newest training iteration it carried a packet of, and the batch frame of that
    # stream's newest such packet since the last read (-1: none)
    cdef int64_t[::1] s_iter, s_frame, s_low   # s_low: its oldest iteration since the last read
    cdef int64_t cur_frame

    # outputs, folded into the reference's objects by drain
    cdef int64_t[:, ::1] classes              # [stream, class]
    cdef int64_t[::1] counters
    cdef int64_t[:, ::1] conflicts            # (iteration, stream, bucket, start, end)
    cdef public int64_t nconflicts
    # per slot (Python lists): received map and assembly buffers; free ones per layout
    cdef object recv_maps, buffers, free_recv, free_buffers

    # the batch being processed (set_batch), and what decode found in the last frame
    cdef const uint8_t[::1] b_buf
    cdef const int64_t[::1] b_offsets, b_caplen, b_origlen
    cdef const int32_t[::1] b_stream, b_linktype
    cdef const uint8_t[::1] b_checked
    cdef Frame last

    def __init__(self, int nstreams):
        self.nstreams = nstreams
        self.trust_icrc = False
        self.examples_open = True
        self.dump_rs = False
        self.done = -1
        self.highest = -1
        self.crc_impl = 0
        self.crc_fn = ckptd_crc_zlib
        self.nconflicts = 0
        self.s_iter = np.full(max(nstreams, 1), -1, np.int64)
        self.s_frame = np.full(max(nstreams, 1), -1, np.int64)
        self.s_low = np.full(max(nstreams, 1), INT64_MAX_ITER, np.int64)
        self.cur_frame = -1
        self._flow_arrays(FLOWS_START, 0)

    def set_crc(self, int impl, size_t external=0):
        if impl in (1, 2) and not ckptd_cpu_clmul() or impl == 2 and not ckptd_cpu_vclmul():
            raise ValueError(f"CRC implementation {CRC_IMPLS[impl]} needs a CPU feature this one lacks")
        if impl == 3 and not external:
            raise ValueError("external CRC implementation needs a function address")
        self.crc_impl = impl
        self.crc_fn = _crc_fn(impl, external)

    def set_opcodes(self, *, op_known, op_payload, op_is_ack, op_ext_len, op_decoded_end):
        """The opcode tables (ckptd/fast/pipeline.py opcode_tables): all that decoding
        and check_icrc need."""
        self.op_known, self.op_payload, self.op_is_ack = op_known, op_payload, op_is_ack
        self.op_ext_len, self.op_decoded_end = op_ext_len, op_decoded_end

    def set_tables(self, *, op_known, op_payload, op_is_ack, op_ext_len, op_decoded_end,
                   tl_conn, tl_npkts, tl_cycle, tl_mlo, tl_mhi, tl_recv_off, recv_total, conn_steps,
                   m_start, m_npkts, m_wire_len, m_wire_offset, m_bucket, m_offset, m_nelem,
                   m_phase, m_step, m_ring_step, m_imm, m_has_imm, b_itemsize, b_count, b_nbuckets,
                   mtu, protocol, cts_bytes=-1, m_keep=None, per_step=1):
        """The plan's tables (ckptd/fast/pipeline.py opcode_tables, CompiledSchedule), read
        only; the kernel allocates its own flow table, flag bases, iteration slots and
        output counts."""
        self.set_opcodes(op_known=op_known, op_payload=op_payload, op_is_ack=op_is_ack,
                         op_ext_len=op_ext_len, op_decoded_end=op_decoded_end)
        self.tl_conn, self.tl_npkts, self.tl_mlo, self.tl_mhi = tl_conn, tl_npkts, tl_mlo, tl_mhi
        self.tl_recv_off, self.recv_total, self.conn_steps = tl_recv_off, recv_total, conn_steps
        self.m_start, self.m_npkts, self.m_wire_len = m_start, m_npkts, m_wire_len
        self.m_wire_offset, self.m_bucket, self.m_offset = m_wire_offset, m_bucket, m_offset
        self.m_nelem, self.m_phase, self.m_step, self.m_ring_step = m_nelem, m_phase, m_step, m_ring_step
        self.m_imm, self.m_has_imm = m_imm, m_has_imm
        self.m_keep = m_keep if m_keep is not None else np.zeros(len(m_start), np.int64)
        self.tl_cycle, self.nlayouts, self.cts_bytes = tl_cycle, tl_npkts.shape[0], cts_bytes
        self.nprefix = conn_steps.shape[0] - 1
        if not 1 <= self.nprefix < self.nlayouts:
            raise ValueError(f"conn_steps has {conn_steps.shape[0]} rows for {self.nlayouts} layouts: "
                             "the opening rounds' and a rebuilt round's")
        if per_step < 1:
            raise ValueError(f"per_step {per_step}: at least 1")
        self.per_step = per_step
        self.b_itemsize, self.b_count, self.b_nbuckets = b_itemsize, b_count, b_nbuckets
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol {protocol!r} is not one of {PROTOCOLS}")
        self.mtu, self.protocol = mtu, PROTOCOLS.index(protocol)
        if mtu > MAX_MTU:
            raise ValueError(f"path MTU {mtu} above {MAX_MTU}")
        nconn = max(conn_steps.shape[1], 1)
        self.fb_known, self.fb_value = np.zeros(nconn, np.uint8), np.zeros(nconn, np.int64)
        nb = max(b_count.shape[1], 1)
        self.slot_iter = np.full(MAX_SLOTS, -1, np.int64)
        self.slot_layout = np.zeros(MAX_SLOTS, np.int64)
        self.slot_has_asm = np.zeros(MAX_SLOTS, np.int64)
        self.slot_ptr = np.zeros((MAX_SLOTS, nb, 2 + self.nstreams), np.int64)
        self.slot_recv = np.zeros(MAX_SLOTS, np.int64)
        self.slot_counts = np.zeros((MAX_SLOTS, 3), np.int64)
        self.slot_bucket = np.zeros((MAX_SLOTS, nb, 2), np.int64)
        self.classes = np.zeros((max(self.nstreams, 1), NCLASSES), np.int64)
        self.counters = np.zeros(NCOUNTERS, np.int64)
        self.conflicts = np.zeros((CONFLICT_CAP, 5), np.int64)
        self.recv_maps = [None] * MAX_SLOTS
        self.buffers = [None] * MAX_SLOTS
        self.free_recv = {k: [] for k in range(self.nlayouts)}
        self.free_buffers = {k: [] for k in range(self.nlayouts)}

    # -- iterations: tracked, opened, closed (the pipeline decides when) ------------------
    def slot_of(self, int64_t iteration):
        """The slot holding an iteration, or -1."""
        cdef int64_t q
        for q in range(MAX_SLOTS):
            if self.slot_iter[q] == iteration:
                return q
        return -1

    def layout_of(self, int64_t iteration):
        """The layout an iteration's packets follow: that of its step's last wire round
        (the opening rounds' 0 .. nprefix - 1, then the QP rotation's nprefix .. nlayouts - 1)."""
        cdef int64_t w = (iteration + 1) * self.per_step - 1, p = self.nprefix
        return w if w < p else p + (w - p) % (self.nlayouts - p)

    cdef inline int64_t sends_before(self, int64_t conn, int64_t it) noexcept nogil:
        """Plan.sends_before: the connection's sends before wire round `it`."""
        cdef int64_t k, n = 0, p = self.nprefix
        for k in range(it if it < p else p):
            n += self.conn_steps[k, conn]
        if it > p:
            n += (it - p) * self.conn_steps[p, conn]
        return n

    def _new_recv(self, int64_t layout):
        return np.zeros((self.nstreams, max(self.recv_total[layout], 1)), np.uint8)

    def _new_buffers(self, int64_t layout):
        """An iteration's buffers. The data are not zeroed: no element is read before a
        placement writes it (assemble compares only covered elements, and the shadow
        takes only whole buckets; --dump-gradients zeroes what no stream delivered).
        Zeroing a reused 2.6M-parameter iteration's data took 1-2 ms of the capture
        loop per iteration."""
        cdef int64_t b, nb = self.b_nbuckets[layout]
        data = [np.empty(self.b_count[layout, b], f"u{self.b_itemsize[layout, b]}") for b in range(nb)]
        covered = [np.zeros((self.b_count[layout, b] + 7) // 8, np.uint8) for b in range(nb)]
        by_stream = [[np.zeros((self.b_count[layout, b] + 7) // 8, np.uint8) for b in range(nb)]
                     for _ in range(self.nstreams)]
        return data, covered, by_stream

    @staticmethod
    def _zero_buffers(bufs, bint with_data=True):
        data, covered, by_stream = bufs
        for a in (data if with_data else []) + covered + [m for maps in by_stream for m in maps]:
            a.fill(0)

    def reserve(self, int64_t layout, int64_t count):
        """Buffers and a received map for `count` more iterations of this layout, made
        and written now (every page faulted in), kept for reuse. The live daemon reserves
        what its first iterations take, so that placing them touches no fresh memory
        while frames wait in the rings."""
        if not 0 <= layout < self.nlayouts:
            raise ValueError(f"layout {layout}: the plan has layouts 0 .. {self.nlayouts - 1}")
        for _ in range(count):
            recv = self._new_recv(layout)
            recv.fill(0)  # np.zeros maps untouched pages: writing faults them in
            bufs = self._new_buffers(layout)
            self._zero_buffers(bufs)
            self.free_recv[layout].append(recv)
            self.free_buffers[layout].append(bufs)

    def track_iteration(self, int64_t iteration):
        """Keep a received map for a live iteration (its packets' positions, per stream:
        Extractor.stream_loss); False when every slot is taken (its packets then go to
        the reference path). Maps are reused across iterations, cleared."""
        if self.slot_of(iteration) >= 0:
            return True
        cdef int64_t q, slot = -1, layout = self.layout_of(iteration)
        for q in range(MAX_SLOTS):
            if self.slot_iter[q] < 0:
                slot = q
                break
        if slot < 0:
            return False
        free = self.free_recv[layout]
        if free:
            recv = free.pop()
            recv.fill(0)
        else:
            recv = self._new_recv(layout)
        self.recv_maps[slot] = recv
        self.slot_recv[slot] = recv.ctypes.data
        self.slot_layout[slot] = layout
        self.slot_has_asm[slot] = 0
        self.slot_counts[slot, :] = 0
        self.slot_bucket[slot, :, :] = 0
        self.slot_iter[slot] = iteration
        return True

    def open_iteration(self, int64_t iteration):
        """The assembly buffers of a tracked iteration, zeroed, for the pipeline's
        IterationAssembly: (data per bucket as unsigned ints of the element size,
        coverage bitmap per bucket, [per stream: bitmap per bucket]). The kernel places
        into them from now on; they stay the kernel's, and close_iteration takes them
        back for a later iteration of the same layout."""
        cdef int64_t slot = self.slot_of(iteration), layout, b, st
        if slot < 0:
            raise KeyError(f"iteration {iteration} is not tracked")
        if self.slot_has_asm[slot]:
            raise ValueError(f"iteration {iteration} is open already")
        layout = self.slot_layout[slot]
        free = self.free_buffers[layout]
        if free:
            data, covered, by_stream = bufs = free.pop()
            self._zero_buffers(bufs, with_data=False)  # bitmaps only: see _new_buffers
        else:
            data, covered, by_stream = bufs = self._new_buffers(layout)
        for b in range(len(data)):
            self.slot_ptr[slot, b, 0] = data[b].ctypes.data
            self.slot_ptr[slot, b, 1] = covered[b].ctypes.data
            for st in range(self.nstreams):
                self.slot_ptr[slot, b, 2 + st] = by_stream[st][b].ctypes.data
        self.buffers[slot] = bufs
        self.slot_has_asm[slot] = 1
        return bufs

    def close_iteration(self, int64_t iteration):
        """Stop tracking an iteration the pipeline is done with: its received map and
        buffers go back to the kernel for reuse (whoever held them must not use them
        again). The opening layouts' (0 .. nprefix - 1) are let go instead: only
        iteration 0 (with static_graph, 0 and 1) has each, and a daemon would otherwise
        hold a gradient-sized buffer it never uses again."""
        cdef int64_t slot = self.slot_of(iteration), layout
        if slot < 0:
            raise KeyError(f"iteration {iteration} is not tracked")
        layout = self.slot_layout[slot]
        if layout >= self.nprefix:
            self.free_recv[layout].append(self.recv_maps[slot])
            if self.buffers[slot] is not None:
                self.free_buffers[layout].append(self.buffers[slot])
        self.recv_maps[slot] = self.buffers[slot] = None
        self.slot_iter[slot] = -1
        self.slot_has_asm[slot] = 0
        self.slot_ptr[slot] = 0
        self.slot_recv[slot] = 0
        self.slot_counts[slot, :] = 0
        self.slot_bucket[slot, :, :] = 0

    def buffer_bytes(self):
        """Bytes of the iteration memory the kernel holds: buffers lent to open
        iterations, buffers and received maps kept for reuse, received maps in use."""
        def size(bufs):
            data, covered, by_stream = bufs
            return sum(a.nbytes for a in data + covered + [m for maps in by_stream for m in maps])
        return {"lent": sum(size(b) for b in self.buffers if b is not None),
                "kept": sum(size(b) for free in self.free_buffers.values() for b in free)
                + sum(m.nbytes for free in self.free_recv.values() for m in free),
                "received_maps": sum(m.nbytes for m in self.recv_maps if m is not None)}

    def received(self, int64_t iteration):
        """A tracked iteration's received map: uint8[stream, position] (positions: each
        timeline's packets from tl_recv_off on); None if it is not tracked."""
        cdef int64_t slot = self.slot_of(iteration)
        return None if slot < 0 else self.recv_maps[slot]

    def sync(self, int64_t done, int64_t highest, dict assemblies, int64_t every_placement=-1):
        """Follow the pipeline: iterations <= done that it no longer holds open are
        closed, the live ones up to highest tracked (as many as there are slots), and
        for each open iteration (`assemblies`, iteration -> IterationAssembly) the
        elements each bucket still misses are set (the kernel stops after the placement
        that covers a bucket's last one; the reference path places too). The iteration
        `every_placement` stops the kernel after every placement into it."""
        cdef int64_t q, it, slot
        cdef Py_ssize_t b
        for q in range(MAX_SLOTS):
            it = self.slot_iter[q]
            if 0 <= it <= done and it not in assemblies:  # finalized or dropped (joining)
                self.close_iteration(it)
        for it in range(done + 1, highest + 1):
            if not self.track_iteration(it):
                break
        for key, asm in assemblies.items():
            it = key
            slot = self.slot_of(it)
            if slot < 0 or not asm.data:
                continue
            buckets, covered = asm.buckets, asm.bucket_covered
            for b in range(min(len(buckets), self.slot_bucket.shape[1])):
                self.slot_bucket[slot, b, 1] = buckets[b].count - covered[b]
            self.slot_counts[slot, 2] = it == every_placement
        self.done, self.highest = done, highest

    # -- the counts, handed to the reference's objects ---------------------------------
    def drain(self, counters, list classes, dict assemblies, double now):
        """Fold the counts since the last drain into the reference's objects and clear
        them: the Extractor's `counters` (Counter, by COUNTER_NAMES; `late` is returned
        instead, for Pipeline.count_late), the pipeline's per-stream `classes` (Counter
        per stream, by CLASS_NAMES), and each open IterationAssembly in `assemblies`
        (iteration -> assembly): packets, bytes, last_packet = now, bucket_covered,
        ncovered, conflicts (the kernel places only into open iterations; a slot's counts
        are cleared either way). The daemon drains after every kernel run, so this is
        one C loop, not a numpy call per array."""
        cdef int64_t late = 0, v, slot, b, nb, packets, fresh, total, r
        cdef Py_ssize_t c, s
        for c in range(NCOUNTERS):
            v = self.counters[c]
            if v:
                if c == C_LATE:
                    late = v
                else:
                    name = COUNTER_NAMES[c]
                    counters[name] += v
                self.counters[c] = 0
        for s in range(self.classes.shape[0]):
            if self.classes[s, K_FRAMES]:
                row = classes[s]
                for c in range(NCLASSES):
                    v = self.classes[s, c]
                    if v:
                        name = CLASS_NAMES[c]
                        row[name] += v
                        self.classes[s, c] = 0
        cdef bint any_placed = False
        for slot in range(MAX_SLOTS):
            if self.slot_counts[slot, 0]:
                any_placed = True
                break
        if not any_placed and not self.nconflicts:
            return late
        for it, asm in assemblies.items():
            slot = self.slot_of(it)
            if slot < 0:
                continue
            packets = self.slot_counts[slot, 0]
            if packets:
                asm.packets += packets
                asm.bytes += self.slot_counts[slot, 1]
                asm.last_packet = now  # Pipeline.place stamps every placement
                covered = asm.bucket_covered
                nb = min(len(asm.buckets), self.slot_bucket.shape[1])
                total = 0
                for b in range(nb):
                    fresh = self.slot_bucket[slot, b, 0]
                    if fresh:
                        covered[b] += fresh
                        total += fresh
                        self.slot_bucket[slot, b, 0] = 0
                asm.ncovered += total
        for slot in range(MAX_SLOTS):
            self.slot_counts[slot, 0] = 0
            self.slot_counts[slot, 1] = 0
        for r in range(self.nconflicts):
            assemblies[self.conflicts[r, 0]].conflicts.append(
                (self.conflicts[r, 1], self.conflicts[r, 2], self.conflicts[r, 3], self.conflicts[r, 4]))
        self.nconflicts = 0
        return late

    def progress(self):
        """(stream, newest iteration it carried a packet of, batch frame of its newest
        such packet, oldest iteration it carried one of since the last call) for each
        stream that carried one since the last call: what Pipeline.copies_seen records
        for the reference path, packet by packet."""
        out = []
        cdef Py_ssize_t s
        for s in range(self.s_frame.shape[0]):
            if self.s_frame[s] >= 0:
                out.append((s, self.s_iter[s], self.s_frame[s], self.s_low[s]))
                self.s_frame[s] = -1
                self.s_low[s] = INT64_MAX_ITER
        return out

    def stream_newest(self, const int32_t[:] stream, const int64_t[:] ts):
        """The newest capture time of each stream in a batch (0 where it has none): the
        streams' clocks after it (Pipeline.advance_clock)."""
        cdef Py_ssize_t i, n = stream.shape[0]
        newest = np.zeros(self.nstreams, np.int64)
        cdef int64_t[::1] out = newest
        cdef int32_t s
        if ts.shape[0] != n:
            raise ValueError(f"{n} stream ids for {ts.shape[0]} times")
        for i in range(n):
            s = stream[i]
            if s < 0 or s >= out.shape[0]:
                raise IndexError(f"frame {i}: stream {s}, not one of the kernel's {out.shape[0]}")
            if ts[i] > out[s]:
                out[s] = ts[i]
        return newest.tolist()

    # -- the flow table: the reference decides, these record ------------------------------
    def add_flow(self, bytes key not None, int kind, int64_t tl=0, int64_t base=0, int64_t last=0):
        """Enter a flow (key: flow_key()) the reference bound (FLOW_BOUND: its timeline,
        PSN base and anchor) or called unrelated (FLOW_UNRELATED). Returns its entry; a
        flow already in the table keeps its entry and what it was entered with."""
        if len(key) != KEY_LEN:
            raise ValueError(f"a flow key is {KEY_LEN} bytes, not {len(key)}")
        if kind != FLOW_BOUND and kind != FLOW_UNRELATED:
            raise ValueError(f"flow kind {kind}: FLOW_BOUND or FLOW_UNRELATED")
        cdef const uint8_t *k = key
        cdef int64_t e = self.lookup_flow(k)
        if e >= 0:
            return e
        if self.nflows == self.fe_kind.shape[0]:
            self._flow_arrays(2 * self.nflows, self.nflows)
        e = self.nflows
        memcpy(&self.fe_key[e, 0], k, KEY_LEN)
        self.fe_kind[e], self.fe_tl[e], self.fe_base[e], self.fe_last[e], self.fe_msg[e] = kind, tl, base, last, -1
        self._insert(k, e)
        self.nflows += 1
        return e

    def find_flow(self, bytes key not None):
        """The entry of a flow, or -1."""
        if len(key) != KEY_LEN:
            raise ValueError(f"a flow key is {KEY_LEN} bytes, not {len(key)}")
        return self.lookup_flow(key)

    def anchor(self, int64_t e):
        """A bound flow's PSN anchor: the unwrapped PSN of its newest packet
        (FlowBinding.last, which the fast path's bindings read from here)."""
        self._entry(e)
        return self.fe_last[e]

    def set_anchor(self, int64_t e, int64_t last):
        self._entry(e)
        self.fe_last[e] = last

    @property
    def flow_count(self):
        return self.nflows

    cdef _entry(self, int64_t e):
        if not 0 <= e < self.nflows:
            raise IndexError(f"flow entry {e} not in 0..{self.nflows - 1}")

    cdef _flow_arrays(self, int64_t capacity, int64_t keep):
        """(Re)allocate the entries for `capacity` flows, keeping the first `keep`, and
        rebuild the hash slots (4 per entry at most: short probe runs)."""
        cdef int64_t e, size = 1
        key = np.zeros((capacity, KEY_LEN), np.uint8)
        cols = [np.zeros(capacity, np.int64) for _ in range(5)]
        if keep:
            key[:keep] = self.fe_key[:keep]
            for col, old in zip(cols, (self.fe_kind, self.fe_tl, self.fe_base, self.fe_last, self.fe_msg)):
                col[:keep] = old[:keep]
        self.fe_key = key
        self.fe_kind, self.fe_tl, self.fe_base, self.fe_last, self.fe_msg = cols
        while size < 4 * capacity:
            size *= 2
        self.ft_slots = np.full(size, -1, np.int64)
        for e in range(keep):
            self._insert(&self.fe_key[e, 0], e)

    cdef void _insert(self, const uint8_t *key, int64_t e) noexcept:
        cdef int64_t mask = self.ft_slots.shape[0] - 1
        cdef int64_t i = <int64_t>(hash_key(key) & <uint64_t>mask)
        while self.ft_slots[i] >= 0:
            i = (i + 1) & mask
        self.ft_slots[i] = e

    # -- LL flag bases (Extractor.flag_base, learned by the reference) ---------------------
    def set_flag_base(self, int64_t conn, base):
        if not 0 <= conn < self.fb_known.shape[0]:
            raise IndexError(f"connection {conn} not in 0..{self.fb_known.shape[0] - 1}")
        if not 0 <= base < 1 << 64:
            raise ValueError(f"flag base {base} is not a u64")
        # LL128 bases are u64 (LL's u32): kept as the int64 of the same bits, added modulo 2**64
        self.fb_known[conn], self.fb_value[conn] = 1, base - (1 << 64) if base >= 1 << 63 else base

    # -- decode (parsers/roce.py decode_frame) ---------------------------------------------
    cdef int decode_frame(self, const uint8_t *d, int64_t n, int64_t origlen, int linktype,
                          Frame *f, bint checked=False) noexcept nogil:
        """Class of one frame, with parsers.roce's precedence; fills f for RoCE frames.
        checked: its ICRC was found good already (check_icrc), so it is not computed again."""
        cdef int cls = self._decode(d, n, linktype, n >= origlen, f, checked)
        # decode_frame: a frame shorter than on the wire is TRUNCATED unless MALFORMED
        if n < origlen and cls != K_MALFORMED and cls != K_ENCAPSULATED:
            cls = K_TRUNCATED
        f.cls = cls
        return cls

    cdef int _decode(self, const uint8_t *d, int64_t n, int linktype, bint complete,
                     Frame *f, bint checked) noexcept nogil:
        cdef int64_t off = 0
        cdef uint32_t ethertype, version, want
        # _link: Ethernet [+ tags] | raw IP | Linux SLL/SLL2
        if linktype == LT_ETHERNET:
            if n < 14:
                return K_TRUNCATED
            ethertype = be16(d + 12)
            off = 14
            while is_tpid(ethertype):      # parse_tags: 4-byte tags while the type is a TPID
                if off + 4 > n:
                    return K_TRUNCATED
                ethertype = be16(d + off + 2)
                off += 4
        elif linktype == LT_RAW or linktype == LT_IPV4 or linktype == LT_IPV6:
            if n == 0:
                return K_TRUNCATED
            version = d[0] >> 4
            want = 4 if linktype == LT_IPV4 else (6 if linktype == LT_IPV6 else version)
            if version != want:
                return K_MALFORMED
            ethertype = ETH_TYPE_IPV4 if version == 4 else (ETH_TYPE_IPV6 if version == 6 else 0)
        elif linktype == LT_LINUX_SLL or linktype == LT_LINUX_SLL2:
            if linktype == LT_LINUX_SLL:
                if n < 16:
                    return K_TRUNCATED
                ethertype = be16(d + 14)
                off = 16
            else:
                if n < 20:
                    return K_TRUNCATED
                ethertype = be16(d)
                off = 20
            while is_tpid(ethertype):
                if off + 4 > n:
                    return K_TRUNCATED
                ethertype = be16(d + off + 2)
                off += 4
        else:
            return K_OTHER                  # link type not decoded
        return self._network(d, n, off, ethertype, complete, f, checked, False)

    cdef int _network(self, const uint8_t *d, int64_t n, int64_t off, uint32_t ethertype,
                      bint complete, Frame *f, bint checked, bint inner) noexcept nogil:
        """parsers/roce.py _network: IP and everything above it, at `off`; `inner` once a
        mirror tunnel has been taken off (n is then where the outer IP packet ends)."""
        cdef int64_t hdr_len, total_len, pos, size, ip_end, udp_off, udp_end, bth_off
        cdef int64_t icrc_off, payload_off, payload_len
        cdef uint32_t b0, ihl, proto, word, nxt, ulen, op, padcnt
        cdef bint fragment
        # IPv4 | IPv6
        if ethertype == ETH_TYPE_IPV4:
            if off + 20 > n:
                return K_TRUNCATED
            b0 = d[off]
            ihl = b0 & 0x0F
            if b0 >> 4 != 4 or ihl < 5:
                return K_MALFORMED
            hdr_len = ihl * 4
            total_len = be16(d + off + 2)
            if total_len < hdr_len:
                return K_MALFORMED
            if off + hdr_len > n:
                return K_TRUNCATED          # options cut off
            proto = d[off + 9]
            word = be16(d + off + 6)        # rf, df, mf, fragment offset
            fragment = ((word >> 13) & 1) != 0 or (word & 0x1FFF) != 0
            f.ip_ver = 4
        elif ethertype == ETH_TYPE_IPV6:
            if off + 40 > n:
                return K_TRUNCATED
            if d[off] >> 4 != 6:
                return K_MALFORMED
            nxt = d[off + 6]
            pos = off + 40
            fragment = False
            # hop-by-hop, routing, destination options are skipped; a fragment header is
            # 8 bytes and makes it a fragment unless it is an atomic one (offset 0, M 0)
            while nxt == 0 or nxt == 43 or nxt == 60 or nxt == 44:
                if pos + 8 > n:
                    return K_TRUNCATED
                if nxt == 44:
                    size = 8
                    word = be16(d + pos + 2)
                    fragment = (word & 0xFFF8) != 0 or (word & 1) != 0
                else:
                    size = (<int64_t>d[pos + 1] + 1) * 8
                nxt = d[pos]
                pos += size
            total_len = 40 + be16(d + off + 4)
            if pos - off - 40 > total_len - 40:
                return K_MALFORMED
            hdr_len = pos - off
            proto = nxt
            f.ip_ver = 6
        else:
            return K_OTHER                  # not IP
        f.ip_off = off
        if proto == PROTO_GRE:
            if inner or fragment or not complete:
                return K_ENCAPSULATED       # the reference says what it is
            return self._tunnel(d, n, off + total_len, off + hdr_len, f, checked)
        if proto != PROTO_UDP:
            return K_OTHER
        if fragment:
            return K_OTHER
        ip_end = off + total_len            # Ethernet may pad past this; the IP length rules
        udp_off = off + hdr_len
        if udp_off + UDP_LEN > n:
            return K_TRUNCATED
        ulen = be16(d + udp_off + 4)
        if ulen < UDP_LEN:
            return K_MALFORMED
        if be16(d + udp_off + 2) != ROCEV2_PORT:
            return K_OTHER
        udp_end = udp_off + ulen
        if udp_end > ip_end:
            return K_MALFORMED
        if ulen < UDP_LEN + BTH_LEN + ICRC_LEN:
            return K_MALFORMED
        bth_off = udp_off + UDP_LEN
        if bth_off + BTH_LEN > n:
            return K_TRUNCATED
        op = d[bth_off]
        padcnt = (d[bth_off + 1] >> 4) & 3
        icrc_off = udp_end - ICRC_LEN
        if self.op_known[op]:
            payload_off = bth_off + BTH_LEN + self.op_ext_len[op]
            payload_len = icrc_off - padcnt - payload_off
            if payload_len < 0:
                return K_MALFORMED
            if payload_len and not self.op_payload[op]:
                return K_MALFORMED
            if bth_off + BTH_LEN + self.op_decoded_end[op] > n:
                return K_TRUNCATED          # RETH/AETH/ImmDt/DETH cut off
            f.payload_off = payload_off
            f.payload_len = payload_len
        if ip_end > n:
            return K_TRUNCATED
        f.udp_off = udp_off
        f.bth_off = bth_off
        f.icrc_off = icrc_off
        f.opcode = op
        if not self.op_known[op]:
            return K_UNKNOWN_OPCODE         # the ICRC does not change this class
        if not (self.trust_icrc or checked) and complete and not self.icrc_ok(d, f):
            return K_BAD_ICRC
        if self.op_is_ack[op]:
            return K_ROCE_ACK
        return K_ROCE_DATA

    cdef int _tunnel(self, const uint8_t *d, int64_t n, int64_t outer_end, int64_t g, Frame *f,
                     bint checked) noexcept nogil:
        """A remotely mirrored frame (parsers/roce.py _decapsulate, parsers/erspan.py):
        GRE version 0 without routing, holding ERSPAN I, II or III or transparent Ethernet
        bridging, around a frame whose bytes all lie in the outer packet. That is every
        frame of a healthy mirror session, and the kernel decodes it (RoCE or not) in
        place (offsets into the outer bytes, the ICRC the inner packet's). Anything else
        (routing, another tunnel, GRE in GRE, an inner frame truncated or malformed, a
        frame cut short) stays K_ENCAPSULATED: the reference decides what it is and why."""
        cdef uint32_t flags, proto, ethertype, word
        cdef int64_t p
        if outer_end > n or g + 4 > outer_end:
            return K_ENCAPSULATED
        flags = be16(d + g)
        proto = be16(d + g + 2)
        if flags & (GRE_R | GRE_VERSION):
            return K_ENCAPSULATED
        # (the reference computes a GRE checksum but classes the frame by the inner ICRC)
        p = g + 4 + (4 if flags & GRE_C else 0) + (4 if flags & GRE_K else 0) + (4 if flags & GRE_S else 0)
        if proto == GRE_PROTO_ERSPAN and flags & GRE_S:      # type II
            if p + ERSPAN2_LEN > outer_end or d[p] >> 4 != 1:
                return K_ENCAPSULATED
            p += ERSPAN2_LEN
        elif proto == GRE_PROTO_ERSPAN3:
            if p + ERSPAN3_LEN > outer_end or d[p] >> 4 != 2:
                return K_ENCAPSULATED
            word = be16(d + p + 10)         # P(1) FT(5) HwID(6) D(1) Gra(2) O(1)
            p += ERSPAN3_LEN + (ERSPAN3_PLATFORM_LEN if word & 1 else 0)
            if (word >> 10) & 0x1F == 2:    # FT 2: the IP packet, no Ethernet header
                if p >= outer_end:
                    return K_ENCAPSULATED
                ethertype = ETH_TYPE_IPV4 if d[p] >> 4 == 4 else (ETH_TYPE_IPV6 if d[p] >> 4 == 6 else 0)
                if ethertype == 0:
                    return K_ENCAPSULATED
                return self._inner(d, outer_end, p, ethertype, f, checked)
            if (word >> 10) & 0x1F != 0:
                return K_ENCAPSULATED
        elif proto != GRE_PROTO_ERSPAN and proto != GRE_PROTO_TEB:   # (type I: the frame follows)
            return K_ENCAPSULATED
        if p + 14 > outer_end:
            return K_ENCAPSULATED
        ethertype = be16(d + p + 12)
        p += 14
        while is_tpid(ethertype):
            if p + 4 > outer_end:
                return K_ENCAPSULATED
            ethertype = be16(d + p + 2)
            p += 4
        return self._inner(d, outer_end, p, ethertype, f, checked)

    cdef inline int _inner(self, const uint8_t *d, int64_t outer_end, int64_t off, uint32_t ethertype,
                           Frame *f, bint checked) noexcept nogil:
        # The mirrored frame ends where the outer packet does (an Ethernet trailer is not
        # its). One the reference would call truncated or malformed, it explains in terms
        # of the tunnel (the ERSPAN T bit, a header past the outer packet): its decision.
        cdef int cls = self._network(d, outer_end, off, ethertype, True, f, checked, True)
        return K_ENCAPSULATED if cls == K_TRUNCATED or cls == K_MALFORMED else cls

    cdef bint icrc_ok(self, const uint8_t *d, Frame *f) noexcept nogil:
        """parsers/icrc.py verify: CRC-32 over 8 x 0xFF, the IP/UDP/BTH headers with the
        fields routers may rewrite set to all ones, and the rest up to the ICRC."""
        cdef uint8_t hdr[HDR_MAX]
        cdef int64_t ip_off = f.ip_off, udp = f.udp_off - f.ip_off
        cdef int64_t hlen = f.bth_off + BTH_LEN - ip_off, fixed
        cdef uint32_t crc
        cdef const uint8_t *rest = d + f.bth_off + BTH_LEN
        cdef int64_t nrest = f.icrc_off - f.bth_off - BTH_LEN
        if hlen <= HDR_MAX:
            memcpy(hdr, d + ip_off, hlen)
            self._mask_ip(hdr, f.ip_ver)
            hdr[udp + 6] = 0xFF                # UDP checksum
            hdr[udp + 7] = 0xFF
            hdr[udp + UDP_LEN + 4] = 0xFF      # BTH byte 4: FECN, BECN, reserved
            if self.crc_impl == 1 or self.crc_impl == 2:   # headers and payload: one stream
                return ckptd_icrc_clmul(hdr, hlen, rest, nrest, self.crc_impl == 2) == le32(d + f.icrc_off)
            crc = self.crc_fn(LRH_CRC, hdr, hlen)
        else:
            # long IPv4 options or IPv6 extension headers: covered unmasked, in pieces
            fixed = 20 if f.ip_ver == 4 else 40
            memcpy(hdr, d + ip_off, fixed)
            self._mask_ip(hdr, f.ip_ver)
            crc = self.crc_fn(LRH_CRC, hdr, fixed)
            crc = self.crc_fn(crc, d + ip_off + fixed, udp - fixed)
            memcpy(hdr, d + f.udp_off, UDP_LEN + BTH_LEN)
            hdr[6] = 0xFF
            hdr[7] = 0xFF
            hdr[UDP_LEN + 4] = 0xFF
            crc = self.crc_fn(crc, hdr, UDP_LEN + BTH_LEN)
        return self.crc_fn(crc, rest, nrest) == le32(d + f.icrc_off)

    cdef inline void _mask_ip(self, uint8_t *h, int ver) noexcept nogil:
        if ver == 4:
            h[1] = 0xFF                         # TOS (DSCP/ECN)
            h[8] = 0xFF                         # TTL
            h[10] = 0xFF                        # header checksum
            h[11] = 0xFF
        else:
            h[0] |= 0x0F                        # traffic class, flow label, hop limit
            h[1] = 0xFF
            h[2] = 0xFF
            h[3] = 0xFF
            h[7] = 0xFF

    # -- flows (ckptd/transports/roce/flows.py FlowBinder.bound) ------------------------------------------------
    cdef int64_t lookup_flow(self, const uint8_t *key) noexcept nogil:
        cdef int64_t e, mask = self.ft_slots.shape[0] - 1
        cdef int64_t i = <int64_t>(hash_key(key) & <uint64_t>mask)
        while True:
            e = self.ft_slots[i]
            if e < 0:
                return -1
            if memcmp(&self.fe_key[e, 0], key, KEY_LEN) == 0:
                return e
            i = (i + 1) & mask

    cdef inline void flow_key(self, const uint8_t *d, Frame *f, uint32_t dqp, uint8_t *key) noexcept nogil:
        if f.ip_ver == 4:
            make_key(dqp, d + f.ip_off + 12, d + f.ip_off + 16, 4, key)
        else:
            make_key(dqp, d + f.ip_off + 8, d + f.ip_off + 24, 16, key)

    cdef int ack(self, const uint8_t *d, Frame *f, int64_t *flow_out) noexcept nogil:
        """Extractor.feed for an ACK: counted; while its hop is unbound the binder also
        takes it as evidence (FlowBinder.note_ack), which only Python does."""
        cdef uint8_t key[KEY_LEN]
        self.flow_key(d, f, ACK_QP, key)
        flow_out[0] = self.lookup_flow(key)
        if flow_out[0] < 0:
            return STOP_ACK
        self.counters[C_ACKS] += 1
        return 0

    # -- place (ckptd/transports/roce/extract.py Extractor._place) ---------------------------------------------
    cdef inline int64_t find_message(self, int64_t e, int64_t layout, int64_t tl, int64_t local) noexcept nogil:
        """FlowSchedule.locate: the message holding packet `local`; the flow's last
        message is tried first, since packets mostly arrive in order."""
        cdef int64_t lo = self.tl_mlo[layout, tl], hi = self.tl_mhi[layout, tl], mid
        cdef int64_t m = self.fe_msg[e]
        if lo <= m < hi and self.m_start[m] <= local < self.m_start[m] + self.m_npkts[m]:
            return m
        if m + 1 < hi and lo <= m + 1 and self.m_start[m + 1] <= local < self.m_start[m + 1] + self.m_npkts[m + 1]:
            self.fe_msg[e] = m + 1
            return m + 1
        # bisect_right(starts, local) - 1 over [lo, hi)
        hi -= 1
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if self.m_start[mid] <= local:
                lo = mid
            else:
                hi = mid - 1
        self.fe_msg[e] = lo
        return lo

    cdef inline bint check(self, int64_t m, int64_t i, const uint8_t *d, Frame *f) noexcept nogil:
        """Extractor._check: opcode for the packet's place in the message, payload size,
        RETH DMA length, immediate. True when the packet is what the schedule says."""
        cdef int64_t npk = self.m_npkts[m], wire_len = self.m_wire_len[m]
        cdef int op = f.opcode, want
        cdef bint imm = self.m_has_imm[m]
        if npk == 1:
            want = WRITE_ONLY_IMM if imm else WRITE_ONLY
        elif i == 0:
            want = WRITE_FIRST
        elif i == npk - 1:
            want = WRITE_LAST_IMM if imm else WRITE_LAST
        else:
            want = WRITE_MIDDLE
        if op != want:
            return False
        if f.payload_len != min(self.mtu, wire_len - i * self.mtu):
            return False
        cdef const uint8_t *ext = d + f.bth_off + BTH_LEN
        if op == WRITE_FIRST or op == WRITE_ONLY_IMM or op == WRITE_ONLY:
            if be32(ext + 12) != wire_len:   # RETH: va u64, rkey u32, dma_len u32
                return False
        if op == WRITE_LAST_IMM:
            return le32(ext) == self.m_imm[m]
        if op == WRITE_ONLY_IMM:
            return le32(ext + 16) == self.m_imm[m]
        return True

    cdef int place(self, const uint8_t *d, Frame *f, int64_t stream, int64_t *flow_out) noexcept nogil:
        """One RDMA-write packet of the job's traffic. Returns 0 when done (everything
        counted and placed), or a STOP_* reason with no state changed."""
        cdef uint8_t key[KEY_LEN]
        cdef uint8_t lldata[MAX_LINE_DATA]
        cdef const uint8_t *bth = d + f.bth_off
        cdef int64_t e, tl, u, pos, layout, it, local, q, m, i, slot = -1, conn, step, k = self.per_step
        cdef int64_t woff, doff, dlen, isz, total, n, start, nel, npk0, cycle, gstep, phase
        cdef const uint8_t *data
        cdef uint8_t *recv = NULL             # this packet's flag in the received map
        cdef uint32_t expected, dqp
        cdef uint64_t expected128
        # the flow key: (src IP, dst IP, dest QP), as FlowBinder names flows
        self.flow_key(d, f, be24(bth + 5), key)
        e = self.lookup_flow(key)
        flow_out[0] = e
        if e < 0:
            return STOP_UNKNOWN_FLOW
        if self.fe_kind[e] == FLOW_UNRELATED:
            self.counters[C_UNRELATED] += 1
            return 0

        # FlowBinder.locate: unwrap the PSN against the flow's newest, then FlowTimeline
        tl = self.fe_tl[e]
        u = psn_unwrap(be24(bth + 9), self.fe_last[e])
        pos = u - self.fe_base[e]
        npk0 = self.tl_npkts[0, tl]
        for layout in range(1, self.nprefix):  # the opening layouts' packets
            npk0 += self.tl_npkts[layout, tl]
        cycle = self.tl_cycle[tl]
        if pos < 0 or (pos >= npk0 and cycle == 0):
            return self._reject(e, u, NULL, C_BEFORE_START)
        if pos < npk0:  # FlowTimeline.locate: an opening iteration's
            local, layout = pos, 0
            while local >= self.tl_npkts[layout, tl]:
                local -= self.tl_npkts[layout, tl]
                layout += 1
            it = layout
        else:  # FlowTimeline.locate: whole turns of the QP-rotation cycle, then its layouts
            q = (pos - npk0) // cycle
            local = pos - npk0 - q * cycle
            layout = self.nprefix
            while local >= self.tl_npkts[layout, tl]:
                local -= self.tl_npkts[layout, tl]
                layout += 1
            it = self.nprefix + q * (self.nlayouts - self.nprefix) + layout - self.nprefix
        m = self.find_message(e, layout, tl, local)
        i = local - self.m_start[m]
        if not self.check(m, i, d, f):
            return self._reject(e, u, NULL, C_SCHEDULE_MISMATCH)

        # `it` is the wire round; the training iteration whose gradient it carries is
        # `step` (Plan.step_of_round), -1 for a step's earlier micro-batches: matched
        # and counted, never placed nor recorded as received
        step = it // k if it % k == k - 1 else -1
        # from here on the reference records the packet as received (stream_loss), so
        # the iteration must be one the kernel tracks; for finalized ones the record is
        # never read again (stream_loss has run), so they need none
        if step >= 0 and step > self.done:
            for q in range(self.slot_iter.shape[0]):
                if self.slot_iter[q] == step:
                    slot = q
                    break
            if slot < 0:
                return STOP_ITERATION
            recv = (<uint8_t *>self.slot_recv[slot]) + stream * self.recv_total[layout] \
                + self.tl_recv_off[layout, tl] + local

        phase = self.m_phase[m]
        woff = self.m_wire_offset[m] + i * self.mtu       # wire byte offset within the send
        if self.protocol == PROTO_LL:
            if f.payload_len % LL_LINE:
                return self._reject(e, u, recv, C_SCHEDULE_MISMATCH)
            dlen = f.payload_len // LL_LINE * 8
            if dlen:
                conn = self.tl_conn[tl]
                if not self.fb_known[conn]:
                    return STOP_FLAG_BASE
                gstep = self.sends_before(conn, it) + self.m_step[m]
                expected = <uint32_t>(self.fb_value[conn] + gstep + 1)  # modulo 2**32
                if not ckptd_ll_unpack(d + f.payload_off, f.payload_len // LL_LINE, expected,
                                       <uint8_t *>lldata if phase == 1 else <uint8_t *>NULL):
                    return self._reject(e, u, recv, C_LL_FLAG_MISMATCH)
            data = <uint8_t *>lldata
            doff = woff // 2
        elif self.protocol == PROTO_LL128:
            # whole half blocks hold one run of data; anything else (MTU below 1024, a QP's
            # share of a split send) is scattered: the reference places its runs
            if woff % LL128_HALF or f.payload_len % LL128_HALF:
                return STOP_SCATTERED
            dlen = f.payload_len // LL128_HALF * LL128_HALF_DATA
            if dlen:
                conn = self.tl_conn[tl]
                if not self.fb_known[conn]:
                    return STOP_FLAG_BASE
                gstep = self.sends_before(conn, it) + self.m_step[m]
                expected128 = <uint64_t>self.fb_value[conn] + <uint64_t>gstep + 1  # modulo 2**64
                if not ckptd_ll128_unpack(d + f.payload_off, f.payload_len // LL128_HALF, expected128,
                                          <uint8_t *>lldata if phase == 1 else <uint8_t *>NULL):
                    return self._reject(e, u, recv, C_LL_FLAG_MISMATCH)
            data = <uint8_t *>lldata
            doff = woff // LL128_HALF * LL128_HALF_DATA
        else:
            data = d + f.payload_off
            dlen = f.payload_len
            doff = woff
        if self.m_bucket[m] < 0:               # another collective on the communicator: no gradient
            if self.m_keep[m] and it >= 1 and (it - 1) % k == k - 1 and (it - 1) // k > self.done:
                return STOP_BUFFER              # the buffers after the step of round it-1: Extractor keeps them
            if u > self.fe_last[e]:
                self.fe_last[e] = u
            if recv != NULL:
                recv[0] = 1
            self.counters[C_OTHER_COLLECTIVE] += 1
            return 0
        isz = self.b_itemsize[layout, self.m_bucket[m]]
        total = self.m_nelem[m] * isz          # LL/LL128 pad the last line/block: drop what is not data
        n = min(dlen, max(<int64_t>0, total - doff))
        if doff % isz or n % isz:
            return self._reject(e, u, recv, C_SCHEDULE_MISMATCH)
        start = self.m_offset[m] + doff // isz
        nel = n // isz
        if step < 0:                            # an earlier micro-batch's round: counted only
            if u > self.fe_last[e]:
                self.fe_last[e] = u
            self.counters[C_AG_PACKETS if phase == 1 else C_RS_PACKETS] += 1
            self.counters[C_EARLIER_MICRO_BATCH] += 1
            return 0
        it = step                               # from here on: the training iteration
        # Pipeline._assemble gets a placement when there is data: decide whether the
        # kernel can do all it would do
        if n:
            if phase == 0:
                if self.dump_rs and self.m_ring_step[m] == 0:
                    return STOP_RS_DUMP         # the sender's own values, kept for the dump
                if it > self.highest:
                    return STOP_ITERATION       # a new highest iteration finalizes older ones
            elif it > self.done:
                if not self.slot_has_asm[slot]:
                    return STOP_ITERATION       # the pipeline opens its IterationAssembly
                if start + nel > self.b_count[layout, self.m_bucket[m]]:
                    return STOP_RANGE           # IterationAssembly.place raises

        # commit
        if u > self.fe_last[e]:
            self.fe_last[e] = u
        if it > self.s_iter[stream]:
            self.s_iter[stream] = it
        if it < self.s_low[stream]:
            self.s_low[stream] = it
        self.s_frame[stream] = self.cur_frame
        if recv != NULL:
            recv[0] = 1
        self.counters[C_AG_PACKETS if phase == 1 else C_RS_PACKETS] += 1
        if n and phase == 1:
            if it <= self.done:
                self.counters[C_LATE] += 1      # Pipeline._assemble: finalized already
            elif self.assemble(slot, stream, self.m_bucket[m], start, nel, isz, data, it):
                flow_out[0] = it
                return STOP_COMPLETE            # the pipeline may step the bucket, commit
        return 0

    cdef int _reject(self, int64_t e, int64_t u, uint8_t *recv, int counter) noexcept nogil:
        """Extractor._reject: counted here, or handed to Python while the reference
        still writes examples (it names the frame and the reason)."""
        if self.examples_open:
            return STOP_EXAMPLE
        if u > self.fe_last[e]:
            self.fe_last[e] = u
        if recv != NULL:
            recv[0] = 1
        self.counters[counter] += 1
        return 0

    # -- assemble (ckptd/core/assemble.py IterationAssembly.place) -------------------------------
    cdef bint assemble(self, int64_t slot, int64_t stream, int64_t bucket, int64_t start,
                       int64_t nel, int64_t isz, const uint8_t *raw, int64_t it) noexcept nogil:
        """Returns True when this placement completed a bucket (or the pipeline asked
        to hear of every placement into this iteration)."""
        cdef uint8_t *dst = (<uint8_t *>self.slot_ptr[slot, bucket, 0]) + start * isz
        cdef uint8_t *cov = <uint8_t *>self.slot_ptr[slot, bucket, 1]
        cdef uint8_t *mine = <uint8_t *>self.slot_ptr[slot, bucket, 2 + stream]
        cdef int64_t k, fresh = 0, have = ckptd_bits_count(cov, start, nel)
        cdef int state = 0 if have == 0 else (1 if have == nel else 2)
        cdef bint conflict = False
        # two intact copies of an element must agree bit for bit
        if state == 1:
            conflict = memcmp(dst, raw, nel * isz) != 0
        elif state == 2:
            for k in range(nel):
                if ckptd_bit(cov, start + k) and memcmp(dst + k * isz, raw + k * isz, isz) != 0:
                    conflict = True
                    break
        if conflict:
            k = self.nconflicts
            self.conflicts[k, 0] = it
            self.conflicts[k, 1] = stream
            self.conflicts[k, 2] = bucket
            self.conflicts[k, 3] = start
            self.conflicts[k, 4] = start + nel
            self.nconflicts += 1
            return False
        if state != 1:                          # all covered: the bytes are there already
            fresh = nel - have
            memcpy(dst, raw, nel * isz)
            ckptd_bits_set(cov, start, nel)
        ckptd_bits_set(mine, start, nel)
        self.slot_counts[slot, 0] += 1
        self.slot_counts[slot, 1] += nel * isz
        self.slot_bucket[slot, bucket, 0] += fresh     # IterationAssembly.bucket_covered
        if fresh and self.slot_bucket[slot, bucket, 1] > 0:
            self.slot_bucket[slot, bucket, 1] -= fresh  # elements still uncovered
            if self.slot_bucket[slot, bucket, 1] == 0:
                return True
        return self.slot_counts[slot, 2] != 0

    # -- the batch --------------------------------------------------------------------------
    def classify(self, const uint8_t[::1] buf, const int64_t[::1] offsets, const int64_t[::1] caplen,
                 const int64_t[::1] origlen, const int32_t[::1] linktype):
        """decode_frame's class of every frame (index into CLASS_NAMES; -1: GRE, which
        the reference unwraps), and nothing else: no flows, no counts."""
        cdef Py_ssize_t i, n = offsets.shape[0]
        out = np.empty(n, np.int8)
        cdef int8_t[::1] o = out
        cdef Frame f
        with nogil:
            for i in range(n):
                o[i] = <int8_t>self.decode_frame(&buf[offsets[i]] if caplen[i] else NULL, caplen[i],
                                                 origlen[i], linktype[i], &f)
        return out

    def check_icrc(self, const uint8_t[::1] buf, const int64_t[::1] offsets, const int64_t[::1] caplen,
                   const int64_t[::1] origlen, const int32_t[::1] linktype):
        """Per frame 1 where it decodes as RoCE data or ACK with a good ICRC, else 0: the
        ICRC part of `run`'s work, done ahead on another thread (the file reader's) by a
        kernel with only opcode tables and a CRC; `set_batch(checked=)` hands it to the
        kernel that places the frames, which then computes no ICRC for those frames and
        decodes the rest as before. Nothing else is read or written."""
        cdef Py_ssize_t i, n = offsets.shape[0]
        cdef int cls
        cdef Frame f
        if caplen.shape[0] != n or origlen.shape[0] != n or linktype.shape[0] != n:
            raise ValueError("per-frame arrays differ in length")
        if self.op_known is None:
            raise RuntimeError("opcode tables not set")
        out = np.zeros(n, np.uint8)
        cdef uint8_t[::1] o = out
        with nogil:
            for i in range(n):
                if offsets[i] < 0 or caplen[i] < 0 or offsets[i] + caplen[i] > buf.shape[0]:
                    continue  # set_batch refuses the batch
                cls = self.decode_frame(&buf[offsets[i]] if caplen[i] else NULL, caplen[i],
                                        origlen[i], linktype[i], &f)
                o[i] = cls == K_ROCE_DATA or cls == K_ROCE_ACK
        return out

    def set_batch(self, const uint8_t[::1] buf, const int64_t[::1] offsets, const int64_t[::1] caplen,
                  const int64_t[::1] origlen, const int32_t[::1] stream, const int32_t[::1] linktype,
                  const uint8_t[::1] checked=None):
        """The frames `run` works on: one buffer, and per frame its offset, captured and
        original length, mirror stream and link type; checked: check_icrc's result for
        these frames, or None."""
        cdef Py_ssize_t i, n = offsets.shape[0], bad = -1
        if caplen.shape[0] != n or origlen.shape[0] != n or stream.shape[0] != n or linktype.shape[0] != n \
                or checked is not None and checked.shape[0] != n:
            raise ValueError("per-frame arrays differ in length")
        with nogil:  # the kernel trusts these from here on
            for i in range(n):
                if offsets[i] < 0 or caplen[i] < 0 or offsets[i] + caplen[i] > buf.shape[0] \
                        or stream[i] < 0 or stream[i] >= self.nstreams:
                    bad = i
                    break
        if bad >= 0:
            raise ValueError(f"frame {bad}: outside the buffer or stream {stream[bad]} not in "
                             f"0..{self.nstreams - 1}")
        self.b_buf, self.b_offsets, self.b_caplen, self.b_origlen = buf, offsets, caplen, origlen
        self.b_stream, self.b_linktype, self.b_checked = stream, linktype, checked

    def last_frame(self):
        """What decode found in the frame `run` stopped at: (class, IP version, IP, UDP
        and BTH offsets, payload offset and length, opcode)."""
        f = self.last
        return f.cls, f.ip_ver, f.ip_off, f.udp_off, f.bth_off, f.payload_off, f.payload_len, f.opcode

    def run(self, int64_t start, int64_t end):
        """Process frames start..end-1. Returns (index, reason, flow entry): index == end
        and reason 0 when all were processed; reason 'complete': frames before index are
        processed and the last one completed a bucket of iteration `flow entry`; any other
        reason: the frame at index is for Python (nothing of it counted or placed)."""
        cdef int64_t i, s, flow = -1
        cdef int cls, reason = STOP_END
        cdef Frame f
        cdef const uint8_t *d
        if self.ft_slots is None or self.classes is None or self.b_offsets is None:
            raise RuntimeError("tables or batch not set")
        cdef const uint8_t[::1] buf = self.b_buf
        cdef const int64_t[::1] offsets = self.b_offsets, caplen = self.b_caplen, origlen = self.b_origlen
        cdef const int32_t[::1] stream = self.b_stream, linktype = self.b_linktype
        cdef const uint8_t[::1] checked = self.b_checked
        cdef bint has_checked = checked is not None
        if end > offsets.shape[0] or start < 0:
            raise IndexError("frame range outside the batch")
        cdef int64_t cap = self.conflicts.shape[0]
        with nogil:
            i = start
            while i < end:
                if self.nconflicts >= cap:
                    reason = STOP_CONFLICTS_FULL
                    break
                if i + PREFETCH_AHEAD < end:   # headers a few frames on: see PREFETCH_AHEAD
                    d = &buf[offsets[i + PREFETCH_AHEAD]]
                    __builtin_prefetch(d)
                    __builtin_prefetch(d + 64)
                d = &buf[offsets[i]] if caplen[i] else NULL
                s = stream[i]
                self.cur_frame = i
                flow = -1
                cls = self.decode_frame(d, caplen[i], origlen[i], linktype[i], &f,
                                        has_checked and checked[i])
                if cls == K_ENCAPSULATED:
                    reason = STOP_ENCAPSULATED
                    break
                if cls == K_ROCE_DATA:
                    if f.opcode == WRITE_FIRST or f.opcode == WRITE_MIDDLE or f.opcode == WRITE_LAST \
                            or f.opcode == WRITE_LAST_IMM or f.opcode == WRITE_ONLY_IMM \
                            or (f.opcode == WRITE_ONLY and self.cts_bytes >= 0   # flows.carries_data
                                and be32(d + f.bth_off + BTH_LEN + 12) != self.cts_bytes):
                        reason = self.place(d, &f, s, &flow)
                        if reason and reason != STOP_COMPLETE:
                            break
                    else:
                        self.classes[s, K_OTHER_ROCE] += 1   # clear-to-send writes, sends, reads
                elif cls == K_ROCE_ACK and f.opcode == ACKNOWLEDGE:
                    reason = self.ack(d, &f, &flow)
                    if reason:
                        break
                self.classes[s, K_FRAMES] += 1
                self.classes[s, cls] += 1
                i += 1
                if reason == STOP_COMPLETE:             # this frame is done; the pipeline acts first
                    break
            self.last = f
        return i, reason, flow
