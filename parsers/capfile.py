"""open_capture(path): sniff pcap vs pcapng from the first bytes and yield frames."""
from __future__ import annotations

from typing import Iterator

from .frame import (LINKTYPE_ETHERNET, LINKTYPE_IPV4, LINKTYPE_IPV6, LINKTYPE_LINUX_SLL,
                       LINKTYPE_LINUX_SLL2, LINKTYPE_RAW, CaptureError, CapturedFrame)
from .pcap import _MAGICS, is_pcap, iter_pcap
from .pcapng import is_pcapng, iter_pcapng


DECODED_LINKTYPES = {LINKTYPE_ETHERNET: "Ethernet", LINKTYPE_RAW: "raw IP", LINKTYPE_LINUX_SLL: "Linux SLL",
                     LINKTYPE_IPV4: "IPv4", LINKTYPE_IPV6: "IPv6", LINKTYPE_LINUX_SLL2: "Linux SLL2"}


def capture_format(path) -> str:
    """'pcap' or 'pcapng'; CaptureError for anything else."""
    with open(path, "rb") as f:
        head = f.read(24)
    if is_pcap(head):
        # the file's one link type: one no decoder takes made every frame "other", and
        # replay ended "not recovered" (exit 3) without a word on why
        if len(head) == 24:
            order = _MAGICS[head[:4]][0]
            linktype = int.from_bytes(head[20:24], "little" if order == "<" else "big") & 0xFFFF
            if linktype not in DECODED_LINKTYPES:
                raise CaptureError(f"{path}: link type {linktype} is not one ckptd decodes "
                                   f"({', '.join(f'{t} {n}' for t, n in DECODED_LINKTYPES.items())})")
        return "pcap"
    if is_pcapng(head):
        return "pcapng"
    raise CaptureError(f"{path}: neither pcap nor pcapng (first bytes {head[:4].hex() or 'none'})")


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
