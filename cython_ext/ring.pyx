# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""TPACKET_V3 ring blocks indexed in place: the capture ring is the batch.

ckptd.live.ring.RingCapture maps the ring; `index_blocks` walks the blocks the kernel
has handed to user space and writes each frame's offset (into the whole ring), captured
and wire length, timestamp and number into a Batch's arrays, without a Python object or
a copy per frame. The frames stay where the kernel put them until the caller hands the
blocks back with `release_blocks`, after the batch kernel has placed their bytes.

It does what RingCapture's frame-by-frame reader (the reference, `_take_block`) does:
an 802.1Q tag the stack took off into the tpacket3 header is put back, in place (the
first 12 bytes move 4 bytes towards the header, into the gap the kernel leaves
between the tpacket3 header + sockaddr_ll and the frame), and a frame longer than the
capture's snaplen after that is cut to it. Layouts: include/uapi/linux/if_packet.h.
"""
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t
from libc.string cimport memmove

# A block's status word: read with acquire order (its frames were written before it),
# handed back with release order (our reads and the VLAN rewrite are done first).
cdef extern from "ringword.h":
    uint32_t load_acquire "ckptd_load_acquire"(const uint8_t *p) nogil
    void store_release "ckptd_store_release"(uint8_t *p, uint32_t v) nogil

cdef extern from *:
    """
    #include <stdint.h>
    static inline uint32_t ckptd_u32(const uint8_t *p) { uint32_t v; __builtin_memcpy(&v, p, 4); return v; }
    static inline uint16_t ckptd_u16(const uint8_t *p) { uint16_t v; __builtin_memcpy(&v, p, 2); return v; }
    """
    uint32_t u32 "ckptd_u32"(const uint8_t *p) nogil
    uint16_t u16 "ckptd_u16"(const uint8_t *p) nogil
    void __builtin_prefetch(const void *addr, int rw, int locality) noexcept nogil

# struct tpacket_block_desc: version, offset_to_priv, then tpacket_hdr_v1.
DEF BLOCK_STATUS = 8
DEF BLOCK_NUM_PKTS = 12
DEF BLOCK_FIRST_PKT = 16
DEF BLOCK_LEN = 20        # bytes of the block in use (its header and frames)
# struct tpacket3_hdr
DEF PKT_NEXT = 0
DEF PKT_SEC = 4
DEF PKT_NSEC = 8
DEF PKT_SNAPLEN = 12
DEF PKT_LEN = 16
DEF PKT_STATUS = 20
DEF PKT_MAC = 24
DEF PKT_TCI = 32
DEF PKT_TPID = 36
DEF PKT_HDR = 48          # sizeof(struct tpacket3_hdr): the frame starts after it
DEF TP_STATUS_KERNEL = 0
DEF TP_STATUS_USER = 1
DEF TP_STATUS_VLAN_VALID = 0x10
DEF TP_STATUS_VLAN_TPID_VALID = 0x40
# How far ahead of the frame it is at, index_blocks asks for the block's bytes (into L2).
# The kernel wrote them on another core. Walked one header at a time (each says where
# the next frame starts), every header was a cache miss of its own, and the batch kernel
# then missed again on each frame's payload; a sequential stream of prefetches lets both
# find the bytes on their way in: 12-13% less CPU in the live loop at 400k frames/s
# (benchmarks/RESULTS.md, session 12).
DEF PREFETCH_BYTES = 32768


def block_ready(uint8_t[::1] ring, int64_t block_size, int64_t block) -> bool:
    """The kernel has handed block `block` to user space."""
    return load_acquire(&ring[block * block_size + BLOCK_STATUS]) & TP_STATUS_USER != 0


cdef inline int64_t _handed_over(const uint8_t *p, int64_t block_size, int64_t block_nr, int64_t first,
                                 int64_t known) nogil:
    """Blocks first, first+1, ... (mod block_nr) the kernel has handed over, counting on
    from `known` of them already seen: the kernel fills and hands over blocks in ring
    order, so they end at the first block it still owns."""
    while known < block_nr and load_acquire(p + ((first + known) % block_nr) * block_size
                                            + BLOCK_STATUS) & TP_STATUS_USER:
        known += 1
    return known


def blocks_handed_over(uint8_t[::1] ring, int64_t block_size, int64_t block_nr, int64_t first) -> int:
    """How full the ring is, from block `first` on (index_blocks' `ready`, for a reader
    that takes one block at a time)."""
    return _handed_over(&ring[0], block_size, block_nr, first, 0)


def index_blocks(uint8_t[::1] ring, int64_t block_size, int64_t block_nr, int64_t first,
                 int64_t max_blocks, int64_t snaplen, int64_t frame_base,
                 int64_t[::1] offsets, int64_t[::1] caplen, int64_t[::1] origlen,
                 int64_t[::1] ts, int64_t[::1] frame_no):
    """Index the user-owned blocks first, first+1, ... (mod block_nr), at most max_blocks
    of them (and block_nr) and no more frames than the arrays hold; frames are numbered frame_base+1
    on. Returns (blocks, frames, vlan_restored, vlan_unrestored, ready): vlan_unrestored
    counts tagged frames with no room before them to put the tag back (never seen from
    a kernel that follows the documented layout; those frames keep the tag off); ready
    is how many blocks from first on the kernel had handed over, indexed or not: how full
    the ring was (the kernel fills and hands over blocks in ring order)."""
    cdef int64_t cap = offsets.shape[0], nb = 0, k = 0, restored = 0, unrestored = 0, ready
    cdef int64_t base, pos, start, cl, wl, j, end, ahead
    cdef uint32_t num, status, tci, tpid
    cdef uint8_t *p = &ring[0]
    if max_blocks > block_nr:  # past that the walk would come round to blocks already indexed
        max_blocks = block_nr
    with nogil:
        while nb < max_blocks:
            base = ((first + nb) % block_nr) * block_size
            if load_acquire(p + base + BLOCK_STATUS) & TP_STATUS_USER == 0:
                break
            num = u32(p + base + BLOCK_NUM_PKTS)
            if k + num > cap:
                break
            pos = base + u32(p + base + BLOCK_FIRST_PKT)
            end = base + min(<int64_t>u32(p + base + BLOCK_LEN), block_size)
            ahead = pos
            for j in range(num):
                while ahead < pos + PREFETCH_BYTES and ahead < end:
                    __builtin_prefetch(p + ahead, 0, 1)
                    ahead += 64
                start = pos + u16(p + pos + PKT_MAC)
                cl = u32(p + pos + PKT_SNAPLEN)
                wl = u32(p + pos + PKT_LEN)
                status = u32(p + pos + PKT_STATUS)
                if status & TP_STATUS_VLAN_VALID:
                    if start - 4 >= pos + PKT_HDR:
                        tpid = u16(p + pos + PKT_TPID)
                        if not (status & TP_STATUS_VLAN_TPID_VALID and tpid):
                            tpid = 0x8100
                        tci = u32(p + pos + PKT_TCI) & 0xFFFF
                        memmove(p + start - 4, p + start, 12)
                        start -= 4
                        p[start + 12] = tpid >> 8
                        p[start + 13] = tpid & 0xFF
                        p[start + 14] = tci >> 8
                        p[start + 15] = tci & 0xFF
                        cl += 4
                        wl += 4
                        restored += 1
                    else:
                        unrestored += 1
                if cl > snaplen:
                    cl = snaplen
                offsets[k] = start
                caplen[k] = cl
                origlen[k] = wl
                ts[k] = <int64_t>u32(p + pos + PKT_SEC) * 1000000000 + u32(p + pos + PKT_NSEC)
                frame_no[k] = frame_base + k + 1
                k += 1
                pos += u32(p + pos + PKT_NEXT)
            nb += 1
        ready = _handed_over(p, block_size, block_nr, first, nb)
    return nb, k, restored, unrestored, ready


def release_blocks(uint8_t[::1] ring, int64_t block_size, int64_t block_nr, int64_t first,
                   int64_t count):
    """Hand blocks first .. first+count-1 (mod block_nr) back to the kernel."""
    cdef int64_t b
    cdef uint8_t *p = &ring[0]
    with nogil:
        for b in range(count):
            store_release(p + ((first + b) % block_nr) * block_size + BLOCK_STATUS, TP_STATUS_KERNEL)
