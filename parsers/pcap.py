"""Classic libpcap files: reader (both byte orders, micro- and nanosecond magics) and a
nanosecond writer.

File header (24 B): magic u32, version u16.u16, thiszone i32, sigfigs u32, snaplen u32,
linktype u32.  Each record: ts_sec u32, ts_frac u32 (us or ns by magic), caplen u32,
origlen u32, then caplen bytes.  The writer writes little-endian unless told otherwise;
the reader takes either.
"""
from __future__ import annotations

import struct
from typing import BinaryIO, Iterable, Iterator

from .frame import LINKTYPE_ETHERNET, MAX_SNAPLEN, CaptureError, CapturedFrame

MAGIC_US = 0xA1B2C3D4
MAGIC_NS = 0xA1B23C4D
_MAGICS = {  # first 4 bytes as written in the file -> (byte order, ns per tick)
    struct.pack("<I", MAGIC_US): ("<", 1000),
    struct.pack(">I", MAGIC_US): (">", 1000),
    struct.pack("<I", MAGIC_NS): ("<", 1),
    struct.pack(">I", MAGIC_NS): (">", 1),
}


def is_pcap(head: bytes) -> bool:
    return head[:4] in _MAGICS


def byte_order(head: bytes) -> tuple[str, int] | None:
    """(struct byte order, ns per timestamp tick) of a pcap file that starts with
    `head`, or None if it is no pcap."""
    return _MAGICS.get(head[:4])


def iter_pcap(f: BinaryIO, name: str = "<pcap>") -> Iterator[CapturedFrame]:
    """Frames of an open pcap file; `name` goes into error messages."""
    head = f.read(24)
    if len(head) < 4 or head[:4] not in _MAGICS:
        raise CaptureError(f"{name}: not a pcap file (magic {head[:4].hex() or 'missing'})")
    order, tick_ns = _MAGICS[head[:4]]
    if len(head) < 24:
        raise CaptureError(f"{name}: pcap file header truncated ({len(head)} of 24 bytes)")
    major, minor, _, _, _snaplen, network = struct.unpack(order + "HHiIII", head[4:])
    if major != 2:  # 2.x is the only pcap format: another number is a damaged header or another format
        raise CaptureError(f"{name}: pcap version {major}.{minor}, not 2.x (a damaged or foreign file header)")
    # Bits 16-31 can carry FCS-length flags (pcap spec); the link type is the low 16.
    linktype = network & 0xFFFF
    record = struct.Struct(order + "IIII")
    index = 0
    while True:
        rec = f.read(16)
        if not rec:
            return
        index += 1
        if len(rec) < 16:
            raise CaptureError(f"{name}: frame {index}: record header truncated "
                               f"({len(rec)} of 16 bytes) at end of file")
        sec, frac, caplen, origlen = record.unpack(rec)
        if rec[:4] in _MAGICS or rec[:4] == b"\x0a\x0d\x0d\x0a":  # a pcap's magic, a pcapng SHB's type
            raise CaptureError(f"{name}: frame {index}: another capture file's header starts here (files joined "
                               "with cat?): one stream's files, as tcpdump -C/-G rotates them, are joined with "
                               "`mergecap -a -w one.pcap first.pcap second.pcap ...`; each argument is a stream")
        if caplen > MAX_SNAPLEN:
            raise CaptureError(f"{name}: frame {index}: captured length {caplen} is more than "
                               f"the largest snaplen ({MAX_SNAPLEN}): a broken record header")
        if caplen > origlen:  # more bytes captured than were on the wire: a broken record header
            raise CaptureError(f"{name}: frame {index}: captured length {caplen} is more than the "
                               f"length on the wire ({origlen}): a broken record header")
        data = f.read(caplen)
        if len(data) < caplen:
            raise CaptureError(f"{name}: frame {index}: record truncated: header says "
                               f"{caplen} bytes, file has {len(data)}")
        yield CapturedFrame(index, sec * 1_000_000_000 + frac * tick_ns, linktype,
                            caplen, origlen, data, 0)


def read_pcap(path) -> Iterator[CapturedFrame]:
    with open(path, "rb") as f:
        yield from iter_pcap(f, str(path))


class PcapWriter:
    """Writes a nanosecond-resolution pcap: `w.write(data, ts_ns)` per frame."""

    def __init__(self, f: BinaryIO, linktype: int = LINKTYPE_ETHERNET, snaplen: int = 262144,
                 nanosecond: bool = True, byteorder: str = "<"):
        self.f = f
        self.nanosecond = nanosecond
        self.order = byteorder
        self.snaplen = snaplen
        magic = MAGIC_NS if nanosecond else MAGIC_US
        f.write(struct.pack(byteorder + "IHHiIII", magic, 2, 4, 0, 0, snaplen, linktype))

    def write(self, data: bytes, ts_ns: int = 0, origlen: int | None = None) -> None:
        origlen = len(data) if origlen is None else origlen
        data = bytes(data[:self.snaplen])
        sec, frac = divmod(ts_ns, 1_000_000_000)
        if not self.nanosecond:
            frac //= 1000
        self.f.write(struct.pack(self.order + "IIII", sec, frac, len(data), origlen))
        self.f.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.flush()


class ChunkedFile:
    """A file for writing captures: written up to the next multiple of WRITE_CHUNK at a
    time, so the writes cover whole, aligned WRITE_CHUNK pieces of the file (after a
    flush, the next write completes the piece it left). The page cache then keeps the
    capture in large folios (where the file system has them), as it would after reading
    it from disk, and a replay maps it 2 MiB at a time (cython_ext/filemap.pyx). Written
    8 KiB at a time (Python's default buffer) it was held in 4 KiB pages: issue 16's
    replay of a fresh synthesis took 0.147 s instead of 0.109 (benchmarks/RESULTS.md)."""

    WRITE_CHUNK = 4 << 20

    def __init__(self, path):
        self.raw = open(path, "wb", buffering=0)
        self.pending = bytearray()
        self.written = 0  # bytes handed to the file so far

    def write(self, data) -> None:
        self.pending += data
        end = (self.written + len(self.pending)) // self.WRITE_CHUNK * self.WRITE_CHUNK
        if end > self.written:
            self._write_out(end - self.written)

    def _write_out(self, n: int) -> None:
        view = memoryview(self.pending)[:n]
        while view:
            view = view[self.raw.write(view):]
        view.release()
        del self.pending[:n]
        self.written += n

    def flush(self) -> None:
        self._write_out(len(self.pending))

    def close(self) -> None:
        if not self.raw.closed:
            self.flush()
            self.raw.close()


def write_pcap(path, frames: Iterable, linktype: int = LINKTYPE_ETHERNET,
               nanosecond: bool = True) -> int:
    """Write frames to `path`; each item is bytes, (ts_ns, bytes), or a CapturedFrame.
    Returns the number written."""
    n = 0
    with open(path, "wb") as f:
        w = PcapWriter(f, linktype=linktype, nanosecond=nanosecond)
        for item in frames:
            if isinstance(item, CapturedFrame):
                w.write(item.data, item.ts_ns or 0, item.origlen)
            elif isinstance(item, tuple):
                w.write(item[1], item[0])
            else:
                w.write(item, 0)
            n += 1
    return n
