"""H3C Comware 7: numbered mirroring groups.

Local port mirroring (SPAN): a local group, its mirroring ports with a direction
(inbound = RX, outbound = TX, both) and a monitor port.  Layer 3 remote mirroring in
ERSPAN mode is also a local group, whose monitor port sends the GRE tunnel:
`monitor-port INTF destination-ip IP source-ip IP [dscp N] [vrf-instance VRF]`.
Comware picks the GRE protocol and TTL itself, so only 0x88be is accepted here.
"""
from __future__ import annotations

from .common import RenderError, header
from .select import Selection

DIRECTION = {"rx": "inbound", "tx": "outbound", "both": "both"}


def render(sel: Selection, switch) -> dict[str, str]:
    lines = header(sel, switch, "#", "H3C Comware")
    if switch.mode == "erspan" and switch.erspan.gre_type != 0x88BE:
        raise RenderError(f"{switch.name}: Comware does not let the GRE protocol be chosen "
                          f"({switch.erspan.gre_type:#06x} asked); use gre_type 0x88be")
    for s in sel.sessions_on(switch.name):
        g = f"mirroring-group {s.index}"
        lines += ["#", f"{g} local"]
        lines += [f"{g} mirroring-port {p} {DIRECTION[s.direction]}" for p in s.ports]
        if switch.mode == "erspan":
            e = switch.erspan
            mon = (f"{g} monitor-port {e.egress_port} destination-ip {s.collector.ip} "
                   f"source-ip {e.src_ip} dscp {e.dscp}")
            if e.vrf:
                mon += f" vrf-instance {e.vrf}"
            lines.append(mon)
        else:
            lines.append(f"{g} monitor-port {s.collector.port}")
    return {"comware.cfg": "\n".join(lines) + "\n#\n"}
