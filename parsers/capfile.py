"""open_capture(path): sniff pcap vs pcapng from the first bytes and yield frames."""
from __future__ import annotations

from typing import Iterator

import os
import stat
import struct

from .frame import (DECODED_LINKTYPES, LINKTYPE_ETHERNET, LINKTYPE_IPV4, LINKTYPE_IPV6, LINKTYPE_LINUX_SLL,
                    LINKTYPE_LINUX_SLL2, LINKTYPE_RAW, CaptureError, CapturedFrame, NotACaptureError,
                    UndecodedLinkTypeError,
                    undecoded_linktype)
from .pcap import _MAGICS, is_pcap, iter_pcap
from .pcapng import is_pcapng, iter_pcapng


def capture_format(path) -> str:
    """'pcap' or 'pcapng' by the file's first bytes; CaptureError for anything else. A
    pipe (`<(zcat x.pcap.gz)`, a FIFO) is 'stream', unread: its first bytes, read here,
    would be gone for the reader (open_capture sniffs the file it reads)."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        return "stream"
    with open(path, "rb") as f:
        return _sniff(f.read(24), path)


def not_a_capture(path, st: os.stat_result | None = None) -> str | None:
    """Why the file at `path` can hold no capture by its kind alone (a directory, a
    device: /dev/null read as a stream was an empty capture, a warning and exit 0), or
    None. A FIFO or `<(zcat x.pcap.gz)` is a stream, and one."""
    mode = (st or os.stat(path)).st_mode
    if stat.S_ISDIR(mode):
        return f"{path}: a directory, not a capture file"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return f"{path}: a {'character' if stat.S_ISCHR(mode) else 'block'} device, not a capture file"
    return None


def _sniff(head: bytes, path) -> str:
    """capture_format of the file whose first (up to) 24 bytes are `head`."""
    if is_pcap(head):
        # the file's one link type: one no decoder takes made every frame "other", and
        # replay ended "not recovered" (exit 3) without a word on why
        if len(head) == 24:
            order = _MAGICS[head[:4]][0]
            major = struct.unpack(order + "H", head[4:6])[0]
            linktype = int.from_bytes(head[20:24], "little" if order == "<" else "big") & 0xFFFF
            # (a header of another version is the reader's to report, as damage: a link type
            # read from it is none, and was refused as "link type 0")
            if major == 2 and linktype not in DECODED_LINKTYPES:
                raise UndecodedLinkTypeError(f"{path}: {undecoded_linktype(linktype)}")
        return "pcap"
    if is_pcapng(head):
        # each interface has its own link type: the reader refuses a file whose interfaces
        # before the first packet are none it decodes when it reaches that packet, which
        # for a replay is after the other streams began; here it is refused up front
        # (a regular file only: a FIFO's bytes, once read, are gone)
        if stat.S_ISREG(os.stat(path).st_mode):
            with open(path, "rb") as f:
                try:
                    next(iter_pcapng(f, str(path), warn=lambda msg: None), None)
                except UndecodedLinkTypeError:
                    raise
                except CaptureError:
                    pass  # damage: reported where the reader reaches it, after the frames before it
        return "pcapng"
    packed = next((kind for magic, kind in COMPRESSED.items() if head.startswith(magic)), None)
    if packed:  # (a capture is read by its offsets, mapped: a compressed one cannot be)
        raise NotACaptureError(f"{path}: {packed}-compressed, not a capture: decompress it first, or give it as "
                               f"`-` with the capture piped in (e.g. zcat {path} | ckptd replay ... -)")
    raise NotACaptureError(f"{path}: neither pcap nor pcapng (first bytes {head[:4].hex() or 'none'})")


# the first bytes of the compressed files a capture is often kept as -> the compressor
COMPRESSED = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"\xfd7zXZ\x00": "xz", b"BZh": "bzip2",
              b"\x04\x22\x4d\x18": "lz4"}


def open_capture(path, warn=None) -> Iterator[CapturedFrame]:
    """Yield every frame of a pcap or pcapng file, in file order. `warn`: as
    pcapng.iter_pcapng takes it (the line for each interface of a link type not decoded).

    Structural damage raises CaptureError naming the file and frame/block number; it
    is raised when reached, after the good frames before it have been yielded.
    """
    if why := not_a_capture(path):
        raise CaptureError(why)
    with open(path, "rb") as f:
        # sniffed from the file being read, then given back to the reader: of a pipe
        # (`<(zcat x.pcap.gz)`, a FIFO) a second open would start past those bytes
        head = f.read(24)
        fmt = _sniff(head, path)
        whole = _Rewound(head, f)
        if fmt == "pcap":
            yield from iter_pcap(whole, str(path))
        else:
            yield from iter_pcapng(whole, str(path), warn)


class _Rewound:
    """A file read from its start again after its first bytes were read (`head`): the
    readers need only read(n)."""

    def __init__(self, head: bytes, f):
        self.head, self.f = head, f

    def read(self, n: int = -1) -> bytes:
        if not self.head:
            return self.f.read(n)
        out = self.head if n < 0 else self.head[:n]
        self.head = self.head[len(out):]
        if n < 0 or len(out) < n:
            out += self.f.read(-1 if n < 0 else n - len(out))
        return out


__all__ = ["open_capture", "capture_format", "CaptureError", "CapturedFrame", "NotACaptureError",
           "UndecodedLinkTypeError",
           "DECODED_LINKTYPES",
           "LINKTYPE_ETHERNET", "LINKTYPE_RAW", "LINKTYPE_LINUX_SLL", "LINKTYPE_IPV4",
           "LINKTYPE_IPV6", "LINKTYPE_LINUX_SLL2"]
