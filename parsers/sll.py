"""Linux "cooked" capture headers: SLL (linktype 113) and SLL2 (linktype 276).

`tcpdump -i any` writes these instead of Ethernet.  Both end in a protocol field that
holds the EtherType of what follows (possibly a VLAN TPID, as libpcap re-inserts tags
the kernel stripped).
"""
from __future__ import annotations

from .header import Header


class SLL(Header):
    FIELDS = (
        ("pkttype", 16),     # 0 to us, 1 broadcast, 2 multicast, 3 other host, 4 outgoing
        ("hatype", 16),      # ARPHRD_ type of the device
        ("halen", 16),
        ("addr", 64),        # first `halen` bytes are the link-layer source address
        ("protocol", 16),    # EtherType
    )


class SLL2(Header):
    FIELDS = (
        ("protocol", 16),    # EtherType
        ("reserved", 16),
        ("ifindex", 32),
        ("hatype", 16),
        ("pkttype", 8),
        ("halen", 8),
        ("addr", 64),
    )
