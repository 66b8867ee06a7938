"""pcapng reader (https://www.ietf.org/archive/id/draft-ietf-opsawg-pcapng-03.html).

A file is a sequence of blocks: type u32, total length u32, body, total length u32
again, padded to 4 bytes.  A Section Header Block (SHB) starts each section and fixes
its byte order (the byte-order magic 0x1A2B3C4D); Interface Description Blocks (IDB)
declare interfaces in order (id 0, 1, ...), each with its own link type and timestamp
resolution (option if_tsresol, default microseconds); packets come in Enhanced Packet
Blocks (EPB), Simple Packet Blocks (SPB, interface 0, no timestamp) or the obsolete
Packet Block (PB).  Blocks of any other type are skipped, as the format asks.

One file may mix interfaces of several link types (dumpcap -i eth0 -i nflog): a frame
on an interface whose link type parsers.roce does not decode is yielded as it is (it
decodes as "other"), with one warning per such interface. A file whose interfaces
declared before its first packet (or before its end) are none of a decoded type is
refused (UndecodedLinkTypeError): every frame of it would be "other", as a classic pcap
of such a link type is refused (capfile.capture_format).
"""
from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterator

from .frame import (DECODED_LINKTYPES, MAX_SNAPLEN, CaptureError, CapturedFrame, UndecodedLinkTypeError,
                    undecoded_linktype)

log = logging.getLogger("ckptd.parsers")

BT_SHB = 0x0A0D0D0A      # reads the same in both byte orders, on purpose
BT_IDB = 0x00000001
BT_PB = 0x00000002       # obsolete Packet Block
BT_SPB = 0x00000003
BT_EPB = 0x00000006
BYTE_ORDER_MAGIC = 0x1A2B3C4D

OPT_END = 0
OPT_IF_TSRESOL = 9
OPT_IF_TSOFFSET = 14
_MAX_BLOCK = 16 << 20  # a packet block is at most MAX_SNAPLEN; others (names, stats) small
MAX_TS_NS = (1 << 63) - 1  # timestamps are int64 nanoseconds downstream (ckptd.fast.batches)


def is_pcapng(head: bytes) -> bool:
    return head[:4] == b"\x0a\x0d\x0d\x0a"


@dataclass
class Interface:
    linktype: int
    snaplen: int
    tsresol: int = 6          # raw if_tsresol byte: MSB 0 -> 10**-v s, MSB 1 -> 2**-v s
    tsoffset: int = 0         # seconds added to every timestamp

    def to_ns(self, ticks: int) -> int:
        v = self.tsresol & 0x7F
        if self.tsresol & 0x80:
            ns = (ticks * 1_000_000_000) >> v
        elif v <= 9:
            ns = ticks * 10 ** (9 - v)
        else:
            ns = ticks // 10 ** (v - 9)
        return ns + self.tsoffset * 1_000_000_000


def _options(body: bytes, order: str) -> Iterator[tuple[int, bytes]]:
    """(code, value) for each option in an options area; stops at opt_endofopt."""
    pos = 0
    while pos + 4 <= len(body):
        code, length = struct.unpack_from(order + "HH", body, pos)
        if code == OPT_END:
            return
        yield code, body[pos + 4:pos + 4 + length]
        pos += 4 + ((length + 3) & ~3)


def iter_pcapng(f: BinaryIO, name: str = "<pcapng>",
                warn: Callable[[str], None] | None = None) -> Iterator[CapturedFrame]:
    """Frames of an open pcapng file; `name` goes into error messages. `warn` takes the
    one line for each interface of a link type that is not decoded whose frames are
    yielded (default: a warning on the "ckptd.parsers" logger)."""
    order = None
    interfaces: list[Interface] = []
    block_no = 0
    frame_no = 0
    section = 0
    idb_blocks: list[int] = []  # this section's interfaces' block numbers
    decoded = False  # an interface of a decoded link type declared so far
    undecoded: tuple[int, int, int, int] | None = None  # (interface, block, section, link type) of the first other
    warned: set[int] = set()  # this section's interfaces warned of
    warn = warn or log.warning

    def where(if_id: int, blk: int, sec: int) -> str:
        return f"interface {if_id} (block {blk}{f', section {sec}' if sec > 1 else ''})"

    def refuse(before: str):
        if_id, blk, sec, lt = undecoded
        raise UndecodedLinkTypeError(f"{name}: {where(if_id, blk, sec)}: {undecoded_linktype(lt)}, and no "
                                     f"interface {before} is of one: every frame would be other traffic")

    def check_link(if_id: int, iface: Interface) -> None:
        """Before a frame on interface if_id is yielded."""
        if iface.linktype in DECODED_LINKTYPES:
            return
        if frame_no == 0 and not decoded:
            refuse("before the first packet")
        if if_id not in warned:
            warned.add(if_id)
            warn(f"{name}: {where(if_id, idb_blocks[if_id], section)}: {undecoded_linktype(iface.linktype)}: "
                 "its frames are read as other traffic")

    btype = None

    def fail(msg):
        # Name the frame the broken block holds, or the last good one before it.
        where = (f"frame {frame_no + 1}" if btype in (BT_EPB, BT_PB, BT_SPB)
                 else f"after frame {frame_no}")
        raise CaptureError(f"{name}: block {block_no} ({where}): {msg}")

    while True:
        head = f.read(12)   # type, length, and (for an SHB) the byte-order magic
        if not head:
            if undecoded is not None and not decoded and frame_no == 0:
                refuse("in the file")  # and no packet: refused as a classic pcap's header is
            return
        block_no += 1
        btype = None
        if len(head) < 8:
            fail(f"block header truncated ({len(head)} of 8 bytes) at end of file")
        if head[:4] == b"\x0a\x0d\x0d\x0a":
            if len(head) < 12:
                fail("section header truncated")
            if struct.unpack("<I", head[8:12])[0] == BYTE_ORDER_MAGIC:
                order = "<"
            elif struct.unpack(">I", head[8:12])[0] == BYTE_ORDER_MAGIC:
                order = ">"
            else:
                fail(f"bad byte-order magic {head[8:12].hex()}")
            interfaces = []            # interface ids restart in every section
            idb_blocks, warned = [], set()
            section += 1
        elif order is None:
            raise CaptureError(f"{name}: not a pcapng file (first block type "
                               f"{head[:4].hex()}, expected a section header 0a0d0d0a)")
        btype, blen = struct.unpack(order + "II", head[:8])
        if blen < 12 or blen % 4 or blen > _MAX_BLOCK:
            fail(f"bad block length {blen} (block type {btype:#x})")
        rest = f.read(blen - len(head))
        if len(rest) < blen - len(head):
            fail(f"block truncated: length says {blen} bytes, file has "
                 f"{len(head) + len(rest)} (block type {btype:#x})")
        block = head + rest
        if struct.unpack(order + "I", block[-4:])[0] != blen:
            fail(f"trailing block length differs from leading {blen}")
        body = block[8:-4]

        if btype == BT_SHB:
            if len(body) < 8:
                fail("section header block too short")
            major, minor = struct.unpack_from(order + "HH", body, 4)
            if major != 1:  # the spec: another major version may lay its blocks out otherwise
                fail(f"section version {major}.{minor}, not 1.x: a section this reader does not know")
        elif btype == BT_IDB:
            if len(body) < 8:
                fail("interface description block too short")
            linktype, _, snaplen = struct.unpack_from(order + "HHI", body)
            iface = Interface(linktype, snaplen)
            for code, value in _options(body[8:], order):
                if code == OPT_IF_TSRESOL and value:
                    iface.tsresol = value[0]
                elif code == OPT_IF_TSOFFSET and len(value) == 8:
                    iface.tsoffset = struct.unpack(order + "q", value)[0]
            interfaces.append(iface)
            idb_blocks.append(block_no)
            if linktype in DECODED_LINKTYPES:
                decoded = True
            elif undecoded is None:
                undecoded = (len(interfaces) - 1, block_no, section, linktype)
        elif btype in (BT_EPB, BT_PB):
            if btype == BT_EPB:
                if len(body) < 20:
                    fail("enhanced packet block too short")
                if_id, ts_hi, ts_lo, caplen, origlen = struct.unpack_from(order + "IIIII", body)
            else:
                if len(body) < 20:
                    fail("packet block too short")
                if_id, _drops, ts_hi, ts_lo, caplen, origlen = struct.unpack_from(
                    order + "HHIIII", body)
            if if_id >= len(interfaces):
                fail(f"names interface {if_id}, only {len(interfaces)} declared")
            if caplen > MAX_SNAPLEN:
                fail(f"captured length {caplen} is more than the largest snaplen ({MAX_SNAPLEN})")
            if 20 + caplen > len(body):
                fail(f"captured length {caplen} overruns its block")
            if caplen > origlen:
                fail(f"captured length {caplen} is more than the length on the wire ({origlen})")
            iface = interfaces[if_id]
            ticks = (ts_hi << 32) | ts_lo
            ts = iface.to_ns(ticks)
            if not 0 <= ts <= MAX_TS_NS:
                fail(f"timestamp {ticks} ticks of interface {if_id} is {ts} ns since 1970, outside "
                     f"0..2**63-1 (if_tsresol {iface.tsresol:#04x}, if_tsoffset {iface.tsoffset} s)")
            check_link(if_id, iface)
            frame_no += 1
            yield CapturedFrame(frame_no, ts, iface.linktype,
                                caplen, origlen, bytes(body[20:20 + caplen]), if_id)
        elif btype == BT_SPB:
            if not interfaces:
                fail("simple packet block before any interface")
            if len(body) < 4:
                fail("simple packet block too short")
            check_link(0, interfaces[0])
            frame_no += 1
            (origlen,) = struct.unpack_from(order + "I", body)
            iface = interfaces[0]
            caplen = min(origlen, len(body) - 4)
            if iface.snaplen:
                caplen = min(caplen, iface.snaplen)
            yield CapturedFrame(frame_no, None, iface.linktype, caplen, origlen,
                                bytes(body[4:4 + caplen]), 0)
        # SHB handled above; name resolution, statistics, custom and unknown blocks: skip.


def read_pcapng(path) -> Iterator[CapturedFrame]:
    with open(path, "rb") as f:
        yield from iter_pcapng(f, str(path))
