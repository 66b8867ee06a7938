"""Ethernet II with any number of stacked VLAN tags (802.1Q, 802.1ad QinQ, old 0x9100).

A tag is a TPID (sitting where the EtherType would be) followed by a TCI and the next
EtherType, so the parser keeps reading 4-byte tags while the type field holds a TPID.
Mirror ports often add an outer tag of their own, and switches use 0x88a8 or the
pre-standard 0x9100 for it, so all three are accepted at any depth.
"""
from __future__ import annotations

from .header import Header

ETH_TYPE_IPV4 = 0x0800
ETH_TYPE_ARP = 0x0806
ETH_TYPE_IPV6 = 0x86DD
VLAN_TPIDS = frozenset({0x8100, 0x88A8, 0x9100})


class VlanTag(Header):
    """The 4 bytes after a TPID: TCI (PCP, DEI, VID) and the next EtherType."""
    FIELDS = (
        ("pcp", 3),
        ("dei", 1),
        ("vid", 12),
        ("type", 16),   # EtherType (or another TPID) that follows this tag
    )
    tpid = 0x8100       # the TPID that introduced this tag; set by the parser

    def __repr__(self):
        return f"VlanTag(tpid={self.tpid:#06x}, pcp={self.pcp}, dei={self.dei}, vid={self.vid})"


def parse_tags(buf, offset: int, ethertype: int) -> tuple[list[VlanTag], int, int]:
    """Read tags while `ethertype` is a TPID; returns (tags, inner EtherType, new offset).

    Shared with the Linux cooked-capture headers, whose protocol field can be a TPID too.
    """
    tags = []
    while ethertype in VLAN_TPIDS:
        tag = VlanTag.unpack(buf, offset)
        tag.tpid = ethertype
        tags.append(tag)
        ethertype = tag.type
        offset += VlanTag.LEN
    return tags, ethertype, offset


class Ethernet(Header):
    FIELDS = (
        ("dst", 48),
        ("src", 48),
        ("type", 16),   # first type field on the wire: a TPID when tagged
    )

    def __init__(self, tags=(), **values):
        super().__init__(**values)
        self.tags = list(tags)

    @classmethod
    def unpack(cls, buf, offset=0):
        eth = super().unpack(buf, offset)
        # An inner "type" below 0x0600 is an 802.3 length (LLC follows): simply not IP.
        eth.tags, _, _ = parse_tags(buf, offset + cls.LEN, eth.type)
        return eth

    @property
    def ethertype(self) -> int:
        """The EtherType after all tags: what the payload is."""
        return self.tags[-1].type if self.tags else self.type

    @property
    def hdr_len(self) -> int:
        return self.LEN + VlanTag.LEN * len(self.tags)

    @property
    def vlan_ids(self) -> list[int]:
        return [t.vid for t in self.tags]

    def pack(self) -> bytes:
        # Rebuild the type chain from the tags so that packing what we unpacked is exact.
        out = bytearray(super().pack())
        for tag in self.tags:
            out += tag.pack()
        return bytes(out)

    @staticmethod
    def build(dst: int | bytes, src: int | bytes, ethertype: int, tags=()) -> "Ethernet":
        """Ethernet header for `ethertype` under `tags` [(tpid, vid[, pcp]), ...], outer first."""
        dst = int.from_bytes(dst, "big") if isinstance(dst, (bytes, bytearray)) else dst
        src = int.from_bytes(src, "big") if isinstance(src, (bytes, bytearray)) else src
        chain = [t[0] for t in tags] + [ethertype]
        built = []
        for i, t in enumerate(tags):
            tag = VlanTag(vid=t[1], pcp=t[2] if len(t) > 2 else 0, type=chain[i + 1])
            tag.tpid = t[0]
            built.append(tag)
        return Ethernet(dst=dst, src=src, type=chain[0], tags=built)

    def __repr__(self):
        return (f"Ethernet(dst={mac_str(self.dst)}, src={mac_str(self.src)}, "
                f"type={self.ethertype:#06x}, tags={self.tags})")


def mac_str(mac: int) -> str:
    return ":".join(f"{b:02x}" for b in mac.to_bytes(6, "big"))


__all__ = ["Ethernet", "VlanTag", "parse_tags", "mac_str",
           "ETH_TYPE_IPV4", "ETH_TYPE_IPV6", "ETH_TYPE_ARP", "VLAN_TPIDS"]
