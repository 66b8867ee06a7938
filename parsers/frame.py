"""What the capture-file readers yield, and the error they raise.

Kept apart from capfile.py so that pcap.py and pcapng.py can import it without a
cycle; capfile.py re-exports both names (``parsers.capfile.CaptureError``).
"""
from __future__ import annotations

from dataclasses import dataclass
from ckptd.errors import CkptdError

LINKTYPE_ETHERNET = 1
LINKTYPE_RAW = 101          # raw IPv4 or IPv6, version nibble decides
LINKTYPE_LINUX_SLL = 113
LINKTYPE_IPV4 = 228
LINKTYPE_IPV6 = 229
LINKTYPE_LINUX_SLL2 = 276
# The link types parsers.roce decodes (a frame of any other is FrameClass.OTHER): a capture
# of none of them is refused by name (capfile.capture_format, pcapng.iter_pcapng)
DECODED_LINKTYPES = {LINKTYPE_ETHERNET: "Ethernet", LINKTYPE_RAW: "raw IP", LINKTYPE_LINUX_SLL: "Linux SLL",
                     LINKTYPE_IPV4: "IPv4", LINKTYPE_IPV6: "IPv6", LINKTYPE_LINUX_SLL2: "Linux SLL2"}


def undecoded_linktype(linktype: int) -> str:
    """The words for a link type parsers.roce does not decode."""
    return (f"link type {linktype} is not one ckptd decodes "
            f"({', '.join(f'{t} {n}' for t, n in DECODED_LINKTYPES.items())})")


# The largest record a capture may hold: tcpdump's and Wireshark's maximum snaplen. A
# record claiming more is a broken or hostile header (not a packet), refused before its
# length sizes any read or buffer.
MAX_SNAPLEN = 262144


class CaptureError(CkptdError):
    """The capture file itself is broken (bad magic, truncated record, bad block).

    The message names the file and the frame or block number, so a user can find the
    spot with another tool.  Packets that merely fail to decode are not this: they get
    a FrameClass from parsers.roce.decode_frame.
    """


class NotACaptureError(CaptureError):
    """Nothing of it is a capture: its first bytes are no pcap or pcapng header (or there
    are none). Raised before any frame is yielded."""


class UndecodedLinkTypeError(CaptureError):
    """No frame of the capture can be decoded: its link type (every pcapng interface's
    before the first packet) is none parsers.roce decodes. Raised before any frame is
    yielded, so that a reader can refuse the file up front (capfile.capture_format)."""


@dataclass(slots=True)
class CapturedFrame:
    index: int            # 1-based frame number in the file, as Wireshark numbers them
    ts_ns: int | None     # capture time, ns since the epoch (None: pcapng simple packet
                          # block, which has no timestamp)
    linktype: int         # LINKTYPE_* of the interface that captured it
    caplen: int           # bytes captured (== len(data))
    origlen: int          # bytes on the wire; > caplen when the snap length cut it
    data: bytes
    interface_id: int = 0  # pcapng interface; 0 for pcap

    @property
    def truncated(self) -> bool:
        return self.caplen < self.origlen

    @property
    def merge_time(self) -> int:
        """When the frame goes in a merge of several captures: its capture time, or where
        it has none (a pcapng simple block; a file written with zero timestamps) its frame
        number, so that streams without timestamps interleave frame by frame: merged
        one whole file after the other, copies of a packet met only after its iteration
        had been given up, and every iteration a lossy first file missed was lost.
        cython_ext's PcapMerge orders pcap records by the same rule."""
        return self.ts_ns or self.index
