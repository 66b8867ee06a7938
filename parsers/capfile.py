"""open_capture(path): sniff pcap vs pcapng from the first bytes and yield frames."""
from __future__ import annotations

from typing import Iterator

from .frame import (LINKTYPE_ETHERNET, LINKTYPE_IPV4, LINKTYPE_IPV6, LINKTYPE_LINUX_SLL,
                       LINKTYPE_LINUX_SLL2, LINKTYPE_RAW, CaptureError, CapturedFrame)
from .pcap import is_pcap, iter_pcap
from .pcapng import is_pcapng, iter_pcapng


def capture_format(path) -> str:
    """'pcap' or 'pcapng'; CaptureError for anything else."""
    with open(path, "rb") as f:
        head = f.read(4)
    if is_pcap(head):
        return "pcap"
    if is_pcapng(head):
        return "pcapng"
    raise CaptureError(f"{path}: neither pcap nor pcapng (first bytes {head.hex() or 'none'})")


def open_capture(path) -> Iterator[CapturedFrame]:
    """Yield every frame of a pcap or pcapng file, in file order.

    Structural damage raises CaptureError naming the file and frame/block number; it
    is raised when reached, after the good frames before it have been yielded.
    """
    fmt = capture_format(path)
    with open(path, "rb") as f:
        if fmt == "pcap":
            yield from iter_pcap(f, str(path))
        else:
            yield from iter_pcapng(f, str(path))


__all__ = ["open_capture", "capture_format", "CaptureError", "CapturedFrame",
           "LINKTYPE_ETHERNET", "LINKTYPE_RAW", "LINKTYPE_LINUX_SLL", "LINKTYPE_IPV4",
           "LINKTYPE_IPV6", "LINKTYPE_LINUX_SLL2"]
