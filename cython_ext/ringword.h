/* The status word of a packet ring's block or slot (TPACKET_V3 RX blocks in ring.pyx,
 * TPACKET_V2 TX slots in txring.pyx) is shared with the kernel: read it with acquire
 * order (what it guards was written before it), write it with release order (our reads
 * or writes of what it guards are done before the kernel may act on it). */
#ifndef CKPTD_RINGWORD_H
#define CKPTD_RINGWORD_H
#include <stdint.h>

static inline uint32_t ckptd_load_acquire(const uint8_t *p) {
    return __atomic_load_n((const uint32_t *)p, __ATOMIC_ACQUIRE);
}

static inline void ckptd_store_release(uint8_t *p, uint32_t v) {
    __atomic_store_n((uint32_t *)p, v, __ATOMIC_RELEASE);
}
#endif
