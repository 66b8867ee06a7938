"""Whether an IP address can be one host's: a RoCE NIC's (a rank's address in a plan) or
an ERSPAN tunnel's end (a switch's source, a collector). A multicast group, the
unspecified address or IPv4's limited broadcast parse as addresses, and were taken: a
tunnel to 224.0.0.5 or 0.0.0.0 mirrors into nothing (or the switch refuses the config
when it is applied), with mirror-config reporting every chunk covered."""
from __future__ import annotations

import ipaddress


def not_a_host(addr: str) -> str | None:
    """Why `addr` (an address ipaddress parses) is no single host's; None when it can be."""
    a = ipaddress.ip_address(addr)
    if a.is_multicast:
        return "a multicast address"
    if a.is_unspecified:
        return "the unspecified address"
    if a == ipaddress.IPv4Address("255.255.255.255"):
        return "the broadcast address"
    return None
