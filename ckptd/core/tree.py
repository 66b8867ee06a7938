"""NCCL's tree allreduce on the network: which NIC pairs carry what, message by message.

ckptd never decodes it (only a ring allreduce puts every final value on ring links):
this model exists so that tree traffic is recognised and refused by name
(ckptd.transports.roce.flows) and so that `ckptd synth --collective tree` writes it.

Shape (src/graph/connect.cc:130-160@v2.19.4-1 connectTrees): a double binary tree over
the nodes (src/graph/trees.cc:31-108@v2.19.4-1), the first tree on the communicator's
first half of the channels and the second on the other half (NCCL doubles the search's
channels, connect.cc:396@v2.19.4-1, channel c+nChannels taking tree 1). Inside a node
the ranks form a chain (connect.cc:47-58@v2.19.4-1); which rank of a node talks to the
network is the tree graph's first (treeIntra[0]); this model takes the rank the channel's
ring enters the node at, which is the same rank on one-GPU nodes.

Messages (src/device/all_reduce.h:98-254@v2.19.4-1 runTreeUpDown/runTreeSplit, 86-240@v2.27.7-1):
every chunk of the channel's elements goes up every edge (child -> parent, reduced on
the way) and then down every edge (parent -> child, the final values): one send per
chunk (ProtoSimple<1, 1>, LL and LL128 one step a chunk), so both directions of every
edge carry the same chunk sequence. Chunks: src/enqueue.cc:1343-1406@v2.19.4-1 (Simple
stepSize halved while the tree is shallow for the size; LL128 halved by nstepsLL128) and
calcCollChunking enqueue.cc:1985-2055@v2.27.7-1 (from 2.20 Simple is one whole step, LL
half a step, LL128 15/16 of a step halved by nstepsLL128, rounded to the grain) over the
channel's contiguous part (ncclCollCbdPart, as the ring's from 2.22: 2.20-2.21's
alignment is approximated by the same cells).
"""
from __future__ import annotations

from ckptd.core.schedule import (RS, WARP_SIZE, Bucket, RingConfig, RingSchedule, Send, _div_up,
                                 cbd_ranges, wire_bytes)


def _btree(n: int, r: int) -> tuple[int, list[int]]:
    """(parent, children) of r in NCCL's binary tree over n (trees.cc:31-65@v2.19.4-1):
    r's lowest set bit b; the parent flips b and sets the next bit up, or just flips b
    when that is out of range; the children are r - b/2 and the largest r + b/2^k < n."""
    if n == 1:
        return -1, []
    bit = 1
    while bit < n and not bit & r:
        bit <<= 1
    if r == 0:
        return -1, [bit >> 1]
    up = (r ^ bit) | (bit << 1)
    if up >= n:
        up = r ^ bit
    low = bit >> 1
    kids = []
    if low:
        kids.append(r - low)
        while low and r + low >= n:
            low >>= 1
        if low:
            kids.append(r + low)
    return up, kids


def tree_edges(nnodes: int, which: int) -> list[tuple[int, int]]:
    """(child, parent) node pairs of tree 0 or tree 1 of NCCL's double binary tree
    (trees.cc:88-108@v2.19.4-1): tree 1 mirrors tree 0 (n even) or shifts it by one (n odd)."""
    if which == 0:
        name = unname = lambda k: k
    elif nnodes % 2:
        name, unname = (lambda k: (k + 1) % nnodes), (lambda k: (k - 1) % nnodes)
    else:
        name = unname = lambda k: nnodes - 1 - k
    edges = []
    for node in range(nnodes):
        up, _ = _btree(nnodes, unname(node))
        if up >= 0:
            edges.append((node, name(up)))
    return edges


def tree_chunk(cfg: RingConfig, nbytes: int, nc: int, nnodes: int, itemsize: int) -> int:
    """Data bytes of one tree chunk for an allreduce of nbytes on nc channels."""
    v, step, proto = tuple(cfg.nccl_version), cfg.step_bytes, cfg.protocol
    chunk = step
    ppn = cfg.nranks / nnodes
    if proto == "ll":
        return step // 2
    if proto == "ll128":
        if v >= (2, 20):
            chunk = step // 128 * 120
        nsteps = 1 + (nnodes.bit_length() - 1) + 0.1 * ppn
        while nbytes // (nc * chunk) < nsteps * 64 / ppn and chunk > 131072:
            chunk //= 2
        while nbytes // (nc * chunk) < nsteps * 16 / ppn and chunk > 32768:
            chunk //= 2
        if v < (2, 20):
            chunk = chunk // 128 * 120
        return chunk // 1920 * 1920 if v >= (2, 22) else chunk
    if v < (2, 20):  # enqueue.cc:1349-1355@v2.19.4-1, depth from connect.cc:135
        depth = cfg.nranks // nnodes - 1 + (nnodes.bit_length() - 1)
        for times, floor in ((8, 131072), (4, 65536), (1, 32768)):
            while nbytes // (nc * chunk) < depth * times and chunk > floor:
                chunk //= 2
    return chunk // 512 * 512 if v >= (2, 22) else chunk


def _channel_chunks(cfg: RingConfig, count: int, itemsize: int, nnodes: int):
    """(channel, [(first element, element count), ...]) of each channel the allreduce uses."""
    nc, nt = cfg.tune(count * itemsize)
    chunk = tree_chunk(cfg, count * itemsize, nc, nnodes, itemsize) // itemsize
    if tuple(cfg.nccl_version) < (2, 20):  # all_reduce.h:104-114,176-197@v2.19.4-1
        if cfg.protocol == "simple":
            nt += 3 * WARP_SIZE  # the tree's 4 extra warps instead of the ring's sync warp
            min_chunk = (nt - 2 * WARP_SIZE) * 8 * 8 // itemsize
        elif cfg.protocol == "ll":
            min_chunk = nt * 8 // itemsize
        else:
            min_chunk = nt * (60 // itemsize) // 8
        if nc * chunk > count:
            chunk = _div_up(count, nc * min_chunk) * min_chunk
        loop = nc * chunk
        for bid in range(nc):
            yield bid, [(g + bid * chunk, min(chunk, count - g - bid * chunk))
                        for g in range(0, count, loop) if g + bid * chunk < count]
        return
    for bid, off, cnt in cbd_ranges(cfg.nccl_version, cfg.protocol, count, itemsize, cfg.channels, nc):
        yield bid, [(off + e, min(chunk, cnt - e)) for e in range(0, cnt, chunk)]


class TreeSchedule(RingSchedule):
    """The wire schedule of one iteration's allreduces run as NCCL Tree: sends[(src,
    dst, channel)] and flows[(src, dst, channel, qp)] as RingSchedule's, keyed by the
    ranks at either end of each tree edge between nodes (phase RS going up, the final
    values coming down have `ring_step` 1; none is ever placed)."""

    def __init__(self, cfg: RingConfig, buckets: list[Bucket], node_of, send_base: dict | None = None):
        self._start(cfg, buckets, [], send_base)
        nodes = list(dict.fromkeys(node_of))  # numbered in order of their first rank (init.cc:973-983@v2.19.4-1)
        self.nnodes = len(nodes)
        self.edges: dict[int, list[tuple[int, int]]] = {}  # channel -> (child rank, parent rank)
        for c, ring in enumerate(cfg.rings):
            entry = {}
            for i, r in enumerate(ring):  # the rank channel c's ring enters each node at
                if node_of[ring[i - 1]] != node_of[r] or len(nodes) == 1:
                    entry.setdefault(nodes.index(node_of[r]), r)
            which = 1 if cfg.channels > 1 and c >= cfg.channels // 2 else 0
            self.edges[c] = [(entry[a], entry[b]) for a, b in tree_edges(self.nnodes, which)]
            for child, parent in self.edges[c]:
                for conn in ((child, parent, c), (parent, child, c)):
                    self._add_connection(conn)
        for b, bucket in enumerate(self.buckets):
            if bucket.count:
                self._add_tree_allreduce(b, bucket)

    def _add_tree_allreduce(self, b: int, bucket: Bucket):
        size = bucket.dtype.itemsize
        for bid, chunks in _channel_chunks(self.cfg, bucket.count, size, self.nnodes):
            for child, parent in self.edges[bid]:
                for conn, direction in (((child, parent, bid), 0), ((parent, child, bid), 1)):
                    first = self._sends[conn].n
                    self._emit(conn, [Send(b, RS, off, nelem, wire_bytes(self.cfg.protocol, nelem, size),
                                           first + k, k, direction) for k, (off, nelem) in enumerate(chunks)])
