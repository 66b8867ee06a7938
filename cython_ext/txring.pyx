# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Frames out of a PACKET_TX_RING (TPACKET_V2), paced by the monotonic clock.

ckptd.testing.txring opens the socket and maps the ring; `send_paced` fills ring slots
with frames already in memory and hands each batch of slots to the kernel with one
send(2), so a frame costs a copy into the ring and the kernel's transmit, not a
system call. Layouts and the slot protocol: include/uapi/linux/if_packet.h,
Documentation/networking/packet_mmap.rst ("Transmission process"), net/packet/af_packet.c
tpacket_snd.

A slot is TP_STATUS_AVAILABLE (ours to fill) until we set TP_STATUS_SEND_REQUEST;
send(MSG_DONTWAIT) turns the requested slots into skbs and returns without waiting for
them, so the next batch is filled while the last is still on its way; the kernel sets
each slot back to AVAILABLE from the skb's destructor (TP_STATUS_SENDING until then).
When the ring comes round to a slot still in flight, poll(POLLOUT) sleeps until the
slot at the kernel's head (ours) is free. A slot left TP_STATUS_WRONG_FORMAT names the
frame the kernel refused (send() fails with its errno). A frame the device dropped
(veth: the receiver's backlog full) comes back as a SEND_REQUEST slot and send() fails
with ENOBUFS: calling send() again retries exactly the frames not yet taken. (Sending
with a wait for every batch instead measured the same here.)

The skbs point into the ring's pages; the kernel marks them zero-copy
(skb_zcopy_set_nouarg in af_packet.c tpacket_fill_skb), so a veth copies those bytes
before it lets the slot go (skb_orphan_frags in ____dev_forward_skb,
include/linux/netdevice.h): a slot refilled early cannot change a frame on its way.
"""
from libc.errno cimport EAGAIN, EINTR, EINVAL, ENOBUFS, errno
from libc.stdint cimport int64_t, uint8_t, uint32_t
from libc.string cimport memcpy

import numpy as np

# A slot's status word: read with acquire order, a filled slot published with release
# order (its bytes and length first).
cdef extern from "ringword.h":
    uint32_t tx_status "ckptd_load_acquire"(const uint8_t *p) nogil
    void tx_publish "ckptd_store_release"(uint8_t *p, uint32_t v) nogil

cdef extern from *:
    """
    #include <stdint.h>
    #include <time.h>
    #include <sched.h>
    #include <sys/socket.h>
    #include <poll.h>
    static inline void ckptd_tx_set_len(uint8_t *p, uint32_t v) { __builtin_memcpy(p, &v, 4); }
    static inline double ckptd_mono(void) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
    }
    static inline void ckptd_sleep_until(double when) {
        struct timespec t;
        t.tv_sec = (time_t)when;
        t.tv_nsec = (long)((when - (double)t.tv_sec) * 1e9);
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &t, NULL) != 0) {}
    }
    static inline long ckptd_tx_flush(int fd, int flags) { return (long)send(fd, NULL, 0, flags); }
    """
    void tx_set_len "ckptd_tx_set_len"(uint8_t *p, uint32_t v) nogil
    double mono "ckptd_mono"() nogil
    void sleep_until "ckptd_sleep_until"(double when) nogil
    long tx_flush "ckptd_tx_flush"(int fd, int flags) nogil
    int MSG_DONTWAIT
    cdef struct pollfd:
        int fd
        short events
        short revents
    short POLLOUT
    int poll(pollfd *fds, unsigned long nfds, int timeout) nogil
    int sched_yield() nogil

# struct tpacket2_hdr
DEF HDR_LEN = 4
DEF DATA = 32             # TPACKET2_HDRLEN - sizeof(struct sockaddr_ll): where the frame goes
DEF TP_STATUS_AVAILABLE = 0
DEF TP_STATUS_SEND_REQUEST = 1
DEF TP_STATUS_WRONG_FORMAT = 4
DEF MAX_RETRIES = 1000000  # ENOBUFS answers in a row before giving up (~seconds of a stuck path)


class TxRingError(OSError):
    """send(2) on the TX ring failed; .frame is the index of the frame it refused, or -1."""

    def __init__(self, err, msg, frame=-1):
        super().__init__(err, msg)
        self.frame = frame


def send_paced(uint8_t[::1] ring, int fd, int64_t block_size, int64_t frame_size, int64_t slots,
               int64_t head, const uint8_t[::1] buf, const int64_t[::1] offsets,
               const int64_t[::1] lengths, double pps, int64_t batch, double tick):
    """Send frames (buf[offsets[i]:offsets[i] + lengths[i]], in order) through the ring,
    `batch` slots to a send(2) at most, starting at slot `head`.

    pps > 0 paces to pps frames per second from the first frame: frame i is not handed
    over before start + i/pps; when none is due the sender sleeps (absolute monotonic
    deadline) until at least `tick` seconds' worth of frames are, so a batch is never
    a single frame because of the clock. pps <= 0 sends as fast as the ring goes.

    Returns (frames, bytes, seconds, sends, retries, waits, head): seconds from just
    before the first frame until the kernel is done with the last; retries is the
    ENOBUFS/EAGAIN answers retried, waits the times the next slot was still in flight;
    head the next slot to fill (for the next call)."""
    cdef int64_t n = offsets.shape[0], i = 0, m, k, due, nbytes = 0, sends = 0, retries = 0, waits = 0
    cdef int64_t per_block = block_size // frame_size, filled, tries, last = -1
    cdef int64_t quantum = 1
    cdef uint8_t *base = &ring[0]
    cdef uint8_t *p
    cdef const uint8_t *src = &buf[0] if buf.shape[0] else NULL
    cdef long r
    cdef int err = 0
    cdef double t0, now
    cdef pollfd pfd
    cdef int64_t[::1] slot_frame = np.full(slots, -1, np.int64)  # which frame a slot carries
    pfd.fd = fd
    pfd.events = POLLOUT
    if pps > 0 and pps * tick > 1:
        quantum = <int64_t>(pps * tick)
    with nogil:
        t0 = mono()
        while i < n:
            if pps > 0:
                now = mono()
                due = <int64_t>((now - t0) * pps) + 1   # frames 0..due-1 may go by now
                if due > n:
                    due = n
                if due <= i:
                    sleep_until(t0 + <double>(i + quantum - 1) / pps)
                    continue
                m = due - i
            else:
                m = n - i
            if m > batch:
                m = batch
            filled = 0
            for k in range(m):
                p = base + (head // per_block) * block_size + (head % per_block) * frame_size
                if tx_status(p) != TP_STATUS_AVAILABLE:
                    break  # still in flight: the kernel has not released it yet
                memcpy(p + DATA, src + offsets[i], lengths[i])
                tx_set_len(p + HDR_LEN, <uint32_t>lengths[i])
                tx_publish(p, TP_STATUS_SEND_REQUEST)
                slot_frame[head] = i
                last = head
                nbytes += lengths[i]
                i += 1
                filled += 1
                head = head + 1 if head + 1 < slots else 0
            if filled == 0:
                # The ring has come round to a frame the kernel still holds: sleep until
                # the slot at its head (ours) is free (packet_poll: POLLOUT).
                waits += 1
                poll(&pfd, 1, 100)
                continue
            err = flush(fd, &sends, &retries)
            if err:
                break
        # until the kernel is done with the last frame (its destructor frees the slot)
        if not err and last >= 0:
            p = base + (last // per_block) * block_size + (last % per_block) * frame_size
            while tx_status(p) != TP_STATUS_AVAILABLE:
                if tx_status(p) == TP_STATUS_WRONG_FORMAT:
                    err = EINVAL
                    break
                if tx_status(p) == TP_STATUS_SEND_REQUEST:
                    err = flush(fd, &sends, &retries)
                    if err:
                        break
                else:
                    sched_yield()
        now = mono()
    if err:
        # the frame the kernel refused is in the slot it marked WRONG_FORMAT
        for k in range(slots):
            p = base + (k // per_block) * block_size + (k % per_block) * frame_size
            if tx_status(p) == TP_STATUS_WRONG_FORMAT:
                raise TxRingError(err, "send", slot_frame[k])
        raise TxRingError(err, "send", -1)
    return i, nbytes, now - t0, sends, retries, waits, head


cdef int flush(int fd, int64_t *sends, int64_t *retries) noexcept nogil:
    """send(2) the requested slots; 0, or the errno that is not worth a retry. ENOBUFS
    (a frame dropped on the way, its slot requested again), EAGAIN (the socket's send
    budget) and EINTR are retried after letting the receiving side run."""
    cdef int64_t tries = 0
    while True:
        sends[0] += 1
        if tx_flush(fd, MSG_DONTWAIT) >= 0:
            return 0
        if errno != EINTR and errno != ENOBUFS and errno != EAGAIN:
            return errno
        retries[0] += 1
        tries += 1
        if tries > MAX_RETRIES:
            return errno
        sched_yield()
