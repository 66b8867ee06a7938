"""Arista EOS: `monitor session` lines (SPAN to a port, or to a GRE tunnel for ERSPAN).

    monitor session NAME source INTF rx|tx|both
    monitor session NAME destination INTF
    monitor session NAME destination tunnel mode gre source IP destination IP
        [ttl N] [dscp N] [protocol 0xHHHH] [vrf VRF]

EOS lets the GRE protocol be chosen, so 0x88be (ERSPAN II, or I without sequence
numbers, depending on the platform), 0x22eb and 0x6558 all pass through as asked.
"""
from __future__ import annotations

from .common import gre_hex, header
from .select import Selection


def render(sel: Selection, switch) -> dict[str, str]:
    lines = header(sel, switch, "!", "Arista EOS")
    for s in sel.sessions_on(switch.name):
        lines.append("!")
        for port in s.ports:
            lines.append(f"monitor session {s.name} source {port} {s.direction}")
        if switch.mode == "erspan":
            e = switch.erspan
            dest = (f"monitor session {s.name} destination tunnel mode gre source {e.src_ip} "
                    f"destination {s.collector.ip} ttl {e.ttl} dscp {e.dscp} protocol {gre_hex(e.gre_type)}")
            if e.vrf:
                dest += f" vrf {e.vrf}"
            lines.append(dest)
        else:
            lines.append(f"monitor session {s.name} destination {s.collector.port}")
    return {"eos.cfg": "\n".join(lines) + "\n"}
