/* A minimal receiver for the AF_XDP vs TPACKET_V3 comparison (benchmarks/afxdp).
 *
 *   rx xdp|tpacket IFNAME [--ring-mib N] [--work copy|touch] [--xdp-mode native|generic]
 *                         [--huge] [--busy]
 *
 * Both receivers do the same minimal work per frame (--work copy: copy it once into a
 * 4 MiB staging buffer, as a capture worker copies blocks into shared memory; --work
 * touch: read its first and last 8 bytes) and wait in poll(2) when nothing is there
 * (--busy: spin instead). Prints "ready" once capturing, and on SIGINT/SIGTERM one JSON
 * line: frames, bytes, the kernel's drop counters, this process's CPU seconds.
 *
 * tpacket: an AF_PACKET socket with a TPACKET_V3 ring of --ring-mib (1 MiB blocks, 10 ms
 * block timeout), as ckptd.live.ring sets one up (Documentation/networking/packet_mmap.rst).
 *
 * xdp: an AF_XDP socket (Documentation/networking/af_xdp.rst): a UMEM of --ring-mib in
 * 4 KiB chunks (--huge: in 2 MiB hugetlb pages), fill and rx rings of one entry per
 * chunk, a one-entry XSKMAP and a five-instruction XDP program that
 * redirects every frame to the socket in the map (falling back to XDP_PASS), attached
 * with a BPF link so it goes away with this process. veth has no zero-copy support, so
 * the kernel copies each frame into a UMEM chunk (copy mode, net/xdp/xsk.c).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/if_link.h>
#include <linux/if_packet.h>
#include <linux/if_xdp.h>
#include <net/if.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SOL_XDP
#define SOL_XDP 283
#endif
#ifndef AF_XDP
#define AF_XDP 44
#endif
#ifndef MAP_HUGE_2MB
#define MAP_HUGE_2MB (21 << 26)
#endif

#define CHUNK 4096
#define STAGING (4u << 20)

static volatile sig_atomic_t stop;
static void on_signal(int sig) { (void)sig; stop = 1; }

static void die(const char *what) {
    fprintf(stderr, "rx: %s: %s\n", what, strerror(errno));
    exit(1);
}

/* -- the per-frame work, the same for both receivers -------------------------------- */
static int work_copy = 1;
static unsigned char *staging;
static size_t staged;
static uint64_t frames, bytes, check;

static inline void take(const unsigned char *p, uint32_t len) {
    frames++;
    bytes += len;
    if (work_copy) {
        if (staged + len > STAGING)
            staged = 0;
        memcpy(staging + staged, p, len);
        staged += len;
        check += staging[staged - 1];
    } else {
        uint64_t a, b;
        memcpy(&a, p, 8);
        memcpy(&b, p + len - 8, 8);
        check += a ^ b;
    }
}

static void report(const char *extra) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    printf("{\"frames\": %llu, \"bytes\": %llu, \"check\": %llu, \"utime\": %.6f, \"stime\": %.6f, %s}\n",
           (unsigned long long)frames, (unsigned long long)bytes, (unsigned long long)check,
           ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6, ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6,
           extra);
    fflush(stdout);
}

static void wait_for(int fd, int busy) {
    if (busy)
        return;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    poll(&p, 1, 100);
}

/* -- TPACKET_V3 --------------------------------------------------------------------- */
static void run_tpacket(int ifindex, size_t ring_bytes, int busy) {
    int fd = socket(AF_PACKET, SOCK_RAW, htons(ETH_P_ALL));
    if (fd < 0) die("socket(AF_PACKET)");
    int v = TPACKET_V3;
    if (setsockopt(fd, SOL_PACKET, PACKET_VERSION, &v, sizeof v)) die("PACKET_VERSION");
    struct tpacket_req3 req = {.tp_block_size = 1 << 20, .tp_frame_size = 1 << 11,
                               .tp_retire_blk_tov = 10};
    req.tp_block_nr = ring_bytes / req.tp_block_size;
    req.tp_frame_nr = ring_bytes / req.tp_frame_size;
    if (setsockopt(fd, SOL_PACKET, PACKET_RX_RING, &req, sizeof req)) die("PACKET_RX_RING");
    unsigned char *ring = mmap(NULL, ring_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (ring == MAP_FAILED) die("mmap(ring)");
    struct sockaddr_ll ll = {.sll_family = AF_PACKET, .sll_protocol = htons(ETH_P_ALL), .sll_ifindex = ifindex};
    if (bind(fd, (struct sockaddr *)&ll, sizeof ll)) die("bind(AF_PACKET)");
    puts("ready");
    fflush(stdout);
    unsigned blk = 0;
    while (!stop) {
        struct tpacket_block_desc *bd = (void *)(ring + (size_t)blk * req.tp_block_size);
        if (!(__atomic_load_n(&bd->hdr.bh1.block_status, __ATOMIC_ACQUIRE) & TP_STATUS_USER)) {
            wait_for(fd, busy);
            continue;
        }
        struct tpacket3_hdr *h = (void *)((unsigned char *)bd + bd->hdr.bh1.offset_to_first_pkt);
        for (uint32_t i = 0; i < bd->hdr.bh1.num_pkts; i++) {
            take((unsigned char *)h + h->tp_mac, h->tp_snaplen);
            h = (void *)((unsigned char *)h + h->tp_next_offset);
        }
        __atomic_store_n(&bd->hdr.bh1.block_status, TP_STATUS_KERNEL, __ATOMIC_RELEASE);
        blk = (blk + 1) % req.tp_block_nr;
    }
    struct tpacket_stats_v3 st;
    socklen_t sl = sizeof st;
    if (getsockopt(fd, SOL_PACKET, PACKET_STATISTICS, &st, &sl)) die("PACKET_STATISTICS");
    char extra[160];
    snprintf(extra, sizeof extra, "\"kernel_packets\": %u, \"drops\": %u", st.tp_packets, st.tp_drops);
    report(extra);
}

/* -- AF_XDP ------------------------------------------------------------------------- */
static long sys_bpf(int cmd, union bpf_attr *attr) {
    return syscall(__NR_bpf, cmd, attr, sizeof *attr);
}

/* A single-producer/single-consumer ring of the kernel's (af_xdp.rst "Rings"). */
struct ring {
    uint32_t *producer, *consumer, mask;
    void *desc;
};

static void map_ring(struct ring *r, int fd, const struct xdp_ring_offset *off, uint32_t n, size_t entry,
                     off_t pgoff) {
    unsigned char *m = mmap(NULL, off->desc + n * entry, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, pgoff);
    if (m == MAP_FAILED) die("mmap(xsk ring)");
    r->producer = (uint32_t *)(m + off->producer);
    r->consumer = (uint32_t *)(m + off->consumer);
    r->desc = m + off->desc;
    r->mask = n - 1;
}

static int load_redirect_program(int map_fd) {
    /* r2 = ctx->rx_queue_index; r1 = &xskmap; r3 = XDP_PASS; call bpf_redirect_map; exit
     * (struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index @16) */
    struct bpf_insn prog[] = {
        {.code = BPF_LDX | BPF_MEM | BPF_W, .dst_reg = 2, .src_reg = 1, .off = 16},
        {.code = BPF_LD | BPF_DW | BPF_IMM, .dst_reg = 1, .src_reg = BPF_PSEUDO_MAP_FD, .imm = map_fd},
        {.code = 0},
        {.code = BPF_ALU64 | BPF_MOV | BPF_K, .dst_reg = 3, .imm = XDP_PASS},
        {.code = BPF_JMP | BPF_CALL, .imm = BPF_FUNC_redirect_map},
        {.code = BPF_JMP | BPF_EXIT},
    };
    static char log[4096];
    union bpf_attr a = {0};
    a.prog_type = BPF_PROG_TYPE_XDP;
    a.insns = (uintptr_t)prog;
    a.insn_cnt = sizeof prog / sizeof prog[0];
    a.license = (uintptr_t)"GPL";
    a.log_buf = (uintptr_t)log;
    a.log_size = sizeof log;
    a.log_level = 1;
    int fd = sys_bpf(BPF_PROG_LOAD, &a);
    if (fd < 0) {
        fprintf(stderr, "%s\n", log);
        die("BPF_PROG_LOAD");
    }
    return fd;
}

static void run_xdp(int ifindex, size_t umem_bytes, int generic, int huge, int busy) {
    uint32_t n = umem_bytes / CHUNK;  /* chunks = fill and rx ring entries (powers of two) */
    int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE | (huge ? MAP_HUGETLB | MAP_HUGE_2MB : 0);
    unsigned char *umem = mmap(NULL, umem_bytes, PROT_READ | PROT_WRITE, flags, -1, 0);
    if (umem == MAP_FAILED) die(huge ? "mmap(UMEM, MAP_HUGETLB)" : "mmap(UMEM)");

    int fd = socket(AF_XDP, SOCK_RAW, 0);
    if (fd < 0) die("socket(AF_XDP)");
    struct xdp_umem_reg mr = {.addr = (uintptr_t)umem, .len = umem_bytes, .chunk_size = CHUNK};
    if (setsockopt(fd, SOL_XDP, XDP_UMEM_REG, &mr, sizeof mr)) die("XDP_UMEM_REG");
    if (setsockopt(fd, SOL_XDP, XDP_UMEM_FILL_RING, &n, sizeof n)) die("XDP_UMEM_FILL_RING");
    if (setsockopt(fd, SOL_XDP, XDP_UMEM_COMPLETION_RING, &n, sizeof n)) die("XDP_UMEM_COMPLETION_RING");
    if (setsockopt(fd, SOL_XDP, XDP_RX_RING, &n, sizeof n)) die("XDP_RX_RING");
    struct xdp_mmap_offsets off;
    socklen_t ol = sizeof off;
    if (getsockopt(fd, SOL_XDP, XDP_MMAP_OFFSETS, &off, &ol)) die("XDP_MMAP_OFFSETS");
    struct ring fill, rx;
    map_ring(&fill, fd, &off.fr, n, sizeof(uint64_t), XDP_UMEM_PGOFF_FILL_RING);
    map_ring(&rx, fd, &off.rx, n, sizeof(struct xdp_desc), XDP_PGOFF_RX_RING);
    /* every chunk goes to the kernel now; each comes back through the rx ring */
    uint64_t *fq = fill.desc;
    for (uint32_t i = 0; i < n; i++)
        fq[i] = (uint64_t)i * CHUNK;
    __atomic_store_n(fill.producer, n, __ATOMIC_RELEASE);
    struct sockaddr_xdp sx = {.sxdp_family = AF_XDP, .sxdp_ifindex = ifindex, .sxdp_queue_id = 0,
                              .sxdp_flags = XDP_COPY};
    /* the previous run's socket lets go of the queue asynchronously: wait for it */
    for (int tries = 0; bind(fd, (struct sockaddr *)&sx, sizeof sx); tries++) {
        if (errno != EBUSY || tries == 50) die("bind(AF_XDP)");
        usleep(100000);
    }

    union bpf_attr a = {0};
    a.map_type = BPF_MAP_TYPE_XSKMAP;
    a.key_size = a.value_size = 4;
    a.max_entries = 1;
    int map_fd = sys_bpf(BPF_MAP_CREATE, &a);
    if (map_fd < 0) die("BPF_MAP_CREATE(XSKMAP)");
    uint32_t key = 0, val = fd;
    memset(&a, 0, sizeof a);
    a.map_fd = map_fd;
    a.key = (uintptr_t)&key;
    a.value = (uintptr_t)&val;
    if (sys_bpf(BPF_MAP_UPDATE_ELEM, &a)) die("BPF_MAP_UPDATE_ELEM");
    int prog_fd = load_redirect_program(map_fd);
    memset(&a, 0, sizeof a);
    a.link_create.prog_fd = prog_fd;
    a.link_create.target_ifindex = ifindex;
    a.link_create.attach_type = BPF_XDP;
    a.link_create.flags = generic ? XDP_FLAGS_SKB_MODE : XDP_FLAGS_DRV_MODE;
    if (sys_bpf(BPF_LINK_CREATE, &a) < 0) die(generic ? "BPF_LINK_CREATE(generic XDP)" : "BPF_LINK_CREATE(native XDP)");
    puts("ready");
    fflush(stdout);

    struct xdp_desc *rd = rx.desc;
    while (!stop) {
        uint32_t prod = __atomic_load_n(rx.producer, __ATOMIC_ACQUIRE), cons = *rx.consumer;
        if (prod == cons) {
            wait_for(fd, busy);
            continue;
        }
        uint32_t fprod = *fill.producer;
        for (; cons != prod; cons++) {
            const struct xdp_desc *d = &rd[cons & rx.mask];
            take(umem + d->addr, d->len);
            /* the chunk goes straight back to the fill ring (aligned mode: its base) */
            fq[fprod++ & fill.mask] = d->addr & ~(uint64_t)(CHUNK - 1);
        }
        __atomic_store_n(rx.consumer, cons, __ATOMIC_RELEASE);
        __atomic_store_n(fill.producer, fprod, __ATOMIC_RELEASE);
    }
    struct xdp_statistics st;
    socklen_t sl = sizeof st;
    if (getsockopt(fd, SOL_XDP, XDP_STATISTICS, &st, &sl)) die("XDP_STATISTICS");
    char extra[256];
    snprintf(extra, sizeof extra,
             "\"drops\": %llu, \"rx_dropped\": %llu, \"rx_ring_full\": %llu, \"fill_ring_empty\": %llu",
             (unsigned long long)(st.rx_dropped + st.rx_ring_full),
             (unsigned long long)st.rx_dropped, (unsigned long long)st.rx_ring_full,
             (unsigned long long)st.rx_fill_ring_empty_descs);
    report(extra);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: rx xdp|tpacket IFNAME [--ring-mib N] [--work copy|touch] "
                        "[--xdp-mode native|generic] [--huge] [--busy]\n");
        return 2;
    }
    size_t ring_mib = 32;
    int generic = 0, huge = 0, busy = 0;
    for (int i = 3; i < argc; i++) {
        if (!strcmp(argv[i], "--ring-mib") && i + 1 < argc) ring_mib = strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--work") && i + 1 < argc) work_copy = !strcmp(argv[++i], "copy");
        else if (!strcmp(argv[i], "--xdp-mode") && i + 1 < argc) generic = !strcmp(argv[++i], "generic");
        else if (!strcmp(argv[i], "--huge")) huge = 1;
        else if (!strcmp(argv[i], "--busy")) busy = 1;
        else { fprintf(stderr, "rx: unknown argument %s\n", argv[i]); return 2; }
    }
    int ifindex = if_nametoindex(argv[2]);
    if (!ifindex) die(argv[2]);
    staging = malloc(STAGING);
    if (!staging) die("malloc");
    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    if (!strcmp(argv[1], "tpacket"))
        run_tpacket(ifindex, ring_mib << 20, busy);
    else if (!strcmp(argv[1], "xdp"))
        run_xdp(ifindex, ring_mib << 20, generic, huge, busy);
    else { fprintf(stderr, "rx: unknown receiver %s\n", argv[1]); return 2; }
    return 0;
}
